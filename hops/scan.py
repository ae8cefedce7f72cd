"""``scan_hop``: ``jax.lax.scan`` over dim 0, whose body keeps every HOP of this package.

``hops.scan(fn, init, xs)`` with ``fn(carry, x) -> (new_carry, y)`` returns
``(final_carry, ys)``: xs are sliced along dim 0, ys stacked along dim 0; carries, xs and ys
are pytrees of tensors. One node is emitted::

    hops_scan(body, *init, *xs, *additional, hops.ScanSpec(num_carry, num_xs, ...))

``body(*carry, *x, *additional) -> (*new_carry, *y)``. Tensors ``fn`` reads from its
closure are lifted into ``additional`` (so they get gradients); Dynamo lifts them itself.

Autograd traces one step's vjp (the "joint") and splits it:
- ``remat=False``: the forward scan also stacks each step's residuals (what the step's
  backward reads); the backward is a reverse ``scan_hop`` over them;
- ``remat=True``: the forward stacks only the carries; the backward is a reverse
  ``scan_hop`` that recomputes each step from its carry.
Either way the backward body is a traced graph, so HOPs in the body (annotations,
local_map regions, kernels, scopes) appear in the forward and the backward bodies.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._higher_order_ops.utils import (
    materialize_as_graph,
)
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
)

from hops import _dynamo
from hops._closure import _ReadsOutsideInputs, _SubstituteTensors
from hops._joint import is_tracing
from hops._subgraph import (
    _is_view,
    body_name,
    check_body_is_functional,
    copy_if_aliases,
    emit_body_node,
    functionalize_body_call,
    known_functional,
    named,
    rename_inner_function,
    strip_detach,
    symbolic_trace_call,
)
from hops.specs import _FxLiteral

__all__ = ["scan", "scan_hop", "ScanSpec"]


@dataclasses.dataclass(frozen=True, repr=False)
class ScanSpec(_FxLiteral):
    """The static part of a scan node: how its flat inputs split, and how it runs.

    ``num_carry`` / ``num_xs`` count the leading carry and xs inputs (the rest are
    additional inputs, the same at every step); ``length`` is the number of steps when it
    is static (always when there are no xs; ``None`` for a symbolic length);
    ``reverse`` runs the steps from the last slice to the first (ys stay in slice order);
    ``remat`` makes the backward recompute each step instead of saving its residuals.
    """

    num_carry: int
    num_xs: int
    length: int | None = None
    reverse: bool = False
    remat: bool = False

    def __post_init__(self) -> None:
        for name in ("num_carry", "num_xs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"ScanSpec({name}) must be an int >= 0, got {value!r}")
        if self.length is not None and (isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0):
            raise TypeError(f"ScanSpec(length) must be an int >= 0 or None, got {self.length!r}")
        for name in ("reverse", "remat"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ScanSpec({name}) must be a bool, got {getattr(self, name)!r}")

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)!r}"
            for name, default in (("length", None), ("reverse", False), ("remat", False))
            if getattr(self, name) != default
        )
        return f"hops.ScanSpec(num_carry={self.num_carry}, num_xs={self.num_xs}{extra})"


class Scan(HigherOrderOperator):
    """HOP ``hops_scan(body, *init, *xs, *additional, spec)``."""

    def __init__(self) -> None:
        super().__init__("hops_scan")

    def __call__(self, body: Callable, *inputs_and_spec: Any):
        traced = symbolic_trace_call(self, (body, *inputs_and_spec))
        if traced is not None:
            return traced
        *inputs, spec = inputs_and_spec
        if not isinstance(spec, ScanSpec):
            raise TypeError(f"scan_hop: the last argument must be a hops.ScanSpec, got {type(spec).__name__}")
        if inputs and isinstance(inputs[-1], tuple):
            # Dynamo's node form: values the body closed over come as one trailing tuple;
            # they are additional inputs, the same at every step.
            *inputs, lifted = inputs
            inputs = [*inputs, *lifted]
        _check_inputs(body, inputs, spec)
        return super().__call__(body, *inputs, spec)

    @staticmethod
    def body_example_args(inputs: Sequence[Any], specs: Sequence[Any]) -> tuple:
        """What the body sees: carries and additional inputs whole, one slice of each xs."""
        spec = specs[-1]
        carry, xs, additional = _split(inputs, spec)
        return (*carry, *_slice_examples(xs), *additional)


scan_hop = Scan()


def _split(inputs: Sequence[Any], spec: ScanSpec) -> tuple[list[Any], list[Any], list[Any]]:
    carry_end = spec.num_carry
    xs_end = carry_end + spec.num_xs
    return list(inputs[:carry_end]), list(inputs[carry_end:xs_end]), list(inputs[xs_end:])


def _length(xs: Sequence[torch.Tensor], spec: ScanSpec) -> int:
    return xs[0].shape[0] if xs else spec.length


def _check_inputs(body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> None:
    name = body_name(body)
    if not callable(body):
        raise TypeError(f"scan_hop: body must be callable, got {type(body).__name__}")
    if len(inputs) < spec.num_carry + spec.num_xs:
        raise ValueError(
            f"scan {name}: {len(inputs)} inputs but the spec counts {spec.num_carry} carries and {spec.num_xs} xs"
        )
    carry, xs, _ = _split(inputs, spec)
    for i, value in enumerate([*carry, *xs]):
        if not isinstance(value, (torch.Tensor, torch.fx.Proxy)):
            raise TypeError(f"scan {name}: input {i} must be a tensor, got {type(value).__name__}")
    devices = [value.device.type for value in inputs if isinstance(value, torch.Tensor)]
    if "xla" in devices and any(device != "xla" for device in devices):
        # One While runs the scan on XLA: every input must be an operand of it.
        i = next(i for i, device in enumerate(devices) if device != "xla")
        raise ValueError(f"scan {name}: input {i} is a {devices[i]} tensor; a scan on XLA tensors needs every input on the XLA device")
    if not xs and spec.length is None:
        raise ValueError(f"scan {name}: no xs to scan over and no length: pass length=")
    if any(isinstance(x, torch.fx.Proxy) for x in xs):
        return
    _check_xs(f"scan {name}", xs)
    if xs and spec.length is not None and spec.length != xs[0].shape[0]:
        raise ValueError(f"scan {name}: length={spec.length} but the xs have length {xs[0].shape[0]}")


def _slice_examples(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One step's slice of each xs leaf (shape without dim 0), valid even for length 0.

    Tracers only read a stand-in's metadata: fake and functional xs get a new tensor with
    the slice's sizes and strides (a functional ``select`` costs a view replay per call);
    real xs (``make_fx`` in real mode runs the body) get their first slice.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return [
        x.new_empty_strided(x.shape[1:], x.stride()[1:])
        if isinstance(x, (FakeTensor, FunctionalTensor)) or x.shape[0] == 0
        else x.select(0, 0)
        for x in xs
    ]


def _check_step(name: str, outputs: Any, carry: Sequence[torch.Tensor], leaf_names: Sequence[str] | None = None) -> tuple:
    """The body's outputs are tensors, and each new carry matches its init."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) < len(carry):
        raise TypeError(f"scan {name}: the body must return a tuple (*new_carry, *ys) of tensors, got {outputs!r}")
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            what = f"carry leaf {i}" if i < len(carry) else f"y leaf {i - len(carry)}"
            raise TypeError(f"scan {name}: the body returned {type(value).__name__} for {what}; the body must return tensors")
    for i, (new, old) in enumerate(zip(outputs, carry)):
        if new.shape != old.shape or new.dtype != old.dtype:
            leaf = leaf_names[i] if leaf_names else f"carry leaf {i}"
            raise ValueError(
                f"scan {name}: {leaf} changes from {tuple(old.shape)} {old.dtype} to {tuple(new.shape)} "
                f"{new.dtype} in one step; a carry must keep its shape and dtype"
            )
    return tuple(outputs)


