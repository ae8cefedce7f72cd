"""Typed, immutable spec values that HOPs of this package take as node arguments.

Every value here is a frozen dataclass: equal and hashable by value, picklable and
deep-copyable. Its ``repr`` is Python that re-creates an equal value wherever the name
``hops`` is bound, which includes the globals of every FX-generated module (see
``hops._compat.register_fx_global``), and ``__fx_create_arg__`` keeps it a literal
constant in FX node args instead of a constructor node.

Placements use DTensor's vocabulary (``Shard(d)``, ``Replicate()``, ``Partial(op)``),
one per mesh axis, because that is what sharding solvers read and write; conversions to
and from torch_xla partition specs and DTensor objects live beside them.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from typing import Any, Iterable, Sequence

__all__ = [
    "Mesh",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "ShardingSpec",
    "LocalMapSpec",
    "transpose_placement",
    "spec_from_text",
    "register_spec_type",
]

PARTIAL_REDUCE_OPS = ("sum", "avg", "max", "min")


class _FxLiteral:
    """Mixin: FX keeps instances as literal constants in node args."""

    __slots__ = ()

    def __fx_create_arg__(self, tracer: Any) -> Any:
        return self


def _check_int(value: Any, name: str, *, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True, repr=False)
class Mesh(_FxLiteral):
    """A logical device mesh: ``shape``, one name per axis, and row-major device ids.

    A plain value, not a process group: convert with ``to_xla()`` or ``to_device_mesh()``.
    ``device_ids`` defaults to ``0 .. prod(shape) - 1``; it may be given flat or with the
    mesh's shape (a nested sequence or a numpy array).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, int) or not isinstance(self.shape, Iterable):
            raise TypeError(f"Mesh(shape=...) must be a sequence of ints, got {self.shape!r}")
        shape = tuple(
            _check_int(n, f"Mesh(shape=...)[{i}]", minimum=1) for i, n in enumerate(self.shape)
        )
        if not shape:
            raise ValueError("Mesh(shape=...) must have at least one axis, got ()")
        if isinstance(self.axis_names, str) or not isinstance(self.axis_names, Iterable):
            raise TypeError(
                f"Mesh(axis_names=...) must be a sequence of str, got {self.axis_names!r}"
            )
        axis_names = tuple(self.axis_names)
        for i, name in enumerate(axis_names):
            if not isinstance(name, str) or not name.isidentifier():
                raise TypeError(
                    f"Mesh(axis_names=...)[{i}] must be a non-empty identifier str, got {name!r}"
                )
        if len(axis_names) != len(shape):
            raise ValueError(
                f"Mesh(axis_names=...) has {len(axis_names)} names {axis_names} but "
                f"shape {shape} has {len(shape)} axes"
            )
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Mesh(axis_names=...) has duplicate names: {axis_names}")
        size = math.prod(shape)
        device_ids = tuple(range(size)) if self.device_ids is None else self._flat_ids(shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "device_ids", device_ids)

    def _flat_ids(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        ids = self.device_ids
        given_shape = getattr(ids, "shape", None)
        if given_shape is not None and tuple(given_shape) not in ((math.prod(shape),), shape):
            raise ValueError(
                f"Mesh(device_ids=...) has shape {tuple(given_shape)}, expected {shape} "
                f"or flat ({math.prod(shape)},)"
            )
        flat = list(ids.flatten().tolist() if hasattr(ids, "flatten") else _flatten(ids))
        if len(flat) != math.prod(shape):
            raise ValueError(
                f"Mesh(device_ids=...) has {len(flat)} ids but shape {shape} needs "
                f"{math.prod(shape)}"
            )
        flat = [_check_int(d, "Mesh(device_ids=...) entry", minimum=0) for d in flat]
        if len(set(flat)) != len(flat):
            raise ValueError(f"Mesh(device_ids=...) has duplicate ids: {tuple(flat)}")
        return tuple(flat)

    @property
    def size(self) -> int:
        return len(self.device_ids)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_index(self, axis_name: str) -> int:
        """Position of ``axis_name`` in the mesh; ``ValueError`` if the mesh has no such axis."""
        if axis_name not in self.axis_names:
            raise ValueError(f"unknown mesh axis {axis_name!r}; the mesh has axes {self.axis_names}")
        return self.axis_names.index(axis_name)

    @classmethod
    def of(cls, device_ids: Any = None, /, **axes: int) -> Mesh:
        """``Mesh.of(data=2, model=2)``: axes by name and size, in order (the repr's form)."""
        return cls(tuple(axes.values()), tuple(axes.keys()), device_ids)

    def __repr__(self) -> str:
        ids = "" if self.device_ids == tuple(range(self.size)) else f"{self.device_ids!r}, "
        axes = ", ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.shape))
        return f"hops.Mesh.of({ids}{axes})"

    # -- conversions
    def to_xla(self) -> Any:
        """The equivalent ``torch_xla.distributed.spmd.Mesh``; ``ValueError`` when this mesh
        is not the XLA runtime's devices (``xla_mismatch``)."""
        import numpy as np

        xs = _import_xla_spmd()
        problem = self.xla_mismatch()
        if problem is not None:
            raise ValueError(f"Mesh.to_xla(): {problem}")
        return xs.Mesh(np.array(self.device_ids), self.shape, self.axis_names)

    def xla_mismatch(self) -> str | None:
        """Why this mesh is not a mesh of the XLA runtime's devices, or None when it is
        (imports torch_xla). Under SPMD an XLA mesh holds every device of the runtime once:
        ids ``0..n-1`` for ``n`` devices, in any order."""
        _import_xla_spmd()
        from torch_xla import runtime

        count = runtime.global_runtime_device_count()
        ids = sorted(self.device_ids)
        if ids == list(range(count)):
            return None
        addressable = runtime.addressable_runtime_device_count()
        return (
            f"its mesh {self!r} has devices {ids}, but this process has {count} XLA devices "
            f"(0..{count - 1}, {addressable} addressable); an XLA mesh must use each device once"
        )

    @classmethod
    def from_xla(cls, xla_mesh: Any) -> Mesh:
        names = xla_mesh.axis_names
        if names is None:
            names = tuple(f"axis{i}" for i in range(len(xla_mesh.mesh_shape)))
        return cls(tuple(xla_mesh.mesh_shape), tuple(names), tuple(int(i) for i in xla_mesh.device_ids))

    def to_device_mesh(self, device_type: str = "cpu") -> Any:
        """The equivalent DTensor ``DeviceMesh``; needs an initialized process group of
        at least ``size`` ranks (a fake process group is enough for tracing)."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Mesh.to_device_mesh() needs an initialized torch.distributed process group "
                "(for tracing, init_process_group('fake', ...) is enough)"
            )
        if dist.get_world_size() < max(self.device_ids) + 1:
            raise ValueError(
                f"Mesh.to_device_mesh(): mesh uses device ids up to {max(self.device_ids)} "
                f"but the process group has world size {dist.get_world_size()}"
            )
        from torch.distributed.device_mesh import DeviceMesh

        ids = torch.tensor(self.device_ids, dtype=torch.int).reshape(self.shape)
        return DeviceMesh(device_type, ids, mesh_dim_names=self.axis_names)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        ids = device_mesh.mesh
        names = device_mesh.mesh_dim_names
        if names is None:
            names = tuple(f"axis{i}" for i in range(ids.ndim))
        return cls(tuple(ids.shape), tuple(names), tuple(int(i) for i in ids.flatten().tolist()))


def _flatten(ids: Any) -> list[Any]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"Mesh(device_ids=...) must be a sequence of ints, got {ids!r}")
    out: list[Any] = []
    for item in ids:
        if isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def _import_xla_spmd() -> Any:
    try:
        import torch_xla.distributed.spmd as xs
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "this conversion needs torch_xla (install the 'xla' extra: pip install -e '.[xla]')"
        ) from e
    return xs


# --------------------------------------------------------------------------- placements


class Placement(_FxLiteral):
    """How a tensor is laid out along one mesh axis (DTensor's vocabulary)."""

    __slots__ = ()

    def to_dtensor(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def from_dtensor(placement: Any) -> Placement:
        """Convert a ``torch.distributed.tensor`` placement to this package's value."""
        from torch.distributed.tensor import placement_types as pt

        if isinstance(placement, pt.Shard):
            return Shard(placement.dim)
        if isinstance(placement, pt.Replicate):
            return Replicate()
        if isinstance(placement, pt.Partial):
            return Partial(placement.reduce_op)
        raise TypeError(
            f"cannot convert {placement!r} (type {type(placement).__name__}) to a placement; "
            "expected DTensor's Shard, Replicate or Partial"
        )


@dataclasses.dataclass(frozen=True, repr=False)
class Shard(Placement):
    """The tensor's ``dim`` is split evenly (GSPMD pads uneven splits) across the mesh axis.

    A negative ``dim`` counts from the last dim, as in DTensor; it is resolved against the
    tensor's rank where the placement meets a tensor (``resolve_dims``), so graph nodes hold
    dims >= 0."""

    dim: int

    def __post_init__(self) -> None:
        _check_int(self.dim, "Shard(dim)", minimum=None)

    def __repr__(self) -> str:
        return f"hops.Shard({self.dim})"

    def to_dtensor(self) -> Any:
        from torch.distributed.tensor import Shard as DTensorShard

        return DTensorShard(self.dim)


@dataclasses.dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every device along the mesh axis holds the whole tensor."""

    def __repr__(self) -> str:
        return "hops.Replicate()"

    def to_dtensor(self) -> Any:
        from torch.distributed.tensor import Replicate as DTensorReplicate

        return DTensorReplicate()


@dataclasses.dataclass(frozen=True, repr=False)
class Partial(Placement):
    """Devices along the mesh axis hold partial values; the tensor is their ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op) must be one of {PARTIAL_REDUCE_OPS}, got {self.reduce_op!r}"
            )

    def __repr__(self) -> str:
        return "hops.Partial()" if self.reduce_op == "sum" else f"hops.Partial({self.reduce_op!r})"

    def to_dtensor(self) -> Any:
        from torch.distributed.tensor import Partial as DTensorPartial

        return DTensorPartial(self.reduce_op)


def is_placement_like(value: Any) -> bool:
    """A placement of this package or of DTensor (recognized by DTensor's Placement API,
    which keeps the check traceable by Dynamo)."""
    return isinstance(value, Placement) or (
        hasattr(value, "is_shard") and hasattr(value, "is_replicate") and hasattr(value, "is_partial")
    )


def _as_placement(value: Any, where: str) -> Placement:
    if isinstance(value, Placement):
        return value
    if is_placement_like(value):
        return Placement.from_dtensor(value)
    raise TypeError(
        f"{where} must be a placement (hops.Shard(d), hops.Replicate(), hops.Partial()), "
        f"got {type(value).__name__} {value!r}"
    )


# --------------------------------------------------------------------------- sharding spec


@dataclasses.dataclass(frozen=True, repr=False)
class ShardingSpec(_FxLiteral):
    """How a global tensor is laid out on ``mesh``: one placement per mesh axis.

    DTensor placements may be passed and are converted. Use ``check_tensor`` to validate
    against a tensor's rank, ``to_partition_spec`` for torch_xla's per-dim form.
    """

    mesh: Mesh
    placements: tuple[Placement, ...]
    grad_placements: tuple[Placement, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"ShardingSpec(mesh=...) must be a hops.Mesh, got {type(self.mesh).__name__}"
            )
        if self.grad_placements is not None:
            grads = self.grad_placements
            if isinstance(grads, str):
                grads = parse_placements(grads, "ShardingSpec(grad_placements=...)")
            grads = placements_tuple(grads, self.mesh, "ShardingSpec(grad_placements=...)")
            object.__setattr__(self, "grad_placements", grads)
        if isinstance(self.placements, str):
            object.__setattr__(self, "placements", parse_placements(self.placements, "ShardingSpec(placements=...)"))
        if isinstance(self.placements, Placement) or not isinstance(self.placements, Iterable):
            raise TypeError(
                "ShardingSpec(placements=...) must be a sequence with one placement per mesh "
                f"axis, got {self.placements!r}"
            )
        placements = tuple(
            _as_placement(p, f"ShardingSpec(placements=...)[{i}]")
            for i, p in enumerate(self.placements)
        )
        if len(placements) != self.mesh.ndim:
            raise ValueError(
                f"ShardingSpec(placements=...) has {len(placements)} placements but the mesh "
                f"has {self.mesh.ndim} axes {self.mesh.axis_names}: give one per mesh axis"
            )
        object.__setattr__(self, "placements", placements)

    def __repr__(self) -> str:
        grads = "" if self.grad_placements is None else f", {placements_text(self.grad_placements)!r}"
        return f"hops.ShardingSpec({self.mesh!r}, {placements_text(self.placements)!r}{grads})"

    @property
    def layout(self) -> ShardingSpec:
        """This spec without a gradient layout: how the value itself is laid out."""
        return self if self.grad_placements is None else ShardingSpec(self.mesh, self.placements)

    @property
    def grad(self) -> ShardingSpec:
        """The spec of the gradient: its layout, and the value's as the gradient's gradient.
        ``spec.grad.grad == spec``."""
        if self.grad_placements is None:
            return self
        return ShardingSpec(self.mesh, self.grad_placements, self.placements)

    @property
    def has_partial(self) -> bool:
        """Whether the value's layout has a pending reduction (no XLA sharding states that)."""
        return any(isinstance(p, Partial) for p in self.placements)

    def check_tensor(self, ndim: int, argument: str) -> None:
        """Raise ``ValueError`` naming ``argument`` if a tensor of rank ``ndim`` cannot take this spec."""
        resolve_dims(self.placements, ndim, argument, self.mesh)

    def for_rank(self, ndim: int, argument: str) -> ShardingSpec:
        """This spec for a tensor of rank ``ndim``: negative ``Shard`` dims resolved (the
        spec itself when it has none); ``ValueError`` naming ``argument`` if out of range."""
        placements = resolve_dims(self.placements, ndim, argument, self.mesh)
        grads = None if self.grad_placements is None else resolve_dims(self.grad_placements, ndim, f"{argument} (gradient)", self.mesh)
        if placements == self.placements and grads == self.grad_placements:
            return self
        return ShardingSpec(self.mesh, placements, grads)

    def to_partition_spec(self, ndim: int) -> tuple[str | tuple[str, ...] | None, ...]:
        """torch_xla's partition spec: for each tensor dim, the mesh axes that split it
        (``None``, one name, or a tuple of names in major-to-minor order)."""
        if self.has_partial:
            raise ValueError(
                f"{self!r} has a Partial placement, which has no XLA partition spec "
                "(a partition spec describes how a whole value is split, not pending reductions)"
            )
        placements = resolve_dims(self.placements, ndim, "to_partition_spec", self.mesh)
        per_dim: list[list[str]] = [[] for _ in range(ndim)]
        for axis, placement in zip(self.mesh.axis_names, placements):
            if isinstance(placement, Shard):
                per_dim[placement.dim].append(axis)
        return tuple(
            None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in per_dim
        )

    @classmethod
    def from_partition_spec(
        cls, mesh: Mesh, partition_spec: Sequence[str | Sequence[str] | None]
    ) -> ShardingSpec:
        """Inverse of ``to_partition_spec``; mesh axes that split no dim are ``Replicate``."""
        if isinstance(partition_spec, str) or not isinstance(partition_spec, Sequence):
            raise TypeError(
                f"partition_spec must be a sequence with one entry per tensor dim, got {partition_spec!r}"
            )
        placements: list[Placement | None] = [None] * mesh.ndim
        for dim, entry in enumerate(partition_spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for axis in axes:
                index = mesh.axis_index(axis)
                if placements[index] is not None:
                    raise ValueError(
                        f"partition_spec {tuple(partition_spec)!r} uses mesh axis {axis!r} twice"
                    )
                placements[index] = Shard(dim)
        return cls(mesh, tuple(Replicate() if p is None else p for p in placements))

    def to_xla(self, ndim: int) -> tuple[Any, tuple[str | tuple[str, ...] | None, ...]]:
        """``(torch_xla Mesh, partition spec)`` for a tensor of rank ``ndim``, as
        ``xs.mark_sharding`` takes them."""
        return self.mesh.to_xla(), self.to_partition_spec(ndim)

    @classmethod
    def from_xla(cls, xla_mesh: Any, partition_spec: Sequence[Any]) -> ShardingSpec:
        """Inverse of ``to_xla``; integer mesh-axis indices are accepted like torch_xla does."""
        mesh = Mesh.from_xla(xla_mesh)
        by_name = [
            None if entry is None
            else mesh.axis_names[entry] if isinstance(entry, int)
            else entry if isinstance(entry, str)
            else tuple(mesh.axis_names[a] if isinstance(a, int) else a for a in entry)
            for entry in partition_spec
        ]
        return cls.from_partition_spec(mesh, by_name)

    def to_dtensor_placements(self) -> tuple[Any, ...]:
        return tuple(p.to_dtensor() for p in self.placements)


# --------------------------------------------------------------------------- compact text
#
# Placements print as one token per mesh axis: ``S(d)`` (Shard(d)), ``R`` (Replicate()),
# ``P`` (Partial()) or ``P(max)`` (Partial('max')); ``S(0)R`` is (Shard(0), Replicate()).
# A list of per-tensor placements separates tensors by ", " and writes a non-tensor as "-".
# Spec constructors accept this text, so a spec's repr is short, valid Python.


def placements_text(placements: Sequence[Placement]) -> str:
    return "".join(_token(p) for p in placements)


def _token(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    assert isinstance(placement, Partial)
    return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"


def groups_text(groups: Sequence[Sequence[Placement] | None]) -> str:
    return ", ".join("-" if g is None else placements_text(g) for g in groups)


def parse_placements(text: str, where: str) -> tuple[Placement, ...]:
    """``"S(0)R"`` -> ``(Shard(0), Replicate())``; ``ValueError`` naming ``where`` otherwise."""
    placements: list[Placement] = []
    rest = text.strip()
    while rest:
        if rest[0] == "R":
            placements.append(Replicate())
            rest = rest[1:]
        elif rest[0] in "SP":
            kind, argument = rest[0], None
            if rest[1:2] == "(":
                close = rest.find(")")
                if close < 0:
                    raise ValueError(f"{where}: unclosed '(' in placements {text!r}")
                argument, rest = rest[2:close], rest[close + 1 :]
            else:
                rest = rest[1:]
            if kind == "S":
                if argument is None or not argument.removeprefix("-").isdigit():
                    raise ValueError(f"{where}: Shard needs a dim, as in 'S(0)', in placements {text!r}")
                placements.append(Shard(int(argument)))
            else:
                placements.append(Partial() if argument is None else Partial(argument))
        else:
            raise ValueError(
                f"{where}: cannot read placements {text!r} at {rest!r}; expected one of S(d), R, P, P(op) per mesh axis"
            )
    if not placements:
        raise ValueError(f"{where}: empty placements {text!r}")
    return tuple(placements)


def parse_groups(text: str, where: str) -> tuple[tuple[Placement, ...] | None, ...]:
    """``"S(0)R, RR, -"`` -> one placements tuple per tensor (``None`` for ``-``)."""
    if not text.strip():
        return ()
    return tuple(
        None if part.strip() == "-" else parse_placements(part, f"{where}[{i}]")
        for i, part in enumerate(text.split(","))
    )


# --------------------------------------------------------------------------- local_map spec

Placements = tuple  # one Placement per mesh axis


def resolve_dims(placements: Sequence[Placement], ndim: int, where: str, mesh: Mesh | None = None) -> tuple[Placement, ...]:
    """``placements`` for a tensor of rank ``ndim``: each ``Shard(d)`` with ``d < 0`` made
    ``Shard(d + ndim)``; ``ValueError`` naming ``where`` (and the mesh axis) for a dim out of
    range. The tuple itself when nothing changes."""
    placements = tuple(placements)
    resolved = []
    for i, placement in enumerate(placements):
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                axis = f" on mesh axis {mesh.axis_names[i]!r}" if mesh is not None and i < mesh.ndim else ""
                raise ValueError(
                    f"{where}: placement {placement!r}{axis} shards dim {placement.dim}, but the tensor has rank {ndim}"
                )
            if placement.dim < 0:
                placement = Shard(placement.dim + ndim)
        resolved.append(placement)
    resolved_tuple = tuple(resolved)
    return placements if resolved_tuple == placements else resolved_tuple


def placements_tuple(value: Any, mesh: Mesh, where: str) -> tuple[Placement, ...]:
    if isinstance(value, (Placement, str)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{where} must be a sequence with one placement per mesh axis {mesh.axis_names}, "
            f"got {value!r}"
        )
    placements = tuple(_as_placement(p, f"{where}[{i}]") for i, p in enumerate(value))
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{where} has {len(placements)} placements but the mesh has {mesh.ndim} axes "
            f"{mesh.axis_names}: give one per mesh axis"
        )
    return placements


def transpose_placement(placement: Placement, where: str) -> Placement:
    """The placement of a cotangent: the adjoint of how the primal is laid out.

    Sharded stays sharded; a replicated value's cotangent is a pending sum (each device's
    contribution must be added); a pending sum's cotangent is replicated (the adjoint of a
    sum is a broadcast). Only ``Partial("sum")`` has a linear adjoint.
    """
    if isinstance(placement, Replicate):
        return Partial("sum")
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise ValueError(
                f"{where}: Partial({placement.reduce_op!r}) is not linear, so it has no gradient "
                "placement; give in_grad_placements explicitly or use Partial('sum')"
            )
        return Replicate()
    return placement


def _groups(value: Any, name: str, *, allow_none: bool, mesh: Mesh | None = None) -> tuple:
    """Per-tensor placements from text (``"S(0)R, -"``) or a sequence, each a tuple of
    placements (checked against ``mesh`` when given) or ``None`` where allowed."""
    if isinstance(value, str):
        value = parse_groups(value, name)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of per-tensor placements, got {value!r}")
    groups = []
    for i, p in enumerate(value):
        if p is None and allow_none:
            groups.append(None)
        elif mesh is not None:
            groups.append(placements_tuple(p, mesh, f"{name}[{i}]"))
        elif isinstance(p, (Placement, str)) or not isinstance(p, Iterable):
            raise TypeError(f"{name}[{i}] must be a sequence of placements, got {p!r}")
        else:
            groups.append(tuple(_as_placement(q, f"{name}[{i}][{k}]") for k, q in enumerate(p)))
    return tuple(groups)


@dataclasses.dataclass(frozen=True, repr=False)
class RegionPlacements(_FxLiteral):
    """One placement option of a ``local_map`` region: its ``in_placements``,
    ``out_placements`` and ``in_grad_placements`` (as ``LocalMapSpec`` takes them), and an
    optional ``cost_hint`` (seconds per call on one device) a sharding solver may use
    instead of costing the body."""

    in_placements: tuple[tuple[Placement, ...] | None, ...]
    out_placements: tuple[tuple[Placement, ...], ...]
    in_grad_placements: tuple[tuple[Placement, ...] | None, ...] | None = None
    cost_hint: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_placements", _groups(self.in_placements, "RegionPlacements(in_placements)", allow_none=True))
        object.__setattr__(self, "out_placements", _groups(self.out_placements, "RegionPlacements(out_placements)", allow_none=False))
        if self.in_grad_placements is not None:
            grads = _groups(self.in_grad_placements, "RegionPlacements(in_grad_placements)", allow_none=True)
            object.__setattr__(self, "in_grad_placements", grads)
        if self.cost_hint is not None:
            if isinstance(self.cost_hint, bool) or not isinstance(self.cost_hint, (int, float)) or not self.cost_hint >= 0:
                raise ValueError(f"RegionPlacements(cost_hint=...) must be None or a number of seconds >= 0, got {self.cost_hint!r}")
            object.__setattr__(self, "cost_hint", float(self.cost_hint))

    def __repr__(self) -> str:
        grads = "" if self.in_grad_placements is None else f", {groups_text(self.in_grad_placements)!r}"
        hint = "" if self.cost_hint is None else f", cost_hint={self.cost_hint!r}"
        return f"hops.RegionPlacements({groups_text(self.in_placements)!r}, {groups_text(self.out_placements)!r}{grads}{hint})"


@dataclasses.dataclass(frozen=True, repr=False)
class LocalMapSpec(_FxLiteral):
    """Everything a ``local_map_hop`` node needs besides its body and tensors.

    ``in_placements[i]`` / ``out_placements[j]`` / ``in_grad_placements[i]`` are tuples with
    one placement per mesh axis, for the i-th flat input / j-th flat tensor output; ``None``
    marks a non-tensor input (an int or SymInt the body reads as is).

    Gradients follow one of two conventions for the cotangent of a ``Replicate`` output:

    - without ``in_grad_placements`` it enters the backward as a pending sum (the first
      device along the axis holds it): then every replicated input's gradient is a pending
      sum (``Partial``), which is right whatever the outputs are;
    - with ``in_grad_placements`` (torch's ``local_map`` convention, for code written for it)
      every device receives the whole cotangent, and the given layouts are taken as torch
      takes them; an entry left ``None`` is derived in that convention (``Replicate`` on an
      axis where every output is replicated, ``Partial`` where none is).

    ``alternatives``: the placement options a solver may choose from (the spec's own
    placements are one of them, the active one); the node then carries one body per option.
    ``residuals``: in the forward region of a differentiated region with alternatives, its
    last ``residuals`` outputs are per-device values its backward region reads, which only
    the same alternative can read: a solver chooses both regions' alternatives together.
    """

    mesh: Mesh
    in_placements: tuple[tuple[Placement, ...] | None, ...]
    out_placements: tuple[tuple[Placement, ...], ...]
    in_grad_placements: tuple[tuple[Placement, ...] | None, ...] | None = None
    alternatives: tuple[RegionPlacements, ...] = ()
    residuals: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"LocalMapSpec(mesh=...) must be a hops.Mesh, got {type(self.mesh).__name__}"
            )
        # None marks a non-tensor input (an int or SymInt the body reads), passed as is.
        object.__setattr__(self, "in_placements", _groups(self.in_placements, "in_placements", allow_none=True, mesh=self.mesh))
        object.__setattr__(self, "out_placements", _groups(self.out_placements, "out_placements", allow_none=False, mesh=self.mesh))
        if self.in_grad_placements is not None:
            grads = _groups(self.in_grad_placements, "in_grad_placements", allow_none=True, mesh=self.mesh)
            object.__setattr__(self, "in_grad_placements", grads)
        if self.in_grad_placements is not None and len(self.in_grad_placements) != len(self.in_placements):
            raise ValueError(
                f"in_grad_placements has {len(self.in_grad_placements)} entries but there are "
                f"{len(self.in_placements)} tensor inputs"
            )
        object.__setattr__(self, "alternatives", self._checked_alternatives())
        if isinstance(self.residuals, bool) or not isinstance(self.residuals, int) or not 0 <= self.residuals <= len(self.out_placements):
            raise ValueError(
                f"LocalMapSpec(residuals=...) must be an int in 0..{len(self.out_placements)} (trailing outputs), got {self.residuals!r}"
            )
        if self.residuals and not self.alternatives:
            raise ValueError("LocalMapSpec(residuals=...) marks the residuals of a region with alternatives; this one has none")

    def _checked_alternatives(self) -> tuple[RegionPlacements, ...]:
        if not isinstance(self.alternatives, (tuple, list)):
            raise TypeError(f"LocalMapSpec(alternatives=...) must be a tuple of hops.RegionPlacements, got {self.alternatives!r}")
        checked = []
        for k, option in enumerate(self.alternatives):
            where = f"LocalMapSpec(alternatives[{k}])"
            if not isinstance(option, RegionPlacements):
                raise TypeError(f"{where} must be a hops.RegionPlacements, got {type(option).__name__} {option!r}")
            # Normalized against the mesh by the same rules as the spec's own fields.
            as_spec = LocalMapSpec(self.mesh, option.in_placements, option.out_placements, option.in_grad_placements)
            for name in ("in_placements", "out_placements"):
                if len(getattr(as_spec, name)) != len(getattr(self, name)):
                    raise ValueError(
                        f"{where}: {len(getattr(as_spec, name))} {name} for a region with {len(getattr(self, name))}"
                    )
            if [p is None for p in as_spec.in_placements] != [p is None for p in self.in_placements]:
                raise ValueError(f"{where}: non-tensor inputs (None in_placements) differ from the region's")
            checked.append(RegionPlacements(as_spec.in_placements, as_spec.out_placements, as_spec.in_grad_placements, option.cost_hint))
        plain = [dataclasses.replace(o, cost_hint=None) for o in checked]
        for k, option in enumerate(plain):
            if option in plain[:k]:
                raise ValueError(f"LocalMapSpec: alternatives {plain.index(option)} and {k} have the same placements {option!r}")
        if checked and self.active_placements() not in [dataclasses.replace(o, cost_hint=None) for o in checked]:
            raise ValueError(
                "LocalMapSpec: its own placements must be one of its alternatives (the active one); "
                f"got {self.active_placements()!r} and alternatives {tuple(checked)!r}"
            )
        return tuple(checked)

    def __repr__(self) -> str:
        grads = "" if self.in_grad_placements is None else f", {groups_text(self.in_grad_placements)!r}"
        alternatives = "" if not self.alternatives else f", alternatives={self.alternatives!r}"
        residuals = "" if not self.residuals else f", residuals={self.residuals}"
        return (
            f"hops.LocalMapSpec({self.mesh!r}, {groups_text(self.in_placements)!r}, "
            f"{groups_text(self.out_placements)!r}{grads}{alternatives}{residuals})"
        )

    def for_ranks(self, in_ranks: Sequence[int | None], out_ranks: Sequence[int]) -> LocalMapSpec:
        """This spec for inputs and outputs of these ranks: negative ``Shard`` dims resolved
        (``resolve_dims``), alternatives included; the spec itself when nothing changes or
        the ranks do not line up with its entries."""
        if len(in_ranks) != len(self.in_placements) or len(out_ranks) != len(self.out_placements):
            return self

        def groups(values: Any, ranks: Sequence[Any], name: str) -> Any:
            if values is None:
                return None
            return tuple(
                g if g is None or r is None else resolve_dims(g, r, f"local_map: {name}[{i}]", self.mesh)
                for i, (g, r) in enumerate(zip(values, ranks))
            )

        alternatives = tuple(
            RegionPlacements(
                groups(o.in_placements, in_ranks, "in_placements"),
                groups(o.out_placements, out_ranks, "out_placements"),
                groups(o.in_grad_placements, in_ranks, "in_grad_placements"),
                o.cost_hint,
            )
            for o in self.alternatives
        )
        resolved = LocalMapSpec(
            self.mesh,
            groups(self.in_placements, in_ranks, "in_placements"),
            groups(self.out_placements, out_ranks, "out_placements"),
            groups(self.in_grad_placements, in_ranks, "in_grad_placements"),
            alternatives,
            self.residuals,
        )
        return self if resolved == self else resolved

    def active_placements(self) -> RegionPlacements:
        """The spec's own placements (what eager, the lowerings and the solver's default use)."""
        return RegionPlacements(self.in_placements, self.out_placements, self.in_grad_placements)

    @property
    def active(self) -> int | None:
        """The index of the active placements among ``alternatives`` (None without them)."""
        own = self.active_placements()
        for k, option in enumerate(self.alternatives):
            if dataclasses.replace(option, cost_hint=None) == own:
                return k
        return None

    def choose(self, index: int) -> LocalMapSpec:
        """This spec with ``alternatives[index]`` as its placements (the alternatives kept)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.alternatives):
            raise IndexError(
                f"LocalMapSpec.choose({index!r}): the region has {len(self.alternatives)} alternatives "
                f"(indices 0..{len(self.alternatives) - 1})"
            )
        option = self.alternatives[index]
        return LocalMapSpec(
            self.mesh, option.in_placements, option.out_placements, option.in_grad_placements, self.alternatives, self.residuals
        )

    def options(self) -> tuple[LocalMapSpec, ...]:
        """One spec per alternative, each without alternatives (just this spec without them)."""
        if not self.alternatives:
            return (self,)
        return tuple(LocalMapSpec(self.mesh, o.in_placements, o.out_placements, o.in_grad_placements) for o in self.alternatives)

    @classmethod
    def with_options(
        cls, options: Sequence[LocalMapSpec], active: int = 0, cost_hints: Sequence[Any] | None = None, residuals: int = 0
    ) -> LocalMapSpec:
        """The spec whose alternatives are ``options`` (specs on one mesh), ``options[active]``
        active; one option gives that spec without alternatives (and ``residuals`` unmarked)."""
        if len(options) == 1:
            return options[0]
        hints = cost_hints or [None] * len(options)
        alternatives = tuple(
            RegionPlacements(o.in_placements, o.out_placements, o.in_grad_placements, hint) for o, hint in zip(options, hints)
        )
        chosen = options[active]
        return cls(chosen.mesh, chosen.in_placements, chosen.out_placements, chosen.in_grad_placements, alternatives, residuals)

    @property
    def replicated_cotangents(self) -> bool:
        """Whether a replicated output's cotangent reaches every device whole (torch's
        convention, chosen by giving ``in_grad_placements``; see the class docstring)."""
        return self.in_grad_placements is not None

    def cotangent_placement(self, index: int) -> tuple[Placement, ...]:
        """The layout of output ``index``'s cotangent as the backward region takes it."""
        return tuple(
            Replicate()
            if isinstance(p, Replicate) and self.replicated_cotangents
            else transpose_placement(p, f"out_placements[{index}]")
            for p in self.out_placements[index]
        )

    def grad_placements(self) -> tuple[tuple[Placement, ...], ...]:
        """The layout of each input's gradient (see ``grad_placement``)."""
        return tuple(self.grad_placement(i) for i in range(len(self.in_placements)))

    def grad_placement(self, index: int) -> tuple[Placement, ...] | None:
        """The layout of input ``index``'s gradient: given, or derived in the spec's convention."""
        if self.in_grad_placements is not None and self.in_grad_placements[index] is not None:
            return self.in_grad_placements[index]
        group = self.in_placements[index]
        if group is None:
            return None
        where = f"in_placements[{index}]"
        if not self.replicated_cotangents:
            return tuple(transpose_placement(p, where) for p in group)
        grads = []
        for axis, placement in enumerate(group):
            if not isinstance(placement, Replicate):
                grads.append(transpose_placement(placement, where))
                continue
            replicated = [isinstance(out[axis], Replicate) for out in self.out_placements]
            if all(replicated):
                grads.append(Replicate())  # every device computed the same: each holds the gradient
            elif not any(replicated):
                grads.append(Partial())  # each device contributed: the gradient is their sum
            else:
                raise ValueError(
                    f"in_grad_placements[{index}]: the input is replicated on mesh axis {self.mesh.axis_names[axis]!r}, "
                    "where some outputs are replicated and some are not; no layout of its gradient is right with "
                    "whole cotangents on every device: give in_grad_placements=None (pending-sum cotangents)"
                )
        return tuple(grads)

    def with_lifted(self, lifted: Sequence[Any]) -> LocalMapSpec:
        """This spec for inputs extended by values the body closed over (lifted by tracing):
        a tensor is seen whole by every device (``Replicate``); its gradient is derived."""
        import torch

        extra = tuple(
            tuple(Replicate() for _ in self.mesh.shape) if isinstance(v, torch.Tensor) else None
            for v in lifted
        )
        def lifted_option(option: LocalMapSpec) -> LocalMapSpec:
            grads = None
            if option.in_grad_placements is not None:
                grads = option.in_grad_placements + tuple(None for _ in extra)  # derived in the spec's convention
            return LocalMapSpec(self.mesh, option.in_placements + extra, option.out_placements, grads)

        hints = [o.cost_hint for o in self.alternatives] or None
        return LocalMapSpec.with_options([lifted_option(o) for o in self.options()], self.active or 0, hints, self.residuals)


