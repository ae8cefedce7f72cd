"""Functional ops that the XLA lowering targets (namespace ``hops_xla``).

torch_xla's sharding APIs (``xs.mark_sharding`` and friends) mutate their argument and fail
under tracing; these ops are functional, have fake rules and autograd rules, and run on any
device: off XLA they are the identity (a copy), on XLA their kernel attaches torch_xla's
sharding to a fresh value, which emits a ``Sharding`` custom call in the HLO.

Specs travel as their canonical text (``repr`` of a ``hops.ShardingSpec``) because op schemas
take only primitive types in torch 2.9; the kernel parses each distinct text once and caches
torch_xla's ``OpSharding`` per (spec, rank), so a call costs a dict lookup.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hops.lowering import global_shape, local_shape
from hops.specs import Mesh, ShardingSpec, spec_from_text

_lib = torch.library.Library("hops_xla", "DEF")

_lib.define("sharding_constraint(Tensor x, str spec) -> Tensor")


def _sharding_constraint_copy(x: torch.Tensor, spec: str):
    return x.clone()


def _sharding_constraint_fake(x: torch.Tensor, spec: str):
    return torch.empty_like(x)


_OP_SHARDINGS: dict[tuple[str, int], Any] = {}
_XLA_MESHES: dict[Any, Any] = {}


def xla_mesh(mesh: Mesh, what: str) -> Any:
    """torch_xla's ``Mesh`` for ``mesh``, built once: where a lowered graph first meets the
    runtime it runs on (it may have been lowered on another machine, before torch_xla was
    imported). ``ValueError`` naming ``what`` when ``mesh`` is not the runtime's devices."""
    built = _XLA_MESHES.get(mesh)
    if built is None:
        problem = mesh.xla_mismatch()
        if problem is not None:
            raise ValueError(f"{what}: {problem}")
        built = _XLA_MESHES[mesh] = mesh.to_xla()
    return built


def xla_op_sharding(spec_text: str, ndim: int, what: str = "hops_xla") -> Any:
    """torch_xla's ``OpSharding`` for a spec text and a tensor rank, built once; ``what``
    names the caller in errors."""
    key = (spec_text, ndim)
    op_sharding = _OP_SHARDINGS.get(key)
    if op_sharding is None:
        spec = spec_from_text(spec_text)
        if not isinstance(spec, ShardingSpec):
            raise TypeError(f"expected the text of a hops.ShardingSpec, got {spec_text!r}")
        partition_spec = spec.to_partition_spec(ndim)
        mesh = xla_mesh(spec.mesh, f"{what} with {spec_text}")
        op_sharding = _OP_SHARDINGS[key] = mesh.get_op_sharding(partition_spec)
    return op_sharding


def sharding_constraint_on_xla(x: torch.Tensor, spec: str) -> torch.Tensor:
    """``x`` as a new XLA value that carries the layout ``spec`` (a ``Sharding`` custom call)."""
    import torch_xla

    # A copy of device data would stay device data and be resharded through the host;
    # an arithmetic identity makes an IR value the Sharding custom call can attach to.
    out = x * 1
    torch_xla._XLAC._xla_mark_sharding(out, xla_op_sharding(spec, x.dim(), "hops_xla.sharding_constraint"))
    return out


def _sharding_constraint_xla(x: torch.Tensor, spec: str):
    # The XLA sharding states the value's placements (a spec's gradient placements are the
    # backward's business).
    return sharding_constraint_on_xla(x, spec)


@functools.lru_cache(maxsize=None)
def _gradient_spec_text(spec_text: str) -> str:
    """The text of the transposed spec: the gradient's layout first."""
    return repr(spec_from_text(spec_text).grad)


def _sharding_constraint_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, ctx.spec = inputs


def _sharding_constraint_backward(ctx: Any, grad: torch.Tensor):
    return sharding_constraint(grad, _gradient_spec_text(ctx.spec)), None


_lib.impl("sharding_constraint", _sharding_constraint_copy, "CompositeExplicitAutograd")
_lib.impl("sharding_constraint", _sharding_constraint_xla, "XLA")
torch.library.register_fake("hops_xla::sharding_constraint", _sharding_constraint_fake, lib=_lib)
torch.library.register_autograd(
    "hops_xla::sharding_constraint",
    _sharding_constraint_backward,
    setup_context=_sharding_constraint_setup,
    lib=_lib,
)

sharding_constraint = torch.ops.hops_xla.sharding_constraint.default


# --------------------------------------------------------------------------- manual regions
#
# A local_map region lowers to: enter_manual per input (Sharding + SPMDFullToShardShape),
# the body on local tensors, exit_manual per output (pending reductions all-reduced, then
# SPMDShardToFullShape). Specs are ShardingSpec texts whose placements may be Partial:
# entering, a Partial("sum") value is split so that only the first device along the axis
# holds it (the others hold zeros); leaving, a Partial value is all-reduced over the axis.

_lib.define("enter_manual(Tensor x, str spec) -> Tensor")
_lib.define("exit_manual(Tensor x, str spec) -> Tensor")

_REDUCE_TYPES = {"sum": "sum", "max": "max", "min": "min", "avg": "sum"}


def _region_spec(spec_text: str) -> ShardingSpec:
    spec = spec_from_text(spec_text)
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"expected the text of a hops.ShardingSpec, got {spec_text!r}")
    return spec