# --------------------------------------------------------------------------- public API


def _find_closed_over_tensors(
    fn: Callable,
    example_inputs: Sequence[Any],
    name: str,
    carry_treespec: Any,
    xs_treespec: Any,
    num_additional: int,
) -> tuple[list[torch.Tensor], Any]:
    """Run one step on stand-ins of ``example_inputs``: the tensors it read from outside, and
    the pytree structure of its y.

    Real inputs are replaced by fake ones (nothing runs), which also refuses data-dependent
    Python control flow early, as every tracer would later.
    """
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    tracing = is_tracing(example_inputs)
    with disable_proxy_modes_tracing(), torch.no_grad():
        if tracing:
            inputs = list(example_inputs)
            context = _ReadsOutsideInputs(inputs)
            run_mode = None
        else:
            run_mode = FakeTensorMode(allow_non_fake_inputs=True)
            inputs = [run_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
            context = _ReadsOutsideInputs(inputs)
        structure = functools.partial(_ys_structure, fn, inputs, carry_treespec, xs_treespec, num_additional)
        try:
            if run_mode is None:
                with context:
                    ys_treespec = structure()
            else:
                with unset_fake_temporarily(), run_mode, context:
                    ys_treespec = structure()
        except (GuardOnDataDependentSymNode, torch._subclasses.fake_tensor.DataDependentOutputException) as e:
            raise ValueError(
                f"scan {name}: the body branches in Python on a tensor's value ({type(e).__name__}); a "
                "scan body is traced once for every step, so its control flow cannot depend on data "
                "(use torch.where, or torch.cond)"
            ) from None
    return [t for t in context.outside.values() if not isinstance(t, FakeTensor) or tracing], ys_treespec


def scan(
    fn: Callable,
    init: Any,
    xs: Any,
    *,
    additional_inputs: Sequence[torch.Tensor] = (),
    reverse: bool = False,
    remat: bool = False,
    length: int | None = None,
) -> tuple[Any, Any]:
    """``jax.lax.scan``: ``fn(carry, x, *additional_inputs) -> (new_carry, y)`` over dim 0 of ``xs``.

    Returns ``(final_carry, ys)`` with ys stacked along dim 0 in slice order (also when
    ``reverse``). ``length`` is needed when ``xs`` has no leaves. Errors name the leaf:
    carry changing shape/dtype/structure, xs of different lengths, non-tensor outputs,
    data-dependent control flow in ``fn``.
    """
    name = body_name(fn)
    if not callable(fn):
        raise TypeError(f"scan(fn=...) must be callable, got {type(fn).__name__}")
    init_leaves, carry_treespec = pytree.tree_flatten(init)
    # No xs (``None``, as in jax.lax.scan with ``length``): the body gets ``x=None``.
    xs_leaves, xs_treespec = ([], None) if xs is None else pytree.tree_flatten(xs)
    additional = list(additional_inputs)
    for what, leaves in (("init", init_leaves), ("xs", xs_leaves), ("additional_inputs", additional)):
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"scan({name}): {what} leaf {i} is a {type(leaf).__name__}, not a tensor")
    _check_xs(f"scan({name})", xs_leaves)
    static_length = length
    if xs_leaves and isinstance(xs_leaves[0].shape[0], int):
        static_length = xs_leaves[0].shape[0]
    spec = ScanSpec(len(init_leaves), len(xs_leaves), static_length, reverse, remat)
    if xs_leaves and length is not None and length != xs_leaves[0].shape[0]:
        raise ValueError(f"scan({name}): length={length} but xs have length {xs_leaves[0].shape[0]}")
    # Under Dynamo the code-object rename cannot be traced; hops/_dynamo.py names the
    # subgraph after the step's closure variable fn instead.
    make_step = _make_step if torch.compiler.is_compiling() else _named_step_factories(name)
    lifted: dict[int, int] = {}
    step = make_step(fn, carry_treespec, xs_treespec, len(additional), lifted, name)
    if torch.compiler.is_compiling():
        # Dynamo lifts closures itself; the ys structure comes from one structural call of
        # fn (Dynamo records its ops unused; AOTAutograd prunes them).
        examples = [*init_leaves, *_slice_examples(xs_leaves), *additional]
        ys_treespec = _ys_structure(fn, examples, carry_treespec, xs_treespec, len(additional))
    else:
        with disable_proxy_modes_tracing():
            examples = [*init_leaves, *_slice_examples(xs_leaves), *additional]
        _check_xs(f"scan({name})", xs_leaves)
        closed, ys_treespec = _find_closed_over_tensors(fn, examples, name, carry_treespec, xs_treespec, len(additional))
        if closed:
            # The body reads these from its closure: make them inputs, so they can be traced
            # as placeholders and receive gradients; the step maps them back when it runs.
            lifted = {id(t): i for i, t in enumerate(closed)}
            step = make_step(fn, carry_treespec, xs_treespec, len(additional), lifted, name)
            additional += closed
    if not torch.compiler.is_compiling():
        # Equal keys run the same fn on the same structure: AOTAutograd's two passes over
        # one program then trace this step's joint once (see _trace_step).
        step.hops_trace_key = (fn, carry_treespec, xs_treespec, len(additional_inputs), tuple(sorted(lifted.items())))
    flat = scan_hop(step, *init_leaves, *xs_leaves, *additional, spec)
    carry_out, ys = flat[: len(init_leaves)], flat[len(init_leaves):]
    ys = None if ys_treespec is None else pytree.tree_unflatten(list(ys), ys_treespec)
    return pytree.tree_unflatten(list(carry_out), carry_treespec), ys


