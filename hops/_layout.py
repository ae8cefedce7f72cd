"""How a global tensor maps to per-device local tensors under DTensor-style placements.

Mesh axes are applied in order (axis 0 is the most significant), as DTensor does: a dim
sharded by axes ``a`` then ``b`` is split into ``size(a) * size(b)`` chunks and device
``(i, j)`` holds chunk ``i * size(b) + j``. ``Partial`` splits a value into per-device
contributions that reduce back to it: for ``sum`` the first device along the axis holds the
value and the others zeros; for ``avg``/``max``/``min`` every device holds the value.

These are the reference semantics the eager SPMD simulation runs and every lowering is
checked against.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch

from hops import _compat
from hops.specs import Mesh, Partial, Placement, Replicate, Shard, resolve_dims


def device_coordinates(mesh: Mesh) -> list[tuple[int, ...]]:
    """Every device's coordinate in the mesh, row-major (the order of ``mesh.device_ids``)."""
    return list(itertools.product(*(range(n) for n in mesh.shape)))


def check_divisible(shape: Sequence[Any], placements: Sequence[Placement], mesh: Mesh, what: str) -> None:
    """``ValueError`` naming ``what`` and the dim if a sharded dim does not split evenly."""
    placements = resolve_dims(placements, len(shape), what, mesh)
    for dim in range(len(shape)):
        ways = shard_ways(placements, mesh, dim)
        if ways > 1 and shape[dim] % ways != 0:
            axes = [a for a, p in zip(mesh.axis_names, placements) if isinstance(p, Shard) and p.dim == dim]
            raise ValueError(
                f"{what}: dim {dim} has size {shape[dim]}, which does not split evenly over mesh "
                f"axes {axes} ({ways} ways); local_map needs even shards"
            )


def shard_ways(placements: Sequence[Placement], mesh: Mesh, dim: int) -> int:
    """How many pieces ``dim`` is split into (``placements`` with dims resolved)."""
    ways = 1
    for size, placement in zip(mesh.shape, placements):
        if isinstance(placement, Shard) and placement.dim == dim:
            ways *= size
    return ways


def check_rank(ndim: int, placements: Sequence[Placement], mesh: Mesh, what: str) -> None:
    resolve_dims(placements, ndim, what, mesh)


def local_shape(shape: Sequence[Any], placements: Sequence[Placement], mesh: Mesh, what: str) -> list[Any]:
    """The shape each device holds of a global tensor of ``shape``."""
    placements = resolve_dims(placements, len(shape), what, mesh)
    check_divisible(shape, placements, mesh, what)
    return [size // shard_ways(placements, mesh, dim) for dim, size in enumerate(shape)]


def global_shape(shape: Sequence[Any], placements: Sequence[Placement], mesh: Mesh, what: str) -> list[Any]:
    """The global shape of a tensor whose per-device pieces have ``shape``."""
    placements = resolve_dims(placements, len(shape), what, mesh)
    return [size * shard_ways(placements, mesh, dim) for dim, size in enumerate(shape)]


def shard_for_device(
    tensor: torch.Tensor, placements: Sequence[Placement], mesh: Mesh, coordinate: Sequence[int]
) -> torch.Tensor:
    """The local tensor device ``coordinate`` holds of the global ``tensor`` (a new tensor).

    Copies, not views: torch_xla runs views only through functionalization, and this also
    runs below it (``narrow_copy`` there; elsewhere a narrow view copied, which forward-mode
    AD differentiates on every supported torch version, ``narrow_copy`` not on 2.9)."""
    local = tensor
    placements = resolve_dims(placements, tensor.dim(), "shard_for_device", mesh)
    for size, placement, index in zip(mesh.shape, placements, coordinate):
        if isinstance(placement, Shard):
            length = local.shape[placement.dim] // size
            if local.device.type == "xla":
                local = torch.narrow_copy(local, placement.dim, index * length, length)
            else:
                local = local.narrow(placement.dim, index * length, length).clone()
        elif isinstance(placement, Partial) and placement.reduce_op == "sum" and index != 0:
            local = torch.zeros_like(local)
    return local if local is not tensor else local.clone()


_REDUCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda stacked: stacked.sum(0),
    "avg": lambda stacked: stacked.mean(0),
    "max": lambda stacked: stacked.amax(0),
    "min": lambda stacked: stacked.amin(0),
}


