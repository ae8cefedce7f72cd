"""``sharding_annotation_hop``: the traceable ``mark_sharding``.

Semantics: the identity on values (the output is a new tensor that does not alias ``x``)
with a statement of how the value should be laid out on a mesh. The statement is the
typed ``ShardingSpec`` in the node's args, so it survives every tracer and every pass.

Node form: ``hops_sharding_annotation(x, spec)``. ``spec.placements`` lay out the value;
``spec.grad_placements``, when given, lay out its gradient. The gradient goes through the
same HOP with the transposed spec (``spec.grad``: the two layouts swapped), so backward
graphs carry the annotation too, and the transpose of the transpose is the original node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    track_tensor_tree,
)

from hops import _compat, _dynamo, _export, _inductor
from hops._body_hop.body import wrap_functional
from hops._body_hop.subgraph import refuse_untracked_xla_operands
from hops._targets import load_device_rules
from hops.specs import Shard, ShardingSpec

__all__ = ["annotate_sharding", "sharding_annotation_hop"]


class ShardingAnnotation(HigherOrderOperator):
    """HOP ``hops_sharding_annotation(x, spec)``."""

    spec_type = ShardingSpec

    def __init__(self) -> None:
        # The package prefix keeps this name from overwriting another HOP's in torch's
        # single global HOP registry.
        super().__init__("hops_sharding_annotation", cacheable=True)

    def __call__(self, x: torch.Tensor, spec: ShardingSpec):
        if isinstance(x, torch.fx.Proxy):
            # torch.fx symbolic tracing (also how a pickled GraphModule is rebuilt).
            _check_spec(spec, ndim=None)
            return x.tracer.create_proxy("call_function", self, (x, spec), {})
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"annotate_sharding: x must be a Tensor, got {type(x).__name__}")
        _check_spec(spec, ndim=x.dim())
        if _compat.is_legacy_batched(x):
            # No rule can be registered for torch's legacy vmap: the eager value, the identity.
            return x.clone()
        load_device_rules((x,))
        # Negative Shard dims (DTensor's Shard(-1)) resolved here: nodes hold dims >= 0.
        return super().__call__(x, spec.for_rank(x.dim(), "annotate_sharding: spec"))

    @staticmethod
    def node_args(x: Any, spec: Any) -> tuple[Any, ...]:
        """The node args (Dynamo's rule builds the node from them)."""
        return (x, spec)


sharding_annotation_hop = ShardingAnnotation()


def annotate_sharding(
    x: torch.Tensor, spec: ShardingSpec, *, grad_spec: ShardingSpec | None = None
) -> torch.Tensor:
    """Return a copy of ``x`` annotated as laid out per ``spec``.

    ``grad_spec`` is the layout of the gradient of the result (default: ``spec``'s own
    ``grad_placements``, else ``spec``); it must be on ``spec``'s mesh. Raises
    ``TypeError``/``ValueError`` naming the argument for a non-tensor ``x``, a
    non-``ShardingSpec`` spec, a gradient layout on another mesh, or a ``Shard(d)`` with ``d``
    out of range for ``x``.
    """
    for name, value in (("spec", spec), ("grad_spec", grad_spec)):
        if not (value is None and name == "grad_spec") and not isinstance(value, ShardingSpec):
            raise TypeError(
                f"annotate_sharding: {name} must be a hops.ShardingSpec, got {type(value).__name__} {value!r}"
            )
    if grad_spec is not None:
        if grad_spec.mesh != spec.mesh:
            raise ValueError(
                f"annotate_sharding: grad_spec is on {grad_spec.mesh!r} but spec on {spec.mesh!r}: "
                "a value and its gradient are laid out on one mesh"
            )
        if grad_spec.placements != spec.placements:
            spec = ShardingSpec(spec.mesh, spec.placements, grad_spec.placements)
        else:
            spec = spec.layout
    return sharding_annotation_hop(x, spec)


def _check_spec(spec: Any, ndim: int | None) -> None:
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"annotate_sharding: spec must be a hops.ShardingSpec, got {type(spec).__name__} {spec!r}")
    if ndim is not None:
        spec.check_tensor(ndim, "annotate_sharding: spec")
        if spec.grad_placements is not None:
            spec.grad.check_tensor(ndim, "annotate_sharding: grad_spec")


# --------------------------------------------------------------------------- eager


@sharding_annotation_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(x: torch.Tensor, spec: ShardingSpec):
    # A plain tensor has no layout to change; the value is the identity, without aliasing.
    return x.clone()


# --------------------------------------------------------------------------- fake


@sharding_annotation_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, x: torch.Tensor, spec: ShardingSpec):
    # py_impl(FakeTensorMode), not register_fake: 2.9's fake-kernel path expects tuples.
    with mode:
        return x.clone()