def _ys_structure(fn: Callable, leaves: Sequence[Any], carry_treespec: Any, xs_treespec: Any, num_additional: int) -> Any:
    """The pytree structure of ``fn``'s y, from one call on one step's example leaves."""
    num_carry = carry_treespec.num_leaves
    num_xs = 0 if xs_treespec is None else xs_treespec.num_leaves
    carry = pytree.tree_unflatten(list(leaves[:num_carry]), carry_treespec)
    x = None if xs_treespec is None else pytree.tree_unflatten(list(leaves[num_carry : num_carry + num_xs]), xs_treespec)
    result = fn(carry, x, *leaves[num_carry + num_xs : num_carry + num_xs + num_additional])
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"scan({body_name(fn)}): fn must return (new_carry, y), got {type(result).__name__}")
    return None if result[1] is None else pytree.tree_structure(result[1])


def _check_xs(where: str, xs: Sequence[torch.Tensor]) -> None:
    """Every xs leaf has a dim 0, and all have the same length."""
    for i, x in enumerate(xs):
        if x.dim() == 0:
            raise ValueError(f"{where}: xs leaf {i} is a 0-d tensor; xs are sliced along dim 0")
        if x.shape[0] != xs[0].shape[0]:
            raise ValueError(
                f"{where}: xs leaf {i} has length {x.shape[0]} but xs leaf 0 has {xs[0].shape[0]}; "
                "every xs leaf is sliced along dim 0 and needs the same length"
            )