def _without_partial(spec: ShardingSpec) -> str:
    from hops.specs import Partial, Replicate

    return repr(ShardingSpec(spec.mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)))


def _manual_off_xla(x: torch.Tensor, spec: str):
    raise RuntimeError(
        f"hops_xla manual-sharding regions run only on XLA tensors under SPMD, got a {x.device} tensor; "
        "for other backends run the graph before lower_to_xla (the eager SPMD simulation) or, for "
        "per-device graphs, passes.inline_hops(gm, per_device=True)"
    )


def _enter_manual_fake(x: torch.Tensor, spec: str):
    region = _region_spec(spec)
    return x.new_empty(local_shape(x.shape, region.placements, region.mesh, "enter_manual"))


def _exit_manual_fake(x: torch.Tensor, spec: str):
    region = _region_spec(spec)
    return x.new_empty(global_shape(x.shape, region.placements, region.mesh, "exit_manual"))


def _axis_groups(spec: ShardingSpec, axis: int) -> list[list[int]]:
    """Device-id groups along mesh ``axis`` (each group varies only that axis)."""
    import numpy as np

    ids = np.array(spec.mesh.device_ids).reshape(spec.mesh.shape)
    return np.moveaxis(ids, axis, -1).reshape(-1, spec.mesh.shape[axis]).tolist()


def _axis_coordinate(spec: ShardingSpec, axis: int, device: torch.device) -> torch.Tensor:
    """Inside a manual region: this device's coordinate along mesh ``axis`` (shape (1,))."""
    import torch_xla

    from hops.specs import Replicate, Shard

    placements = tuple(Shard(0) if i == axis else Replicate() for i in range(spec.mesh.ndim))
    coordinates = torch.arange(spec.mesh.shape[axis], device=device) * 1
    index_spec = repr(ShardingSpec(spec.mesh, placements))
    torch_xla._XLAC._xla_mark_sharding(coordinates, xla_op_sharding(index_spec, 1))
    return torch_xla._XLAC._spmd_full_to_shard_shape(coordinates)


def _enter_manual_xla(x: torch.Tensor, spec: str):
    import torch_xla

    from hops.specs import Partial

    region = _region_spec(spec)
    xla_mesh(region.mesh, f"hops_xla.enter_manual with {spec}")
    out = x * 1  # an IR value (not device data) the custom calls can attach to
    torch_xla._XLAC._xla_mark_sharding(out, xla_op_sharding(_without_partial(region), x.dim()))
    local = torch_xla._XLAC._spmd_full_to_shard_shape(out)
    for axis, placement in enumerate(region.placements):
        if isinstance(placement, Partial) and placement.reduce_op == "sum":
            first = (_axis_coordinate(region, axis, x.device) == 0).to(local.dtype)
            local = local * first.reshape((1,) * local.dim())
    return local


def _exit_manual_xla(x: torch.Tensor, spec: str):
    import torch_xla

    from hops.specs import Partial

    region = _region_spec(spec)
    xla_mesh(region.mesh, f"hops_xla.exit_manual with {spec}")  # before its all-reduces use the device ids
    local = x
    for axis, placement in enumerate(region.placements):
        if isinstance(placement, Partial):
            scale = 1.0 / region.mesh.shape[axis] if placement.reduce_op == "avg" else 1.0
            local = torch_xla._XLAC._xla_spmd_all_reduce(
                _REDUCE_TYPES[placement.reduce_op], local, scale, _axis_groups(region, axis)
            )
    if local is x:
        local = x * 1  # mark a fresh value manual, not the caller's tensor
    torch_xla._XLAC._mark_manual_sharding(local, _manual_sharding())
    full_shape = global_shape(x.shape, region.placements, region.mesh, "exit_manual")
    return torch_xla._XLAC._spmd_shard_to_full_shape(
        local, xla_op_sharding(_without_partial(region), x.dim()), full_shape, local.dtype
    )


@functools.lru_cache(maxsize=None)
def _manual_sharding() -> Any:
    import torch_xla
    from torch_xla.distributed.spmd.xla_sharding import ShardingType

    return torch_xla._XLAC.OpSharding([], [], [], ShardingType.MANUAL)


def _region_not_differentiable(ctx: Any, grad: torch.Tensor):
    raise RuntimeError(
        "hops_xla.enter_manual/exit_manual have no autograd rule: lower the forward and backward "
        "graphs AOTAutograd produces (the backward region is its own local_map node)"
    )


for _name, _fake_rule, _xla_rule in (
    ("enter_manual", _enter_manual_fake, _enter_manual_xla),
    ("exit_manual", _exit_manual_fake, _exit_manual_xla),
):
    _lib.impl(_name, _manual_off_xla, "CompositeExplicitAutograd")
    _lib.impl(_name, _xla_rule, "XLA")
    torch.library.register_fake(f"hops_xla::{_name}", _fake_rule, lib=_lib)
    torch.library.register_autograd(
        f"hops_xla::{_name}", _region_not_differentiable, setup_context=lambda ctx, inputs, output: None, lib=_lib
    )

enter_manual = torch.ops.hops_xla.enter_manual.default
exit_manual = torch.ops.hops_xla.exit_manual.default