def assemble(
    pieces: dict[tuple[int, ...], torch.Tensor],
    placements: Sequence[Placement],
    mesh: Mesh,
    what: str,
) -> torch.Tensor:
    """The global tensor whose device pieces are ``pieces`` (keyed by device coordinate).

    Combines the last mesh axis first, so chunks of a dim sharded by several axes land in
    axis-0-major order. ``Replicate`` pieces must agree (else ``ValueError`` naming ``what``).
    """
    grid = dict(pieces)
    placements = resolve_dims(placements, next(iter(grid.values())).dim(), what, mesh)
    for axis in reversed(range(mesh.ndim)):
        placement = placements[axis]
        combined: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix in {coordinate[:axis] for coordinate in grid}:
            row = [grid[prefix + (i,)] for i in range(mesh.shape[axis])]
            combined[prefix] = _combine(row, placement, mesh.axis_names[axis], what)
        grid = combined
    return grid[()]


def _difference(first: torch.Tensor, other: torch.Tensor) -> float | None:
    """The largest difference between two devices' values of a replicated result, or None
    if they agree. Compared on the values under torch.func and functionalization wrappers,
    unseen by tracers; not compared where there are no values (fake or meta tensors while
    tracing, or one value batched by vmap and the other not)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from hops._body_hop.body import unwrap_functional

    values = []
    for t in (first, other):
        t = unwrap_functional(_compat.peel_functorch(t))
        if isinstance(t, FakeTensor) or t.device.type == "meta" or torch._is_functional_tensor(t):
            return None
        values.append(t.detach())
    a, b = values
    if a.shape != b.shape:
        return None
    with disable_proxy_modes_tracing():
        if a.is_floating_point() or a.is_complex():
            same = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            same = torch.equal(a, b)
        return None if same else (a.double() - b.double()).abs().max().item()


def _combine(row: list[torch.Tensor], placement: Placement, axis: str, what: str) -> torch.Tensor:
    if isinstance(placement, Shard):
        return torch.cat(row, dim=placement.dim)
    if isinstance(placement, Partial):
        return _REDUCE[placement.reduce_op](torch.stack(row))
    assert isinstance(placement, Replicate)
    first = row[0]
    for index, other in enumerate(row[1:], start=1):
        difference = _difference(first, other)
        if difference is not None:
            raise ValueError(
                f"{what} is declared Replicate on mesh axis {axis!r}, but device {index} along that "
                f"axis produced a different value than device 0 (max difference {difference:.3g}); "
                "declare it Partial or Shard, or make the body's result identical on every device"
            )
    return first


# --------------------------------------------------------------------------- as an op
#
# ``replicated(pieces, axis, what)``: the value of pieces declared Replicate along one mesh
# axis, checked to agree exactly as ``assemble`` checks them. Graphs that spell a region out
# per device (the inline lowering) call it, so their numbers and errors are the eager
# simulation's; an op (not an ``_assert_async``) because agreement is exact for integers and
# within tolerance for floats, which needs the dtype, and its result is used, so no pass
# drops the check as dead code.

_LIB = torch.library.Library("hops_layout", "DEF")
_LIB.define("replicated(Tensor[] pieces, str axis, str what, bool whole_cotangents) -> Tensor")


def _replicated(pieces: list[torch.Tensor], axis: str, what: str, whole_cotangents: bool) -> torch.Tensor:
    return _combine(list(pieces), Replicate(), axis, what).clone()


def _replicated_fake(pieces: list[torch.Tensor], axis: str, what: str, whole_cotangents: bool) -> torch.Tensor:
    return torch.empty_like(pieces[0])


def _replicated_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.count, ctx.whole = len(inputs[0]), inputs[3]


def _replicated_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # As ``assemble``: the first piece is the value, so it alone receives the cotangent; in
    # the whole-cotangent convention every replica receives it.
    others = [grad if ctx.whole else torch.zeros_like(grad) for _ in range(ctx.count - 1)]
    return [grad, *others], None, None, None


_LIB.impl("replicated", _replicated, "CompositeExplicitAutograd")
torch.library.register_fake("hops_layout::replicated", _replicated_fake, lib=_LIB)
torch.library.register_autograd(
    "hops_layout::replicated", _replicated_backward, setup_context=_replicated_setup, lib=_LIB
)

replicated = torch.ops.hops_layout.replicated.default