@functools.lru_cache(maxsize=None)
def _named_step_factories(name: str) -> Callable:
    return rename_inner_function(_make_step, "step", name)


def _make_step(
    fn: Callable,
    carry_treespec: Any,
    xs_treespec: Any,
    num_additional_given: int,
    lifted_index: dict[int, int],
    name: str,
) -> Callable:
    """The scan body: ``fn`` on flat leaves, returning flat ``(*new_carry, *ys)``.

    ``lifted_index`` maps ``id`` of a tensor ``fn`` reads from its closure to its position
    among the lifted inputs (after the given additional inputs).
    """
    num_carry = carry_treespec.num_leaves
    num_xs = 0 if xs_treespec is None else xs_treespec.num_leaves

    def step(*leaves: Any) -> tuple[torch.Tensor, ...]:
        carry = pytree.tree_unflatten(list(leaves[:num_carry]), carry_treespec)
        x = None if xs_treespec is None else pytree.tree_unflatten(list(leaves[num_carry : num_carry + num_xs]), xs_treespec)
        extra = leaves[num_carry + num_xs :]
        given, lifted = extra[:num_additional_given], extra[num_additional_given:]
        if lifted_index:
            closed = {key: lifted[position] for key, position in lifted_index.items()}
            with _SubstituteTensors(closed):
                result = fn(carry, x, *given)
        else:
            result = fn(carry, x, *given)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(f"scan({name}): fn must return (new_carry, y), got {type(result).__name__}")
        new_carry, y = result
        carry_leaves, new_treespec = pytree.tree_flatten(new_carry)
        if new_treespec != carry_treespec:
            raise ValueError(
                f"scan({name}): the carry changes structure in one step: {carry_treespec} -> {new_treespec}"
            )
        y_leaves = [] if y is None else pytree.tree_leaves(y)  # y=None: no ys (as in jax)
        # Returning an input unchanged (``return c, x``) is fine in a scan; the region's
        # outputs must not alias its inputs, so such outputs are copies.
        return tuple(
            out.clone() if any(out is leaf for leaf in leaves) else out for out in (*carry_leaves, *y_leaves)
        )

    return step


# --------------------------------------------------------------------------- eager


