"""``named_scope_hop``: a named region (a profiler / HLO op-name scope) that survives tracing.

``hops.named_scope("attention")`` decorates a function (or wraps one:
``hops.named_scope("attention")(fn)``); each call emits one node::

    hops_named_scope(attention_body_0, *tensors, hops.ScopeSpec('attention'))

whose body is the function traced into a subgraph named after it. Values are unchanged:
the region is its body. What the name is for:
- ``passes.lower_to_xla`` runs the body inside torch_xla's op-name scope, so the HLO ops of
  the region carry ``op_name="attention.<n>/..."`` metadata (what profiles group by);
  ``passes.inline_hops`` replaces the node by its body;
- the backward is a region of its own named ``attention/bwd``.

Rules:
- eager: the body (on XLA tensors, inside the op-name scope);
- fake: the body on fake tensors;
- functionalization / proxy: the body must not mutate or alias its inputs (refused, naming
  the function and argument); it is traced into a subgraph named after the user function;
- autograd: the body's joint is traced once and split (``hops._joint``): the forward region
  also returns the residuals its backward reads, and the backward region
  (``ScopeSpec(name + '/bwd')``) takes primals, residuals and cotangents, so nothing is
  recomputed. Outside tracing the body simply runs under autograd.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
)

from hops import _compat, _dynamo
from hops._closure import closed_over_tensors, lift_closure
from hops._joint import is_tracing, split_joint, trace_joint
from hops._subgraph import (
    body_name,
    emit_body_node,
    functionalize_body_call,
    named,
    rename_inner_function,
)
from hops.kernel import _shares_storage
from hops.specs import _FxLiteral

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


class NamedScope(HigherOrderOperator):
    """HOP ``hops_named_scope(body, *inputs, spec)``."""

    def __init__(self) -> None:
        super().__init__("hops_named_scope")

    def __call__(self, body: Callable, *inputs_and_spec: Any):
        inputs, spec = _split(inputs_and_spec)
        if inputs and isinstance(inputs[-1], tuple):
            # Dynamo's node form: values the body closed over come as one trailing tuple;
            # the body takes them after the other inputs.
            *inputs, lifted = inputs
            inputs = (*inputs, *lifted)
        if any(isinstance(v, torch.fx.Proxy) for v in inputs):
            # torch.fx symbolic tracing (also how torch 2.9 rebuilds a pickled GraphModule).
            proxy = next(v for v in inputs if isinstance(v, torch.fx.Proxy))
            return proxy.tracer.create_proxy("call_function", self, (body, *inputs, spec), {})
        if not callable(body):
            raise TypeError(f"named_scope_hop: body must be callable, got {type(body).__name__}")
        for i, value in enumerate(inputs):
            if not isinstance(value, (torch.Tensor, int, torch.SymInt)):
                raise TypeError(
                    f"named scope {spec.name!r} ({body_name(body)}): input {i} must be a Tensor (or an int), "
                    f"got {type(value).__name__}"
                )
        return super().__call__(body, *inputs, spec)


named_scope_hop = NamedScope()


def _split(inputs_and_spec: Sequence[Any]) -> tuple[tuple[Any, ...], ScopeSpec]:
    if not inputs_and_spec or not isinstance(inputs_and_spec[-1], ScopeSpec):
        raise TypeError(
            "named_scope_hop(body, *inputs, spec): the last argument must be a hops.ScopeSpec, got "
            f"{type(inputs_and_spec[-1]).__name__ if inputs_and_spec else 'nothing'}"
        )
    return tuple(inputs_and_spec[:-1]), inputs_and_spec[-1]


# --------------------------------------------------------------------------- public API


def named_scope(name: str) -> Callable[[Callable], Callable]:
    """A decorator that puts every call of the function into the scope ``name``.

    ``@hops.named_scope("attention")`` on a function, or ``hops.named_scope("attention")(fn)``
    around a callable. The function takes any arguments (tensors become the region's inputs,
    other values are fixed for the call) and returns a Tensor or a tuple/list of Tensors; it
    must not modify or return its inputs. Raises ``TypeError``/``ValueError`` for a name
    that is not a non-empty str, a non-callable, or a function returning anything else.
    """
    spec = ScopeSpec(name)

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"hops.named_scope({name!r}) must wrap a callable, got {type(fn).__name__} {fn!r}")
        make_body = rename_inner_function(_make_body, "body", body_name(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves, treespec = pytree.tree_flatten((args, kwargs))
            tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            body = make_body(fn, leaves, tensor_positions, treespec, spec)
            tensors = [leaves[i] for i in tensor_positions]
            if not torch.compiler.is_compiling() and is_tracing(tensors):
                # Tensors the function reads from its closure (parameters, outer values)
                # become inputs, so the traced body reads placeholders and they get
                # gradients. Dynamo lifts them itself.
                closed = closed_over_tensors(body, tensors)
                if closed:
                    body, tensors = lift_closure(body, len(tensors), closed), [*tensors, *closed]
            return named_scope_hop(body, *tensors, spec)

        return call

    return decorate


def _make_body(fn: Callable, leaves: list[Any], tensor_positions: list[int], treespec: Any, spec: ScopeSpec) -> Callable:
    """The region body: ``fn`` with its non-tensor arguments fixed, taking the tensors
    positionally. ``named_scope`` compiles ``body`` under the user function's name."""

    def body(*tensors: torch.Tensor) -> Any:
        call_leaves = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            call_leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(call_leaves, treespec)
        result = fn(*args, **kwargs)
        if isinstance(result, list):
            result = tuple(result)
        if not isinstance(result, torch.Tensor) and not (
            isinstance(result, tuple) and result and all(isinstance(r, torch.Tensor) for r in result)
        ):
            raise TypeError(
                f"hops.named_scope({spec.name!r}): {body_name(fn)} returned "
                f"{pytree.tree_map(lambda r: type(r).__name__, result)}, expected a Tensor or a "
                "tuple/list of Tensors"
            )
        return result

    return body