# --------------------------------------------------------------------------- functionalize


@sharding_annotation_hop.py_functionalize_impl
def _functionalize(ctx: Any, x: torch.Tensor, spec: ShardingSpec):
    unwrapped = ctx.unwrap_tensors(x)
    with ctx.redispatch_to_next():
        out = sharding_annotation_hop(unwrapped, spec)
    return wrap_functional(ctx, out)


# --------------------------------------------------------------------------- proxy


@sharding_annotation_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, x: torch.Tensor, spec: ShardingSpec):
    refuse_untracked_xla_operands(mode, (x,), "annotate_sharding")
    with disable_proxy_modes_tracing():
        out = sharding_annotation_hop(x, spec)
    node_args = pytree.tree_map(mode.tracer.unwrap_proxy, (x, spec))
    _inductor.ensure_lowering_pass()
    _export.note_recorded()
    out_proxy = mode.tracer.create_proxy("call_function", sharding_annotation_hop, node_args, {})
    return track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


# --------------------------------------------------------------------------- autograd


class _ShardingAnnotationFunction(torch.autograd.Function):
    """The annotation's derivatives: the cotangent is laid out per the gradient layout (its
    own cotangent, in double backward, per the value's: the transposed spec), a forward-mode
    tangent like the value. New-style, so torch.func transforms go through it."""

    @staticmethod
    def forward(x: torch.Tensor, spec: ShardingSpec):
        with torch._C._AutoDispatchBelowAutograd():
            return sharding_annotation_hop(x, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return sharding_annotation_hop(grad, ctx.spec.grad), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _spec: Any):
        return sharding_annotation_hop(tangent, ctx.spec)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, spec: ShardingSpec):
        return _batched(x, in_dims[0], spec), 0


@sharding_annotation_hop.py_impl(DispatchKey.Autograd)
def _autograd(x: torch.Tensor, spec: ShardingSpec):
    # Forward-mode tangents count too: below autograd they would be dropped.
    if (torch.is_grad_enabled() and x.requires_grad) or _compat.has_forward_tangent((x,)):
        return _ShardingAnnotationFunction.apply(x, spec)
    with torch._C._AutoDispatchBelowAutograd():
        return sharding_annotation_hop(x, spec)


# --------------------------------------------------------------------------- torch.func

_GRAD, _JVP, _VMAP = _compat.transform_types()


@sharding_annotation_hop.py_impl(_GRAD)
@sharding_annotation_hop.py_impl(_JVP)
def _differentiate(interpreter: Any, x: torch.Tensor, spec: ShardingSpec):
    if _compat.differentiating_over_functionalize():
        # torch.func has no functionalize rule for autograd.Functions: the value (the
        # identity) at this level, differentiated as such; the statement is dropped here.
        return x.clone()
    # torch.func routes the Function to its own rules, which call this HOP again at the level below.
    return _ShardingAnnotationFunction.apply(x, spec)


sharding_annotation_hop.py_impl(DispatchKey.FuncTorchGradWrapper)(_compat.dead_wrapper_rule(sharding_annotation_hop))
# Selective activation checkpointing saves or recomputes the annotation as one op.
_compat.redirect_checkpoint_modes(sharding_annotation_hop)


@sharding_annotation_hop.py_impl(_VMAP)
def _vmap(interpreter: Any, x: torch.Tensor, spec: ShardingSpec):
    (x,), (dim,) = _compat.unwrap_batched((x,), interpreter.level())
    with interpreter.lower():
        if dim is None:
            return sharding_annotation_hop(x, spec)
        out = _batched(x, dim, spec)
    return _compat.wrap_batched((out,), (0,), interpreter.level())[0]


def _batched(x: torch.Tensor, dim: int, spec: ShardingSpec) -> torch.Tensor:
    """The annotation of a batch of values stacked at ``dim``: the batch moves to dim 0,
    replicated, and every sharded dim moves one past it."""
    shifted = ShardingSpec(
        spec.mesh,
        tuple(_past_batch(p) for p in spec.placements),
        None if spec.grad_placements is None else tuple(_past_batch(p) for p in spec.grad_placements),
    )
    return sharding_annotation_hop(x.movedim(dim, 0), shifted)


def _past_batch(placement: Any) -> Any:
    if isinstance(placement, Shard) and placement.dim >= 0:
        return Shard(placement.dim + 1)
    return placement


# --------------------------------------------------------------------------- inductor


@_inductor.register_inductor_rule(sharding_annotation_hop)
def _inductor_rule(x: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    # The value (a new tensor, as the HOP's result is; inductor drops the copy where it can).
    return x.clone()


# --------------------------------------------------------------------------- dynamo

_dynamo.register_plain_hop(sharding_annotation_hop)