def _run_steps(body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> tuple[torch.Tensor, ...]:
    carry, xs, additional = _split(inputs, spec)
    name = body_name(body)
    length = _length(xs, spec)
    ys_per_step: list[Any] = [None] * length
    order = range(length - 1, -1, -1) if spec.reverse else range(length)
    for i in order:
        outputs = _check_step(name, body(*carry, *(x[i] for x in xs), *additional), carry)
        carry, ys_per_step[i] = list(outputs[: spec.num_carry]), outputs[spec.num_carry :]
    if length == 0:
        # No step ran: ys' shapes come from the body's metadata.
        with FakeTensorMode(allow_non_fake_inputs=True):
            template = _check_step(name, body(*carry, *_slice_examples(xs), *additional), carry)[spec.num_carry :]
        ys = [torch.empty((0, *y.shape), dtype=y.dtype, device=y.device) for y in template]
    else:
        ys = [torch.stack([step[j] for step in ys_per_step]) for j in range(len(ys_per_step[0]))]
    return (*(c.clone() for c in carry), *ys)


@scan_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *inputs_and_spec: Any):
    *inputs, spec = inputs_and_spec
    return _run_steps(body, inputs, spec)


@scan_hop.py_impl(DispatchKey.XLA)
def _xla(body: Callable, *inputs_and_spec: Any):
    # A Python loop over XLA tensors is traced lazily into ``length`` copies of the body, and
    # XLA's compile time grows with them: run one While, the one lower_to_xla makes.
    from passes.scan_rules import run_scan_on_xla  # passes imports hops: import on first use

    return run_scan_on_xla(body, *inputs_and_spec)


# --------------------------------------------------------------------------- fake


@scan_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *inputs_and_spec: Any):
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    with mode:
        return _fake_outputs(body_name(body), body(*carry, *_slice_examples(xs), *additional), carry, xs, spec)


def _fake_outputs(name: str, step_outputs: Any, carry: Sequence[Any], xs: Sequence[Any], spec: ScanSpec) -> tuple:
    """The scan's outputs from one step's (fake) outputs: the carries, and each y stacked."""
    step_outputs = _check_step(name, step_outputs, carry)
    length = _length(xs, spec)
    return (
        *(c.clone() for c in carry),
        *(y.new_empty((length, *y.shape)) for y in step_outputs[spec.num_carry :]),
    )


# --------------------------------------------------------------------------- functionalize


@scan_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *inputs_and_spec: Any):
    *inputs, spec = inputs_and_spec

    def examples_of(unwrapped: Sequence[Any]) -> tuple:
        carry, xs, additional = _split(unwrapped, spec)
        return (*carry, *_slice_examples(xs), *additional)

    return functionalize_body_call(ctx, scan_hop, body, inputs, (spec,), examples_of)


# --------------------------------------------------------------------------- proxy


@scan_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *inputs_and_spec: Any):
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    with disable_proxy_modes_tracing():
        examples = (*carry, *_slice_examples(xs), *additional)

    def outputs(body_graph: fx.GraphModule) -> tuple:
        # Tracing on fake tensors already computed one step's outputs: stack them instead
        # of running the body once more. (Real-mode make_fx runs the scan.)
        from torch._guards import detect_fake_mode

        (output,) = body_graph.graph.find_nodes(op="output")
        step = [value.meta.get("val") for value in output.args[0]]
        inputs_mode = detect_fake_mode(inputs)
        if inputs_mode is None or not all(isinstance(v, FakeTensor) and v.fake_mode is inputs_mode for v in step):
            return scan_hop(body, *inputs, spec)
        return _fake_outputs(body_name(body), step, carry, xs, spec)

    return emit_body_node(mode, scan_hop, body, examples, (*inputs, spec), outputs)


# --------------------------------------------------------------------------- autograd
#
# One step is a function of (carry, x, additional). Its joint is traced once:
#   joint(*carry, *x, *additional, *cotangents) -> (*new_carry, *y, *grad_carry, *grad_x, *grad_additional)
# and split into a forward step that also returns the residuals the backward reads, and a
# backward step from (residuals, cotangents). The backward scan runs the backward step in
# reverse order; the gradient of the additional inputs is summed in its carry.


