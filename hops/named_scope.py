"""``named_scope_hop``: a named region (a profiler / HLO op-name scope) that survives tracing.

``hops.named_scope("attention")`` decorates a function (or wraps one:
``hops.named_scope("attention")(fn)``); each call emits one node::

    hops_named_scope(attention_body_0, *tensors, hops.ScopeSpec('attention'))

whose body is the function traced into a subgraph named after it. Values are unchanged:
the region is its body. What the name is for:
- ``passes.lower_to_xla`` runs the body inside torch_xla's op-name scope, so the HLO ops of
  the region carry ``op_name="attention.<n>/..."`` metadata (what profiles group by);
  ``passes.inline_hops`` replaces the node by its body;
- the backward is a region of its own: scope ``attention/bwd``, its body (the function's
  backward) the subgraph ``attention_bwd_body_0``.

Rules:
- eager: the body (on XLA tensors, inside the op-name scope);
- fake: the body on fake tensors;
- functionalization / proxy: the body must not mutate or alias its inputs (refused, naming
  the function and argument); it is traced into a subgraph named after the user function;
- autograd: the body's joint is traced once and split (``hops._body_hop.joint``): the
  forward region also returns the residuals its backward reads, and the backward region
  (``ScopeSpec(name + '/bwd')``, body ``<function>_bwd``) takes primals, residuals and
  cotangents, so nothing is recomputed. Outside tracing the body simply runs under autograd.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hops import _compat, _dynamo, _inductor
from hops._body_hop.body import version_counter
from hops._body_hop.body_record import set_trace_key
from hops._body_hop.call import argument_names, call_body_hop
from hops._body_hop.region import RegionHOP
from hops._body_hop.subgraph import body_name, fresh_outputs, rename_inner_function
from hops._errors import call_prefix, hop_prefix
from hops.specs import _FxLiteral, register_spec_type

__all__ = ["named_scope", "named_scope_hop", "ScopeSpec"]


@dataclasses.dataclass(frozen=True, repr=False)
class ScopeSpec(_FxLiteral):
    """The name of a scope: non-empty ``/``-separated parts (``'layer0/attention'``), each
    non-empty, without surrounding whitespace or control characters."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"ScopeSpec(name=...) must be a str, got {type(self.name).__name__} {self.name!r}")
        if not self.name:
            raise ValueError("ScopeSpec(name=...) must be a non-empty str, got ''")
        for part in self.name.split("/"):
            if not part or part != part.strip() or not part.isprintable():
                raise ValueError(
                    f"ScopeSpec(name=...) must be '/'-separated non-empty parts without surrounding "
                    f"whitespace or control characters, got {self.name!r}"
                )

    def __repr__(self) -> str:
        return f"hops.ScopeSpec({self.name!r})"

    def backward(self) -> ScopeSpec:
        """The scope of this region's backward: ``<name>/bwd``."""
        return ScopeSpec(f"{self.name}/bwd")


register_spec_type("ScopeSpec", ScopeSpec)


class NamedScope(RegionHOP):
    """HOP ``hops_named_scope(body, *inputs, spec)``."""

    spec_type = ScopeSpec

    def __init__(self) -> None:
        super().__init__("hops_named_scope")

    def check(self, body: Callable, inputs: Sequence[Any], spec: ScopeSpec) -> None:
        for i, value in enumerate(inputs):
            if not isinstance(value, (torch.Tensor, int, torch.SymInt)):
                raise TypeError(
                    f"{hop_prefix(self, body)}: inputs[{i}] must be a Tensor (or an int), got {type(value).__name__} "
                    f"(scope {spec.name!r})"
                )

    def body_operands(self, inputs: Sequence[Any], spec: ScopeSpec) -> tuple:
        return tuple(inputs)

    def outputs_from_body(self, outputs: Sequence[Any], inputs: Sequence[Any], spec: ScopeSpec) -> tuple:
        _check_outputs(None, spec, outputs)
        return tuple(o.new_empty(o.size()) for o in outputs)

    def run(self, body: Callable, inputs: Sequence[Any], spec: ScopeSpec) -> tuple:
        return _run_region(body, inputs, spec)

    def fold_lifted(self, inputs: Sequence[Any], spec: ScopeSpec, lifted: Sequence[Any]) -> tuple[list, ScopeSpec]:
        return [*inputs, *lifted], spec

    def backward_spec(self, spec, split, residuals, needs_grad, present) -> ScopeSpec:
        return spec.backward()