# --------------------------------------------------------------------------- eager


def _check_outputs(name: str, spec: ScopeSpec, outputs: Any) -> Any:
    if isinstance(outputs, list):
        outputs = tuple(outputs)
    if not isinstance(outputs, torch.Tensor) and not (
        isinstance(outputs, tuple) and outputs and all(isinstance(o, torch.Tensor) for o in outputs)
    ):
        raise TypeError(
            f"named scope {spec.name!r}: {name} returned {type(outputs).__name__}, expected a Tensor "
            "or a tuple of Tensors"
        )
    return outputs


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


def _run_region(body: Callable, inputs: Sequence[Any], spec: ScopeSpec) -> Any:
    """Run the region on real tensors, refusing writes into inputs and aliased outputs."""
    name = body_name(body)
    tensors = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
    versions = [t._version for _, t in tensors]
    outputs = _check_outputs(name, spec, run_in_scope(body, inputs, spec))
    for (i, t), version in zip(tensors, versions):
        if t._version != version:
            raise ValueError(
                f"{name} mutates its argument input {i} in place; a named scope's body must be functional"
            )
    for j, output in enumerate((outputs,) if isinstance(outputs, torch.Tensor) else outputs):
        for i, t in tensors:
            if _shares_storage(output, t):
                raise ValueError(
                    f"{name} returns output {j}, which aliases its argument input {i} (the input itself or "
                    "a view of it); return a copy (e.g. .clone()) instead"
                )
    return outputs


@named_scope_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *inputs_and_spec: Any):
    inputs, spec = _split(inputs_and_spec)
    return _run_region(body, inputs, spec)


# --------------------------------------------------------------------------- fake


@named_scope_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *inputs_and_spec: Any):
    inputs, spec = _split(inputs_and_spec)
    with mode:
        return _check_outputs(body_name(body), spec, body(*inputs))