def _step_joint(body: Callable, num_inputs: int, num_outputs: int) -> Callable:
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()

    def joint(*primals_and_cotangents: Any) -> tuple[torch.Tensor, ...]:
        primals = [
            p.detach().requires_grad_(p.is_floating_point() or p.is_complex()) for p in primals_and_cotangents[:num_inputs]
        ]
        cotangents = primals_and_cotangents[num_inputs:]
        with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
            outputs = body(*primals)
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        wanted = [p for p in primals if p.requires_grad]
        grads = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        grads_all = [
            (lambda g, p: torch.zeros_like(p) if g is None else g)(next(grads), p) if p.requires_grad else torch.zeros_like(p)
            for p in primals
        ]
        return (*(o.detach() for o in outputs), *grads_all)

    return joint


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _partition(
    joint: fx.GraphModule, num_primals: int, num_outputs: int, invariant: set[int], sliced: set[int]
) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """Split a step's joint graph into forward and backward graphs.

    Backward nodes are those that depend on a cotangent. The forward graph returns the step
    outputs then the residuals (forward values the backward reads); the backward graph
    takes (*residuals, *cotangents, *sliced primals, *invariant primals) and returns one
    gradient per primal. Sliced primals (xs slices) and invariant ones (additional inputs)
    are not saved: the backward scan gets them from the xs and additional inputs.
    Returns (forward, backward, number of residuals).
    """
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals, cotangents = placeholders[:num_primals], placeholders[num_primals:]
    (output,) = joint.graph.find_nodes(op="output")
    results = list(output.args[0])
    step_outputs, grads = results[:num_outputs], results[num_outputs:]
    backward_nodes = set(cotangents)
    for node in joint.graph.nodes:
        if node.op == "call_function" and any(a in backward_nodes for a in node.all_input_nodes):
            backward_nodes.add(node)
    invariant_nodes = {primals[i] for i in invariant}
    sliced_nodes = {primals[i] for i in sliced}
    # Forward values computed from loop-invariant inputs alone are recomputed by the
    # backward step instead of being saved once per step.
    for node in joint.graph.nodes:
        if (
            node.op == "call_function"
            and node not in backward_nodes
            and node.all_input_nodes
            and all(a in invariant_nodes or a.op == "get_attr" for a in node.all_input_nodes)
        ):
            invariant_nodes.add(node)
    residuals: list[fx.Node] = []
    recomputed: set[fx.Node] = set()
    seen: set[fx.Node] = set()

    def needs(value: Any) -> None:
        if (
            isinstance(value, fx.Node)
            and value.op != "get_attr"  # subgraphs are constants, not residuals
            and value not in backward_nodes
            and value not in seen
            and value not in invariant_nodes
            and value not in sliced_nodes
        ):
            seen.add(value)
            if value.op == "call_function" and isinstance(value.meta.get("val"), _SYMBOLIC):
                # A symbolic size cannot be stacked per step: recompute it from what it reads.
                recomputed.add(value)
                for source in value.all_input_nodes:
                    needs(source)
            else:
                residuals.append(value)

    for node in joint.graph.nodes:
        if node in backward_nodes and node.op == "call_function":
            for value in node.all_input_nodes:
                needs(value)
    for value in grads:
        needs(value)

    def copier(graph: fx.Graph, env: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], fx.Node]:
        def lookup(node: fx.Node) -> fx.Node:
            if node not in env and node.op == "get_attr":
                env[node] = graph.get_attr(node.target)
            return env[node]

        return lookup

    forward = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    lookup = copier(forward, env)
    for node in joint.graph.nodes:
        if node.op == "placeholder" and node in primals:
            env[node] = forward.placeholder(node.name)
        elif node.op == "call_function" and node not in backward_nodes:
            env[node] = forward.node_copy(node, lookup)
    def returned(value: fx.Node) -> fx.Node:
        # A body's outputs must not alias its inputs: inputs and views are returned as copies.
        if value.op == "placeholder" or _is_view(value):
            return forward.call_function(torch.ops.aten.clone.default, (env[value],))
        return env[value]

    forward.output(tuple(returned(v) for v in [*step_outputs, *residuals]))

    backward = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    blookup = copier(backward, benv)
    for value in residuals:
        benv[value] = backward.placeholder(f"saved_{value.name}")
    for node in cotangents:
        benv[node] = backward.placeholder(node.name)
    for i in sorted(sliced):
        benv[primals[i]] = backward.placeholder(primals[i].name)
    for i in sorted(invariant):
        benv[primals[i]] = backward.placeholder(primals[i].name)
    for node in joint.graph.nodes:
        if node.op == "call_function" and (node in backward_nodes or node in invariant_nodes or node in recomputed):
            benv[node] = backward.node_copy(node, blookup)
    backward.output(tuple(benv[g] if isinstance(g, fx.Node) else g for g in grads))
    owner = joint
    forward_gm, backward_gm = fx.GraphModule(owner, forward), fx.GraphModule(owner, backward)
    forward_gm.graph.eliminate_dead_code()
    backward_gm.graph.eliminate_dead_code()
    forward_gm.recompile()
    backward_gm.recompile()
    return forward_gm, backward_gm, len(residuals)


