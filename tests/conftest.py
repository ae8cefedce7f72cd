"""Test set-up shared by every test module.

torch_xla reads PJRT_DEVICE / CPU_NUM_DEVICES when it starts, and jax reads XLA_FLAGS, so they
are set before any import of either. When torch_xla is present, SPMD is switched on and the XLA device is created
at session start, and one XLA backward runs: autograd on XLA tensors fails if a CPU
backward ran first, and tests must not depend on their order.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
# jax (target "jax", tests/test_jax_target.py) reads this when it is first imported: 4 virtual CPU
# devices for its meshes. Appended to flags already set (the 2.9 leg's XLA tests pass with it: torch_xla
# sizes its CPU client from CPU_NUM_DEVICES, also 4).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One process per core already (setup.cfg runs the tests on pytest-xdist's workers): a
    # worker's own thread pools (ATen's intra-op threads, inductor's compile workers) would only
    # contend for the same cores; the tests' tensors are small. Measured: ~10% less wall time.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hops._compat import torch_xla_available  # noqa: E402

if torch_xla_available():
    import torch_xla  # noqa: E402
    import torch_xla.runtime as xr  # noqa: E402

    xr.use_spmd()
    # The autograd engine sizes its per-device queues at the first backward it runs; make
    # that one an XLA backward so later XLA backwards work whatever ran before them.
    _probe = torch.ones(1, device=torch_xla.device(), requires_grad=True)
    (_probe * 2).sum().backward()
    del _probe


def pytest_collection_modifyitems(config, items):
    if torch_xla_available():
        return
    skip = pytest.mark.skip(
        reason="needs torch_xla (only built for torch 2.9.0; install the 'xla' extra)"
    )
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
