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
# XLA:CPU's LLVM without its costly optimizations (torch_xla and jax alike): the tests' programs
# are tiny and compiling them is their cost (test_xla_scan: 46 s of CPU against 57 s). XLA's HLO
# passes, sharding propagation and partitioning, which the tests read, are unchanged.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One process per core already (setup.cfg runs the tests on pytest-xdist's workers): a
    # worker's own thread pools (ATen's intra-op threads, inductor's compile workers) would only
    # contend for the same cores; the tests' tensors are small. Measured: ~10% less wall time.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Inductor's CPU kernels as scalar C++ loops: g++ compiles at::vec's vectorized templates in about
# twice the time (measured on a chain of scans: 24 s against 15 s of CPU, g++ 16 s against 8.5 s),
# and most of the suite's time is inductor compiling tiny programs. The package's rules act on
# graphs, above the kernels' instruction set. A vectorized PCH in a subprocess cost more than it
# saved (the every-sample subprocess test took 147 s against 72 s); the scripts in benchmarks/
# compile with inductor's default (vectorized) code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

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


# The modules that take longest (measured with an empty inductor cache), longest first. With
# `--dist loadfile --no-loadscope-reorder` (setup.cfg) each worker takes the next module in this
# order as it frees up, so the two workers end together instead of one finishing a long module
# alone. The order changes no result.
LONGEST_FIRST = [
    "test_real_models", "test_inductor", "test_layouts", "test_examples", "test_solver_scale",
    "test_random_bodies_against_reference", "test_export_serialization", "test_dynamo_errors",
    "test_inductor_chains", "test_solver_example", "test_jax_op_families", "test_inductor_pass_chaining",
    "test_solver_scan_quality", "test_dtensor", "test_numbers_in_bodies", "test_jax_real_models", "test_scan",
    "test_jax_backend", "test_backward_regions_in_scan", "test_xla_user_programs", "test_device_targets",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    if torch_xla_available():
        return
    skip = pytest.mark.skip(
        reason="needs torch_xla (only built for torch 2.9.0; install the 'xla' extra)"
    )
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