def _take(values: Sequence[Any], *counts: int) -> list:
    """``values`` cut into consecutive parts of ``counts``, and the rest."""
    parts, start = [], 0
    for count in counts:
        parts.append(values[start : start + count])
        start += count
    return [*parts, values[start:]]


def _step_outputs(body: Callable, examples: Sequence[Any]) -> list[torch.Tensor]:
    """Fake stand-ins of one step's outputs (for cotangent examples)."""
    from torch._subclasses.fake_tensor import FakeTensor

    with disable_proxy_modes_tracing():
        if any(isinstance(t, FakeTensor) for t in examples):
            return list(body(*examples))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            return list(body(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in examples)))


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        body: Callable,
        spec: ScanSpec,
        forward_body: Callable,
        num_saved: int,
        backward_step_factory: Callable,
        *inputs: torch.Tensor,
    ):
        ctx.backward_step = backward_step_factory
        with torch._C._AutoDispatchBelowAutograd():
            outputs = scan_hop(forward_body, *inputs, spec)
        num_outputs = len(outputs) - num_saved
        ctx.spec, ctx.body, ctx.num_saved = spec, body, num_saved
        ctx.save_for_backward(*inputs, *outputs[num_outputs:])
        ctx.num_inputs = len(inputs)
        return outputs[:num_outputs]

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor):
        spec: ScanSpec = ctx.spec
        saved_values = ctx.saved_tensors
        inputs, stacked = saved_values[: ctx.num_inputs], saved_values[ctx.num_inputs :]
        carry, xs, additional = _split(inputs, spec)
        grad_carry, grad_ys = cotangents[: spec.num_carry], cotangents[spec.num_carry :]
        grad_ys = [torch.zeros_like(g) if g is None else g for g in grad_ys]
        backward_step, step_xs = ctx.backward_step(carry, xs, additional, stacked, grad_ys)
        init = (*grad_carry, *(torch.zeros_like(a) for a in additional))
        # The step calls only traced graphs (the split backward, or the joint under remat),
        # so it needs no live autograd: the proxy rule traces it like any body.
        step_body = known_functional(named(backward_step, f"{body_name(ctx.body)}_bwd"))
        backward_spec = ScanSpec(len(init), len(step_xs), spec.length, not spec.reverse)
        outputs = scan_hop(step_body, *init, *step_xs, *additional, backward_spec)
        grad_init = outputs[: spec.num_carry]
        grad_additional = outputs[spec.num_carry : len(init)]
        grad_xs = outputs[len(init) :]
        grads = [*grad_init, *grad_xs, *grad_additional]
        return (None,) * 5 + tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[5:]))


@dataclasses.dataclass(frozen=True)
class _StepTrace:
    """One step's joint, traced and split: what the forward scan runs and what each
    backward step computes."""

    forward_body: Callable  # (*carry, *x, *additional) -> (*new_carry, *y, *saved)
    num_saved: int
    num_ys: int
    # (saved, x, grad_carry, grad_y, additional) -> (*grad_carry, *grad_x, *grad_additional)
    step_grads: Callable


# fake mode -> {(step, example metadata, spec): _StepTrace}. AOTAutograd runs a function
# twice in one fake mode (metadata, then the joint); the step is traced and split once.
_STEP_TRACES: "weakref.WeakKeyDictionary[Any, dict[tuple, _StepTrace]]" = weakref.WeakKeyDictionary()


def _step_trace_cache(body: Callable, examples: Sequence[Any], spec: ScanSpec) -> tuple[dict | None, tuple | None]:
    """The cache of the fake mode tracing ``examples`` and the key of this step in it, or
    ``(None, None)`` where a trace must not be reused (not tracing, symbolic shapes)."""
    from torch._guards import detect_fake_mode

    metadata = []
    for e in examples:
        if not isinstance(e, torch.Tensor) or not all(isinstance(size, int) for size in e.shape):
            return None, None
        metadata.append((tuple(e.shape), e.dtype, e.device))
    mode = detect_fake_mode(examples)
    if mode is None:
        return None, None
    # ``hops.scan`` makes a new step per call; its key says which (fn, structure) it runs.
    return _STEP_TRACES.setdefault(mode, {}), (getattr(body, "hops_trace_key", body), tuple(metadata), spec)


