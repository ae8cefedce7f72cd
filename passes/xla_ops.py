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

from typing import Any

import torch

from hops.specs import ShardingSpec, spec_from_text

_lib = torch.library.Library("hops_xla", "DEF")

_lib.define("sharding_constraint(Tensor x, str spec, str? grad_spec=None) -> Tensor")


def _sharding_constraint_copy(x: torch.Tensor, spec: str, grad_spec: str | None = None):
    return x.clone()


def _sharding_constraint_fake(x: torch.Tensor, spec: str, grad_spec: str | None = None):
    return torch.empty_like(x)


_OP_SHARDINGS: dict[tuple[str, int], Any] = {}
_XLA_MESHES: dict[Any, Any] = {}


def xla_op_sharding(spec_text: str, ndim: int) -> Any:
    """torch_xla's ``OpSharding`` for a spec text and a tensor rank, built once."""
    key = (spec_text, ndim)
    op_sharding = _OP_SHARDINGS.get(key)
    if op_sharding is None:
        spec = spec_from_text(spec_text)
        if not isinstance(spec, ShardingSpec):
            raise TypeError(f"expected the text of a hops.ShardingSpec, got {spec_text!r}")
        partition_spec = spec.to_partition_spec(ndim)
        xla_mesh = _XLA_MESHES.get(spec.mesh)
        if xla_mesh is None:
            xla_mesh = _XLA_MESHES[spec.mesh] = spec.mesh.to_xla()
        op_sharding = _OP_SHARDINGS[key] = xla_mesh.get_op_sharding(partition_spec)
    return op_sharding


def _sharding_constraint_xla(x: torch.Tensor, spec: str, grad_spec: str | None = None):
    import torch_xla

    # A copy of device data would stay device data and be resharded through the host;
    # an arithmetic identity makes an IR value the Sharding custom call can attach to.
    out = x * 1
    torch_xla._XLAC._xla_mark_sharding(out, xla_op_sharding(spec, x.dim()))
    return out


def _sharding_constraint_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, ctx.spec, ctx.grad_spec = inputs


def _sharding_constraint_backward(ctx: Any, grad: torch.Tensor):
    if ctx.grad_spec is None:
        return sharding_constraint(grad, ctx.spec), None, None
    return sharding_constraint(grad, ctx.grad_spec, ctx.spec), None, None


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