# --------------------------------------------------------------------------- functionalize


@named_scope_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *inputs_and_spec: Any):
    inputs, spec = _split(inputs_and_spec)
    return functionalize_body_call(ctx, named_scope_hop, body, inputs, (spec,), lambda unwrapped: unwrapped)


# --------------------------------------------------------------------------- proxy


@named_scope_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *inputs_and_spec: Any):
    inputs, spec = _split(inputs_and_spec)
    with disable_proxy_modes_tracing():
        outputs = named_scope_hop(body, *inputs, spec)
    return emit_body_node(mode, named_scope_hop, body, inputs, (*inputs, spec), outputs)


# --------------------------------------------------------------------------- autograd


def _example_outputs(body: Callable, inputs: Sequence[Any]) -> tuple[list[torch.Tensor], bool]:
    """Stand-ins for the body's cotangents (fake where the inputs are, else real zeros),
    and whether the body returns one Tensor (rather than a tuple)."""
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops.utils import _from_fun, suspend_functionalization
    from torch._subclasses.functional_tensor import disable_functional_mode

    with suspend_functionalization(), disable_functional_mode(), disable_proxy_modes_tracing():
        unwrapped = [_from_fun(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        fake_mode = detect_fake_mode(unwrapped)
        if fake_mode is not None:
            with fake_mode:
                result = body(*unwrapped)
                outputs = [result] if isinstance(result, torch.Tensor) else list(result)
                return [torch.empty_like(o) for o in outputs], isinstance(result, torch.Tensor)
        scratch = FakeTensorMode(allow_non_fake_inputs=True)
        with scratch:
            result = body(*(scratch.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in unwrapped))
        outputs = [result] if isinstance(result, torch.Tensor) else list(result)
        cotangents = [torch.zeros(o.shape, dtype=o.dtype, device=o.device) for o in outputs]
        return cotangents, isinstance(result, torch.Tensor)


class _NamedScopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: ScopeSpec, name: str, split: Any, needs_grad: list, single: bool, *inputs: Any):
        with torch._C._AutoDispatchBelowAutograd():
            results = named_scope_hop(named(split.forward, name), *inputs, spec)
        outputs, residuals = results[: split.num_outputs], results[split.num_outputs :]
        primals = [inputs[i] for i in split.primals_for_backward]
        # Ints (SymInts) cannot be saved as tensors: keep them aside.
        ctx.non_tensors = [None if isinstance(v, torch.Tensor) else v for v in (*primals, *residuals)]
        ctx.save_for_backward(*(v for v in (*primals, *residuals) if isinstance(v, torch.Tensor)))
        ctx.spec, ctx.name, ctx.split, ctx.needs_grad = spec, name, split, needs_grad
        return outputs[0] if single else tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        values = [next(saved) if value is None else value for value in ctx.non_tensors]
        grads = named_scope_hop(
            named(ctx.split.backward, f"{ctx.name}_bwd"), *values, *cotangents, ctx.spec.backward()
        )
        # One gradient per input that needed one when the joint was traced.
        grads = iter((grads,) if isinstance(grads, torch.Tensor) else grads)
        per_input = [next(grads) if need else None for need in ctx.needs_grad]
        return (None,) * 5 + tuple(g if need else None for g, need in zip(per_input, ctx.needs_input_grad[5:]))


@named_scope_hop.py_autograd_impl
def _autograd(body: Callable, *inputs_and_spec: Any):
    inputs, spec = _split(inputs_and_spec)
    if not is_tracing(inputs):
        # Eager: the region is transparent to autograd, so its ops record their own backward.
        return _run_region(body, inputs, spec)
    needs_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
    cotangents, single = _example_outputs(body, inputs)
    joint = trace_joint(body, inputs, cotangents, needs_grad)
    split = split_joint(joint, len(inputs), len(cotangents))
    return _NamedScopeFunction.apply(spec, body_name(body), split, needs_grad, single, *inputs)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(named_scope_hop)