def _trace_step(body: Callable, examples: Sequence[Any], spec: ScanSpec) -> _StepTrace:
    cache, key = _step_trace_cache(body, examples, spec)
    if cache is not None and key in cache:
        return cache[key]
    name = body_name(body)
    outputs = _step_outputs(body, examples)
    num_outputs = len(outputs)
    num_primals = len(examples)
    num_carry, num_xs = spec.num_carry, spec.num_xs
    invariant = set(range(num_carry + num_xs, num_primals))
    with disable_proxy_modes_tracing():
        joint_examples = (*examples, *(torch.zeros(o.shape, dtype=o.dtype, device=o.device) for o in outputs))
        joint_examples = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in joint_examples)
    try:
        joint = strip_detach(
            materialize_as_graph(_step_joint(body, num_primals, num_outputs), joint_examples, force_enable_grad=True)
        )
    except RuntimeError as e:
        if "in-place operation" not in str(e):
            raise
        # Autograd refuses the write before our check can name it.
        raise ValueError(
            f"{name} mutates its argument in place; a scan body must be functional "
            "(return a new tensor instead of writing into an input)"
        ) from None
    # The user's step is checked once, on its joint; bodies built from the joint are then
    # known to be functional.
    check_body_is_functional(joint, name, num_outputs=num_outputs)

    if spec.remat:
        # Save the carry entering each step; the backward recomputes the step from it.
        def forward_with_carries(*leaves: Any) -> tuple:
            return (*body(*leaves), *(c.clone() for c in leaves[:num_carry]))

        forward_body = known_functional(named(forward_with_carries, name))
        num_saved = num_carry

        def step_grads(saved, x, grad_carry, grad_y, additional_values):
            return joint(*saved, *x, *additional_values, *grad_carry, *grad_y)[num_outputs:]

    else:
        sliced = set(range(num_carry, num_carry + num_xs))
        forward_graph, backward_graph, num_saved = _partition(joint, num_primals, num_outputs, invariant, sliced)
        forward_body = known_functional(named(forward_graph, name))

        def step_grads(saved, x, grad_carry, grad_y, additional_values):
            return backward_graph(*saved, *grad_carry, *grad_y, *x, *additional_values)

    trace = _StepTrace(forward_body, num_saved, num_outputs - num_carry, step_grads)
    if cache is not None:
        cache[key] = trace
    return trace


@scan_hop.py_autograd_impl
def _autograd(body: Callable, *inputs_and_spec: Any):
    *inputs, spec = inputs_and_spec
    carry, xs, additional = _split(inputs, spec)
    with disable_proxy_modes_tracing():
        examples = (*carry, *_slice_examples(xs), *additional)
    trace = _trace_step(body, examples, spec)
    num_carry, num_xs, num_ys, num_saved = spec.num_carry, spec.num_xs, trace.num_ys, trace.num_saved

    def backward_step_factory(carry, xs, additional, stacked, grad_ys):
        """One step of the reverse scan: carries (grad_carry, grad_additional summed so
        far), slices (saved values, x, grad_y), additional inputs."""
        num_additional = len(additional)

        def backward_step(*values: Any) -> tuple:
            grad_carry = values[:num_carry]
            grad_additional = values[num_carry : num_carry + num_additional]
            saved, x, grad_y, additional_values = _take(
                values[num_carry + num_additional :], num_saved, num_xs, num_ys
            )
            grads = trace.step_grads(saved, x, grad_carry, grad_y, additional_values)
            summed = [a + g for a, g in zip(grad_additional, grads[num_carry + num_xs :])]
            # A step's gradient may be its cotangent unchanged (e.g. for c + x): copy it.
            return copy_if_aliases((*grads[:num_carry], *summed, *grads[num_carry : num_carry + num_xs]), values)

        return backward_step, [*stacked, *xs, *grad_ys]

    return _ScanFunction.apply(body, spec, trace.forward_body, num_saved, backward_step_factory, *inputs)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(scan_hop)
