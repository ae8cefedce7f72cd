"""The cost model: seconds of compute per strategy and of communication per redistribution.

Compute is a roofline on each device's local shapes: ``max(flops / peak_flops, bytes /
memory_bandwidth)``, with FLOPs from torch's own table (``torch.utils.flop_counter``) or an
einsum's equation; views (and their functional ``*_copy`` forms) and allocations are free.
Communication is priced per mesh axis with an alpha-beta model: a collective over an axis of
``n`` devices costs the axis's ``link_latency`` plus the bytes each device sends over its
``link_bandwidth``:

- ``Shard -> Replicate`` (all-gather): ``(n - 1) * local_bytes``;
- ``Partial -> Replicate`` (all-reduce): ``2 (n - 1) / n * local_bytes``;
- ``Partial -> Shard`` (reduce-scatter), ``Shard(i) -> Shard(j)`` (all-to-all): ``(n - 1) / n * local_bytes``;
- ``Replicate -> Shard`` / ``Replicate -> Partial``: local, a copy of the result at ``memory_bandwidth``.

The axes change in the order DTensor plans (``redistribution_steps``): from the last axis to the
first, then what is left from the first to the last; a shard nested in another axis's shard of
the same dim is gathered before it (one more collective on meshes of 2 or more axes). Presets hold public peak numbers
of common devices; every field can be overridden (``CostModel.preset("h100", link_bandwidth=(50e9, 450e9))``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from typing import Any, Sequence

import torch

from hops.specs import Mesh, Partial, Replicate, Shard

__all__ = ["CostModel", "PRESETS", "redistribution_steps"]


def _per_axis(value: float | Sequence[float], mesh: Mesh, name: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * mesh.ndim
    values = tuple(float(v) for v in value)
    if len(values) != mesh.ndim:
        raise ValueError(f"CostModel.{name} has {len(values)} entries but the mesh has {mesh.ndim} axes {mesh.axis_names}")
    return values


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Device and interconnect parameters, in SI units (FLOP/s, bytes/s, seconds).

    ``link_bandwidth`` / ``link_latency``: one value for every mesh axis, or one per axis.
    ``optimizer_state_bytes``: bytes of optimizer state per byte of parameter (2 for Adam's
    two moments in the parameter's dtype), counted in memory budgets.
    """

    peak_flops: float
    memory_bandwidth: float
    link_bandwidth: float | tuple[float, ...]
    link_latency: float | tuple[float, ...]
    optimizer_state_bytes: float = 2.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("peak_flops", "memory_bandwidth"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"CostModel({field}=...) must be a positive number, got {value!r}")
        for field in ("link_bandwidth", "link_latency"):
            value = getattr(self, field)
            values = (value,) if isinstance(value, (int, float)) else tuple(value)
            if not values or any(not isinstance(v, (int, float)) or v < 0 for v in values):
                raise ValueError(f"CostModel({field}=...) must be a number >= 0 or a tuple of them, got {value!r}")
            if field == "link_bandwidth" and any(v == 0 for v in values):
                raise ValueError(f"CostModel(link_bandwidth=...) must be positive, got {value!r}")
        for field in ("link_bandwidth", "link_latency"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)):
                object.__setattr__(self, field, tuple(value))  # hashable: costs are cached per model
        if not isinstance(self.optimizer_state_bytes, (int, float)) or self.optimizer_state_bytes < 0:
            raise ValueError(f"CostModel(optimizer_state_bytes=...) must be >= 0, got {self.optimizer_state_bytes!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CostModel:
        """A preset of ``PRESETS`` by name, with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"CostModel.preset: unknown device {name!r}; presets are {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    # ------------------------------------------------------------------ compute

    def compute_seconds(
        self,
        target: Any,
        input_shapes: Sequence[Sequence[int] | None],
        output_shapes: Sequence[Sequence[int] | None],
        itemsize: int,
        params: dict | None = None,
    ) -> float:
        """Roofline time of one call of ``target`` on these (local) shapes."""
        from passes.solver.graph import is_view

        if is_view(target) or _is_allocation(target):
            return 0.0
        moved = sum(math.prod(s) for s in (*input_shapes, *output_shapes) if s is not None) * itemsize
        flops = _flops(target, input_shapes, output_shapes, params)
        return max(flops / self.peak_flops, moved / self.memory_bandwidth)

    # ------------------------------------------------------------------ communication

    def redistribute_seconds(
        self, shape: Sequence[int], itemsize: int, source: Sequence[Any] | None, target: Sequence[Any] | None, mesh: Mesh
    ) -> float:
        """Time to turn a tensor laid out as ``source`` into ``target``."""
        if source is None or target is None:
            return 0.0
        fixed, per_byte = self.redistribute_terms(source, target, mesh)
        return fixed + per_byte * (math.prod(shape) * itemsize)

    def redistribute_terms(self, source: Sequence[Any], target: Sequence[Any], mesh: Mesh) -> tuple[float, float]:
        """``(seconds, seconds_per_byte)``: turning a tensor of ``B`` bytes laid out as ``source``
        into ``target`` takes ``seconds + B * seconds_per_byte`` (every step moves a fixed share
        of the value's bytes), whatever its shape."""
        source, target = tuple(source), tuple(target)
        if source == target:
            return 0.0, 0.0
        bandwidth, latency = _links(self, mesh)
        # Share of the value's bytes per device as the steps go: one over the ways its dims are split.
        local = 1.0 / _ways(source, mesh.shape)
        fixed = per_byte = 0.0
        for axis, before, after, ratio in _steps(source, target, mesh.shape):
            n = mesh.shape[axis]
            sent = _bytes_sent(before, after, n, local)
            local *= ratio
            if sent is None:
                # Local: copy out this device's slice (R -> S) or zero a copy (R -> P).
                if n > 1:
                    per_byte += local / self.memory_bandwidth
                continue
            fixed += latency[axis]
            per_byte += sent / bandwidth[axis]
        return fixed, per_byte

    def redistribute_terms_table(
        self, sources: Sequence[Sequence[Any] | None], targets: Sequence[Sequence[Any] | None], mesh: Mesh
    ) -> tuple[Any, Any]:
        """``redistribute_terms`` from each of ``sources`` to each of ``targets``, as two arrays of
        shape ``(len(sources), len(targets))`` (computed for all pairs at once; ``None``, a
        non-tensor, costs nothing)."""
        import numpy as np

        codes: dict[Any, int] = {Replicate(): 0}

        def encode(layouts: Sequence[Any]) -> tuple[Any, Any]:
            out = np.zeros((len(layouts), mesh.ndim), dtype=np.int64)
            valid = np.array([p is not None for p in layouts], dtype=bool)
            for i, p in enumerate(layouts):
                if p is not None:
                    out[i] = [codes.setdefault(x, len(codes)) for x in p]
            return out, valid

        src, src_valid = encode(sources)
        tgt, tgt_valid = encode(targets)
        kinds = list(codes)
        shard = np.array([isinstance(x, Shard) for x in kinds])
        partial = np.array([isinstance(x, Partial) for x in kinds])
        ns, nt = len(sources), len(targets)
        current = np.repeat(src, nt, axis=0)
        target = np.tile(tgt, (ns, 1))
        sizes = np.array(mesh.shape, dtype=float)
        bandwidth, latency = _links(self, mesh)

        def ways(layout: Any) -> Any:
            return np.where(shard[layout], sizes, 1.0).prod(axis=1)

        local = 1.0 / ways(current)
        fixed = np.zeros(len(current))
        per_byte = np.zeros(len(current))

        def step(rows: Any, axis: int, goal: Any) -> None:
            n = mesh.shape[axis]
            before, after = current[rows, axis], goal[rows]
            changed = current[rows].copy()
            changed[:, axis] = after
            here = local[rows] * ways(current[rows]) / ways(changed)
            if n > 1:
                # Bytes sent per byte of this device's share (see ``_bytes_sent``); < 0: a local step.
                sent = np.full(len(before), -1.0)
                from_shard, from_partial = shard[before], partial[before]
                sent[from_shard] = np.where(shard[after[from_shard]], (n - 1) / n, float(n - 1))
                to_replicate = after == 0
                sent[from_partial & to_replicate] = 2 * (n - 1) / n
                sent[from_partial & shard[after]] = (n - 1) / n
                moving = sent >= 0
                fixed[rows[moving]] += latency[axis]
                per_byte[rows[moving]] += sent[moving] * local[rows[moving]] / bandwidth[axis]
                per_byte[rows[~moving]] += here[~moving] / self.memory_bandwidth
            current[rows, axis] = after
            local[rows] = here

        # DTensor's plan (``redistribution_steps``), for every pair at once.
        sharded = shard[current].any(axis=1)
        for axis in reversed(range(mesh.ndim)):
            goal = target[:, axis].copy()
            nested = shard[goal]
            if axis:
                before = current[:, :axis] == goal[:, None]
                after = target[:, :axis] == goal[:, None]
                nested &= (before != after).any(axis=1)
            else:
                nested[:] = False
            goal[nested] = 0
            step(np.flatnonzero(sharded & (current[:, axis] != goal)), axis, goal)
        for axis in range(mesh.ndim):
            step(np.flatnonzero(current[:, axis] != target[:, axis]), axis, target[:, axis])
        valid = np.repeat(src_valid, nt) & np.tile(tgt_valid, ns)
        fixed[~valid] = 0.0
        per_byte[~valid] = 0.0
        return fixed.reshape(ns, nt), per_byte.reshape(ns, nt)


# Ops that only allocate (their values are undefined): no byte is read or written.
ALLOCATION_OPS = frozenset(("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"))


def _is_allocation(target: Any) -> bool:
    return getattr(getattr(target, "overloadpacket", None), "__name__", None) in ALLOCATION_OPS


@functools.lru_cache(maxsize=None)
def _links(model: CostModel, mesh: Mesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return _per_axis(model.link_bandwidth, mesh, "link_bandwidth"), _per_axis(model.link_latency, mesh, "link_latency")


def _ways(placements: Sequence[Any], sizes: Sequence[int]) -> int:
    return math.prod(n for n, p in zip(sizes, placements) if isinstance(p, Shard))


@functools.lru_cache(maxsize=None)
def _steps(source: tuple, target: tuple, sizes: tuple[int, ...]) -> tuple[tuple[int, Any, Any, float], ...]:
    """``redistribution_steps``, each with the factor by which it changes the local bytes
    (shape-independent, so shared by every value laid out alike)."""
    out, current = [], list(source)
    for axis, before, after in redistribution_steps(source, target):
        old = _ways(current, sizes)
        current[axis] = after
        out.append((axis, before, after, old / _ways(current, sizes)))
    return tuple(out)


def redistribution_steps(source: Sequence[Any], target: Sequence[Any]) -> list[tuple[int, Any, Any]]:
    """The per-axis changes ``(axis, before, after)`` that turn ``source`` into ``target``, in
    order, as DTensor plans them on a mesh of any rank (its default, left-to-right shard order):

    1. axes from the last to the first: each goes to its target, except that an axis whose target
       is ``Shard(d)`` while the axes before it shard dim ``d`` differently than in the target is
       first made ``Replicate`` (its shard is nested in another: ``(S(1), S(0), S(1))`` to
       ``(R, S(0), S(1))`` gathers the last axis and the first, then slices the last again);
    2. axes from the first to the last: what still differs goes to its target.
    """
    current, target = list(source), list(target)
    steps = []
    if any(isinstance(p, Shard) for p in current):
        for axis in reversed(range(len(current))):
            goal = target[axis]
            if isinstance(goal, Shard):
                before = [i for i in range(axis) if current[i] == goal]
                after = [i for i in range(axis) if target[i] == goal]
                if before != after:
                    goal = Replicate()
            if current[axis] != goal:
                steps.append((axis, current[axis], goal))
                current[axis] = goal
    for axis, goal in enumerate(target):
        if current[axis] != goal:
            steps.append((axis, current[axis], goal))
            current[axis] = goal
    return steps


def _bytes_sent(before: Any, after: Any, n: int, local: float) -> float | None:
    """Bytes each device sends to change one mesh axis from ``before`` to ``after`` (``None``: local)."""
    if n == 1:
        return None
    if isinstance(before, Replicate):
        return None  # R -> S is a local slice; R -> P keeps the value on one device
    if isinstance(before, Shard):
        if isinstance(after, Shard):
            return (n - 1) / n * local  # all-to-all
        return (n - 1) * local  # all-gather (then zero elsewhere for Partial)
    if isinstance(before, Partial):
        if isinstance(after, Replicate):
            return 2 * (n - 1) / n * local  # all-reduce
        if isinstance(after, Shard):
            return (n - 1) / n * local  # reduce-scatter
        return None
    return None


# --------------------------------------------------------------------------- FLOPs


def _flops(target: Any, input_shapes: Sequence[Any], output_shapes: Sequence[Any], params: dict | None) -> float:
    from torch.utils.flop_counter import flop_registry

    if params and "equation" in params:
        return _einsum_flops(params["equation"], input_shapes)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is not None:
        try:
            out = torch.Size(output_shapes[0]) if len(output_shapes) == 1 else tuple(output_shapes)
            return float(formula(*[torch.Size(s) if s is not None else None for s in input_shapes], out_val=out))
        except Exception:  # a formula that needs arguments other than shapes: count elements
            pass
    return float(sum(math.prod(s) for s in output_shapes if s is not None))


def _einsum_flops(equation: str, input_shapes: Sequence[Sequence[int]]) -> float:
    inputs = equation.partition("->")[0].split(",")
    sizes: dict[str, int] = {}
    for subscripts, shape in zip(inputs, input_shapes):
        letters = [c for c in subscripts if c in string.ascii_letters]
        for letter, size in zip(letters, shape or ()):
            sizes[letter] = size
    return 2.0 * math.prod(sizes.values())


# Public peak numbers (dense bf16, HBM, per-device link), rounded; latencies typical.
PRESETS: dict[str, CostModel] = {
    "h100": CostModel(989e12, 3.35e12, 450e9, 5e-6, name="h100"),
    "a100": CostModel(312e12, 2.0e12, 300e9, 5e-6, name="a100"),
    "tpu-v5e": CostModel(197e12, 819e9, 50e9, 2e-6, name="tpu-v5e"),
    "tpu-v5p": CostModel(459e12, 2.76e12, 100e9, 2e-6, name="tpu-v5p"),
    "cpu": CostModel(200e9, 50e9, 10e9, 20e-6, name="cpu"),
}