# --------------------------------------------------------------------------- text form
#
# Every spec value's repr is a call of a registered constructor with literal arguments
# (numbers, strings, tuples, ``torch.<dtype>``, other spec values). ``spec_from_text`` reads
# it back without ``eval``: what saved programs (``torch.export``) and the XLA ops' string
# arguments carry.

_TEXT_CONSTRUCTORS: dict[str, Any] = {}


def register_spec_type(name: str, constructor: Any) -> None:
    """Let ``spec_from_text`` read calls of ``hops.<name>(...)`` (``name`` may be dotted,
    e.g. ``"Mesh.of"``). Every HOP module registers the spec values its nodes take."""
    _TEXT_CONSTRUCTORS[name] = constructor


for _name, _constructor in (
    ("Mesh", Mesh),
    ("Mesh.of", Mesh.of),
    ("Shard", Shard),
    ("Replicate", Replicate),
    ("Partial", Partial),
    ("ShardingSpec", ShardingSpec),
    ("LocalMapSpec", LocalMapSpec),
    ("RegionPlacements", RegionPlacements),
):
    register_spec_type(_name, _constructor)


def spec_from_text(text: str) -> Any:
    """Parse the ``repr`` of a spec value back into the value, without ``eval``.

    Accepts only calls of registered constructors (``hops.X(...)``, ``X(...)``,
    ``hops.X.of(...)``) with literal arguments and ``torch`` dtypes; anything else is a
    ``ValueError``.
    """
    if not isinstance(text, str):
        raise TypeError(f"spec_from_text expects str, got {type(text).__name__}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a spec: {text!r} ({e.msg})") from None
    return _build(tree.body, text)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _build(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_build(e, text) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, ast.Attribute) and _dotted(node) is not None and _dotted(node).startswith("torch."):
        import torch

        value = getattr(torch, _dotted(node).removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        if name is not None and name.startswith("hops."):
            name = name.removeprefix("hops.")
        if name in _TEXT_CONSTRUCTORS:
            args = [_build(a, text) for a in node.args]
            kwargs = {k.arg: _build(k.value, text) for k in node.keywords if k.arg is not None}
            return _TEXT_CONSTRUCTORS[name](*args, **kwargs)
    raise ValueError(f"not a spec: {text!r} (unexpected {ast.dump(node)[:60]})")
