"""Per-call cost of the lowered annotation op against torch_xla's ``mark_sharding``.

On an intermediate XLA tensor ``a`` (4 CPU devices, SPMD), times per call:
  mul       ``a * 1``                                     (the copy both sides make)
  ours      ``xla_ops.sharding_constraint(a, spec_text)``  (its kernel does ``a * 1`` + cached OpSharding)
  xs        ``b = a * 1; xs.mark_sharding(b, mesh, partition_spec)``  (in place, so a fresh ``b``)
Both ``ours`` and ``xs`` include one multiply; mesh and partition spec for ``xs`` are built once.

Target: ours / xs <= 0.1.
Usage: python benchmarks/annotation_cost.py   (needs torch_xla; exits 0; prints PASS/FAIL)
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402

from hops._compat import torch_xla_available  # noqa: E402

CALLS = 200  # per sample
SAMPLES = 15  # per alternative, interleaved


def main() -> None:
    if not torch_xla_available():
        print(f"torch {torch.__version__}: skipped: needs torch_xla")
        return
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import hops
    from passes.xla import ops as xla_ops

    xr.use_spmd()
    device = torch_xla.device()
    spec = hops.ShardingSpec(hops.Mesh((2, 2), ("data", "model")), (hops.Shard(0), hops.Replicate()))
    spec_text = repr(spec)
    a = torch.randn(64, 64, device=device) + 1  # an IR value, not device data
    xla_mesh = spec.mesh.to_xla()
    partition_spec = spec.to_partition_spec(a.dim())

    def mul() -> None:
        for _ in range(CALLS):
            a * 1

    def ours() -> None:
        for _ in range(CALLS):
            xla_ops.sharding_constraint(a, spec_text)

    def mark_sharding() -> None:
        for _ in range(CALLS):
            xs.mark_sharding(a * 1, xla_mesh, partition_spec)

    # Both sides must attach the same sharding, or the comparison is moot.
    b = a * 1
    xs.mark_sharding(b, xla_mesh, partition_spec)
    ours_sharding = torch_xla._XLAC._get_xla_sharding_spec(xla_ops.sharding_constraint(a, spec_text))
    if not ours_sharding or ours_sharding != torch_xla._XLAC._get_xla_sharding_spec(b):
        print(f"FAIL shardings differ: ours {ours_sharding!r}, xs "
              f"{torch_xla._XLAC._get_xla_sharding_spec(b)!r}")
        return

    alternatives = {"mul": mul, "ours": ours, "xs": mark_sharding}
    for fn in alternatives.values():  # warm up: caches, first-call dispatch
        fn()
    samples: dict[str, list[float]] = {name: [] for name in alternatives}
    for _ in range(SAMPLES):
        for name, fn in alternatives.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)

    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
          f"{xr.global_runtime_device_count()} devices; us per call, {SAMPLES} samples of {CALLS} calls")
    best = {name: min(ts) for name, ts in samples.items()}
    median = {name: statistics.median(ts) for name, ts in samples.items()}
    for name in alternatives:
        print(f"  {name:5s} best {best[name]:8.2f} us   median {median[name]:8.2f} us")
    for label, stat in (("best", best), ("median", median)):
        net_ours, net_xs = stat["ours"] - stat["mul"], stat["xs"] - stat["mul"]
        print(f"  {label}: ours/xs {stat['ours'] / stat['xs']:.3f} (each incl. one a * 1); "
              f"without the multiply {net_ours:.2f} / {net_xs:.2f} us = {net_ours / net_xs:.3f}")
    ratio = median["ours"] / median["xs"]
    verdict = "PASS" if ratio <= 0.1 else "FAIL"
    print(f"{verdict} ours / xs.mark_sharding per call (medians, incl. the multiply): "
          f"{ratio:.3f} (target <= 0.1)")


if __name__ == "__main__":
    main()