named_scope_hop = NamedScope()


# --------------------------------------------------------------------------- public API


def named_scope(name: str) -> _ScopeDecorator:
    """A decorator that puts every call of the function into the scope ``name``.

    ``@hops.named_scope("attention")`` on a function, or ``hops.named_scope("attention")(fn)``
    around a callable. The function takes any arguments (tensors become the region's inputs,
    other values are fixed for the call) and returns a Tensor or a pytree of Tensors; it must
    not write into its inputs or tensors it closes over (refused, naming the tensor). Raises
    ``TypeError``/``ValueError`` for a name that is not a non-empty str, a non-callable, or a
    function returning anything else.
    """
    try:
        spec = ScopeSpec(name)
    except (TypeError, ValueError) as error:
        raise type(error)(f"named_scope: {error}") from None

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"named_scope: hops.named_scope({name!r}) must wrap a callable, got {type(fn).__name__} {fn!r}")
        make_body = rename_inner_function(_make_body, "body", body_name(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves, treespec = pytree.tree_flatten((args, kwargs))
            tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            body = make_body(fn, leaves, tensor_positions, treespec, spec)
            set_trace_key(body, fn, treespec, [leaf for i, leaf in enumerate(leaves) if i not in tensor_positions])
            tensors = [leaves[i] for i in tensor_positions]
            return call_body_hop(
                named_scope_hop,
                body,
                tensors,
                spec,
                what=hop_prefix(named_scope_hop, fn),
                # Leaves are named by key path in the caller's arguments: args[0]['w'].
                input_names=lambda i: argument_names(args, kwargs)[tensor_positions[i]],
                user_function=fn,
                device_names=lambda i: argument_names(args, kwargs)[tensor_positions[i]],
            )

        return call

    return _ScopeDecorator(name, decorate)


class _ScopeDecorator:
    """What ``named_scope(name)`` returns: a decorator. Not a context manager (as JAX's
    ``named_scope`` is): a region is a function, so ``with`` is refused with what to write."""

    def __init__(self, name: str, decorate: Callable[[Callable], Callable]) -> None:
        self.name, self.decorate = name, decorate

    def __call__(self, fn: Callable) -> Callable:
        return self.decorate(fn)

    def __enter__(self) -> None:
        raise TypeError(
            f"named_scope: hops.named_scope({self.name!r}) is a decorator, not a context manager: a scope is a "
            f"region of the graph with inputs and outputs, so put the code in a function and write "
            f"@hops.named_scope({self.name!r}) above it, or call hops.named_scope({self.name!r})(fn)(*args)"
        )

    def __exit__(self, *exc_info: Any) -> None:
        return None


def _make_body(fn: Callable, leaves: list[Any], tensor_positions: list[int], treespec: Any, spec: ScopeSpec) -> Callable:
    """The region body: ``fn`` with its non-tensor arguments fixed, taking the tensors
    positionally. ``named_scope`` compiles ``body`` under the user function's name."""

    def body(*tensors: torch.Tensor) -> Any:
        call_leaves = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            call_leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(call_leaves, treespec)
        result = fn(*args, **kwargs)
        if not pytree.tree_leaves(result) or not all(isinstance(r, torch.Tensor) for r in pytree.tree_leaves(result)):
            raise TypeError(
                f"{hop_prefix(named_scope_hop, fn)}: returned {pytree.tree_map(lambda r: type(r).__name__, result)}, "
                f"expected a Tensor or a pytree of Tensors (scope {spec.name!r})"
            )
        return result

    return body


# --------------------------------------------------------------------------- eager


def _check_outputs(name: str | None, spec: ScopeSpec, outputs: Sequence[Any]) -> None:
    if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise TypeError(
            f"{call_prefix('named_scope', name)}: the body returned {[type(o).__name__ for o in outputs]}, "
            f"expected one or more Tensors (scope {spec.name!r})"
        )


@functools.lru_cache(maxsize=None)
def _warn_ir_debug_off() -> None:
    warnings.warn(
        "hops.named_scope on XLA: torch_xla records HLO op_name scopes only with IR debug info on "
        "(XLA_HLO_DEBUG=1, or torch_xla._XLAC._set_ir_debug(True)); without it the scopes leave no trace",
        stacklevel=3,
    )


def run_in_scope(body: Callable, inputs: Sequence[Any], spec: ScopeSpec) -> Any:
    """``body(*inputs)``, inside torch_xla's op-name scope when the inputs are XLA tensors."""
    on_xla = any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in inputs)
    if not on_xla:
        return body(*inputs)
    if not _compat.xla_ir_debug():
        _warn_ir_debug_off()
    with _compat.xla_named_scope(spec.name):
        return body(*inputs)


def _run_region(body: Callable, inputs: Sequence[Any], spec: ScopeSpec) -> tuple:
    """Run the region on real tensors: a write into an input is refused (the public function
    refuses it before running; a hand-made call is checked after), an output that aliases an
    input or an earlier output is returned as a copy."""
    name = body_name(body)
    tensors = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
    versions = [version_counter(t) for _, t in tensors]
    outputs = pytree.tree_leaves(run_in_scope(body, inputs, spec))
    _check_outputs(name, spec, outputs)
    for (i, t), version in zip(tensors, versions):
        if version_counter(t) != version:
            raise ValueError(
                f"named_scope({name}): the body writes into its input inputs[{i}] in place; a named scope's body must be functional"
            )
    return fresh_outputs(outputs, [t for _, t in tensors])


@named_scope_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *inputs_and_spec: Any):
    return named_scope_hop.eager_rule(body, *inputs_and_spec)


# --------------------------------------------------------------------------- fake


@named_scope_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *inputs_and_spec: Any):
    return named_scope_hop.fake_rule(mode, body, *inputs_and_spec)


# --------------------------------------------------------------------------- functionalize


@named_scope_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *inputs_and_spec: Any):
    return named_scope_hop.functionalize_rule(ctx, body, *inputs_and_spec)


# --------------------------------------------------------------------------- proxy


@named_scope_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *inputs_and_spec: Any):
    return named_scope_hop.proxy_rule(mode, body, *inputs_and_spec)


# --------------------------------------------------------------------------- autograd
#
# Eager: the body runs under autograd (its ops record their own backward). Traced: the joint
# is split (hops._body_hop.region.RegionPlan): the forward region also returns the residuals
# its backward reads, and the backward region (scope ``<name>/bwd``, body ``<function>_bwd``)
# takes primals, residuals and cotangents, so nothing is recomputed.


@named_scope_hop.py_impl(DispatchKey.Autograd)  # always: a closed-over tensor may need grad when no operand does
def _autograd(body: Callable, *inputs_and_spec: Any):
    return named_scope_hop.autograd_rule(body, *inputs_and_spec)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(named_scope_hop)


# --------------------------------------------------------------------------- inductor


@_inductor.register_inductor_rule(named_scope_hop)
def _inductor_rule(body: Callable, *inputs_and_spec: Any) -> tuple:
    """The body inlined, its nodes named after the scope (see ``_inductor.nodes_named``)."""
    inputs, spec = named_scope_hop.split_args(inputs_and_spec)
    with _inductor.nodes_named(spec.name):
        return named_scope_hop.run_at_boundary(_inductor.inlined(body), inputs, spec)
