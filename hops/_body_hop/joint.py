"""A body's joint graph, and its split into the graphs a HOP's forward and backward run.

Every HOP with a body differentiates it the same way. Its joint is traced once, where
autograd is live::

    joint(*primals, *cotangents) -> (*outputs, *grads of the primals that need one)

and ``split_joint`` cuts it in two:

- forward: ``(*primals) -> (*outputs, *residuals)``, the nodes the outputs need;
- backward: ``(*primals it may read, *residuals, *cotangents) -> grads``, every other node.

What the backward needs from the forward is read directly where the HOP hands the backward
that primal (``available``), recomputed where that is free or asked for, and saved as a
residual otherwise:

- views and symbolic ints are recomputed from their inputs (a view of a primal saved as a
  residual would alias the region's input; a symbolic int is not a tensor);
- values computed only from ``invariant`` primals (a scan's additional inputs: the same at
  every step) are recomputed rather than saved once per step;
- with ``remat`` every value is recomputed from primals, and a primal the backward is not
  handed (a scan's carry) is saved itself;
- random values are never recomputed: a recomputation would draw new numbers, so they are
  saved whatever the policy (the forward's draws are the ones the backward differentiates).
  Opaque kernel calls are treated the same way (their code may draw numbers).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from hops._body_hop.subgraph import is_view, strip_detach

__all__ = [
    "is_tracing",
    "is_differentiable",
    "joint_function",
    "trace_joint",
    "body_output_examples",
    "SplitJoint",
    "split_joint",
    "trace_graph",
]


def is_tracing(values: Sequence[Any]) -> bool:
    """Whether a tracer records: make_fx / AOTAutograd / export (a proxy, fake or
    functional-tensor mode is active, or the values are fake or functionalized tensors).

    Other dispatch modes (activation checkpointing's, a FLOP counter, a user's mode) are not
    tracers: under them a HOP runs its eager semantics, whose ops those modes then see.
    XLA tensors are functionalized by torch_xla even in eager mode and do not count.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    tracer_modes = (ProxyTorchDispatchMode, FakeTensorMode, FunctionalTensorMode)
    if any(isinstance(mode, tracer_modes) for mode in _get_current_dispatch_mode_stack()):
        return True
    return any(
        isinstance(v, (FakeTensor, FunctionalTensor))
        or (isinstance(v, torch.Tensor) and torch._is_functional_tensor(v) and v.device.type != "xla")
        for v in values
    )


def is_differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def joint_function(body: Callable, needs_grad: Sequence[bool], unconnected: list | None = None) -> Callable:
    """``joint(*primals, *cotangents) -> (*outputs, *grads)``: ``body``'s flat outputs, then
    one gradient per primal with ``needs_grad`` (zeros where no output depends on it; a run
    fills ``unconnected`` with whether that is so, per primal with ``needs_grad``).
    There is one cotangent per differentiable (floating or complex) output, in order.

    The vjp is taken without ``create_graph``: the joint is a trace, not a result anyone
    differentiates. Its graph is run later as ops, and differentiated again (double backward)
    only by tracing that graph's own joint when a caller asks for it. With ``create_graph``,
    every HOP call in a backward (a region's backward nested in this body) would be
    differentiated at once while tracing, i.e. the derivative of each op's derivative taken
    whether or not anyone wants it: ops without a double backward (SDPA on CPU) fail."""
    num_primals = len(needs_grad)

    def joint(*primals_and_cotangents: Any) -> tuple[Any, ...]:
        primals = [
            p.detach().requires_grad_(need) if isinstance(p, torch.Tensor) else p
            for p, need in zip(primals_and_cotangents[:num_primals], needs_grad)
        ]
        cotangents = primals_and_cotangents[num_primals:]
        with torch.enable_grad():
            outputs = pytree.tree_leaves(body(*primals))
        differentiable = [o for o in outputs if is_differentiable(o)]
        pairs = [(o, c) for o, c in zip(differentiable, cotangents) if o.requires_grad]
        wanted = [p for p, need in zip(primals, needs_grad) if need]
        grads = (
            torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        if unconnected is not None:
            unconnected[:] = [g is None for g in grads]
        return (
            *(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs),
            *(torch.zeros_like(p) if g is None else g for g, p in zip(grads, wanted)),
        )

    return joint


def trace_graph(fn: Callable, examples: Sequence[Any], *, enable_grad: bool = False) -> fx.GraphModule:
    """``fn`` traced on ``examples`` into a GraphModule of ATen ops and this package's HOPs:
    inside the current tracer when one records, else on fake copies of ``examples``."""
    from torch._higher_order_ops.utils import materialize_as_graph

    from hops._body_hop.body import distinct_tensors
    from hops._compat import eager_stance

    with eager_stance():
        examples = distinct_tensors(examples)
        return strip_detach(materialize_as_graph(fn, tuple(examples), force_enable_grad=enable_grad))


def trace_joint(
    body: Callable, primals: Sequence[Any], outputs: Sequence[Any], needs_grad: Sequence[bool], unconnected: list | None = None
) -> fx.GraphModule:
    """``body``'s joint traced on fake copies of ``primals``, with a cotangent like each
    differentiable one of ``outputs`` (fake example outputs of ``body``); ``unconnected``
    as ``joint_function`` fills it."""
    from hops._body_hop.body import at_boundary, fake_run_context, inspection_mode, stand_in

    mode = inspection_mode(primals)
    with fake_run_context():
        examples = [stand_in(p, mode) if isinstance(p, torch.Tensor) else p for p in primals]
        # A cotangent reaches the backward as an operand of its HOP: contiguous (``at_boundary``).
        cotangents = list(at_boundary([stand_in(o, mode) for o in outputs if is_differentiable(o)]))
        examples = [p.detach() if isinstance(p, torch.Tensor) else p for p in examples]
    with mode:
        joint = trace_graph(joint_function(body, needs_grad, unconnected), [*examples, *cotangents], enable_grad=True)
        return functional_graph(joint, [*examples, *cotangents])


def _writes(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def functional_graph(gm: fx.GraphModule, examples: Sequence[Any]) -> fx.GraphModule:
    """``gm`` with no in-place op: a body may write into tensors it made (``h = h.clone();
    h[0] = x``), which a graph records as ``copy_`` into a view. Whoever reads a graph as a
    data flow (``split_joint`` keeps the nodes an output depends on) would drop such a
    write, so the graph is traced again through functionalization, which turns each write
    into a new value (``select_scatter``). A graph without in-place ops is returned as is.

    The graph is traced again without grad: it is a joint, a result of differentiation. Traced
    where autograd is live (as inside AOTAutograd's own joint), its HOP calls would go through
    their autograd rules, differentiating the backward regions in it once more."""
    if not any(_writes(node) for node in gm.graph.nodes):
        return gm
    with torch.no_grad():
        return trace_graph(torch.func.functionalize(gm, remove="mutations"), examples)


def trace_connected_joint(
    body: Callable, primals: Sequence[Any], outputs: Sequence[Any], needs_grad: Sequence[bool], keep: Sequence[int] = ()
) -> tuple[fx.GraphModule, list[bool]]:
    """``trace_joint`` for the primals with ``needs_grad`` that some output depends on (and
    those at positions ``keep``), and that narrowed ``needs_grad``: a primal no output
    depends on gets no gradient (None), as in the body's Python, not zeros. An optimizer
    steps a parameter with a zero gradient (momentum, weight decay) but skips one with none."""
    unconnected: list[bool] = []
    joint = trace_joint(body, primals, outputs, needs_grad, unconnected)
    wanted = [i for i, need in enumerate(needs_grad) if need]
    dropped = {i for i, absent in zip(wanted, unconnected) if absent and i not in keep}
    if not dropped:
        return joint, list(needs_grad)
    narrowed = [need and i not in dropped for i, need in enumerate(needs_grad)]
    return trace_joint(body, primals, outputs, narrowed), narrowed


def body_output_examples(body: Callable, inputs: Sequence[Any]) -> list[Any]:
    """Fake stand-ins of ``body``'s flat outputs on ``inputs`` (its ops run on fake copies,
    of its inputs and of the tensors it reads from its closure alike)."""
    from hops._body_hop.body import run_on_stand_ins

    return pytree.tree_leaves(run_on_stand_ins(body, inputs).outputs)


# --------------------------------------------------------------------------- the split


@dataclasses.dataclass(frozen=True)
class SplitJoint:
    """A joint graph cut in two (see the module docstring).

    ``forward(*primals) -> (*outputs, *residuals)``;
    ``backward(*(primals[i] for i in primals_in_backward), *residuals, *cotangents) -> grads``.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_outputs: int
    num_residuals: int
    primals_in_backward: tuple[int, ...]


def _subgraphs(node: fx.Node) -> list[fx.GraphModule]:
    owner = node.graph.owning_module
    modules = []
    for value in node.args:
        if isinstance(value, fx.Node) and value.op == "get_attr" and owner is not None:
            module = getattr(owner, str(value.target), None)
            if isinstance(module, fx.GraphModule):
                modules.append(module)
    return modules


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether running ``node`` again could give other values: a seeded random op, a HOP
    whose body holds one, or an opaque kernel (whose code may draw numbers)."""
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and draws_random_numbers(source)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.HigherOrderOperator):
        if getattr(target, "hops_opaque", False):
            return True
        return any(
            draws_random_numbers(inner)
            for module in _subgraphs(node)
            for inner in module.graph.nodes
            if inner.op == "call_function"
        )
    return False


def split_joint(
    joint: fx.GraphModule,
    num_primals: int,
    num_outputs: int,
    *,
    available: Sequence[int] | None = None,
    invariant: Sequence[int] = (),
    remat: bool = False,
) -> SplitJoint:
    """Cut ``joint`` into forward and backward graphs (see the module docstring).

    ``available``: the primals the HOP hands its backward (default: all); ``invariant``: the
    available primals whose derived values are recomputed instead of saved; ``remat``:
    recompute every value that is not random."""
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals, cotangents = placeholders[:num_primals], placeholders[num_primals:]
    (output_node,) = joint.graph.find_nodes(op="output")
    results = list(output_node.args[0])
    outputs, grads = results[:num_outputs], results[num_outputs:]

    forward_nodes = _forward_nodes(joint, outputs)
    backward_nodes = {
        n for n in joint.graph.nodes if n.op in ("call_function", "get_attr") and n not in forward_nodes
    }
    invariant_nodes = _invariant_nodes(joint, forward_nodes, [primals[i] for i in invariant])

    def recompute(value: fx.Node) -> bool:
        if value.op == "get_attr":
            return True
        if draws_random_numbers(value):
            return False
        return (
            remat
            or value in invariant_nodes
            or is_view(value)
            or not isinstance(value.meta.get("val"), torch.Tensor)
        )

    available_primals = set(range(num_primals) if available is None else available)
    read_primals, residuals, recomputed = _backward_reads(joint, primals, available_primals, backward_nodes, grads, recompute)

    forward = fx.Graph()
    forward_env: dict[fx.Node, Any] = {p: forward.placeholder(p.name) for p in primals}
    _copy_nodes(joint, forward, forward_env, lambda n: n in forward_nodes)
    # A residual may repeat an output: the HOP returns a new tensor for each anyway.
    forward.output(tuple(_fresh_outputs(forward, forward_env, [*outputs, *residuals])))

    backward = fx.Graph()
    primals_in_backward = tuple(i for i, p in enumerate(primals) if p in read_primals)
    backward_env: dict[fx.Node, Any] = {}
    for i in primals_in_backward:
        backward_env[primals[i]] = backward.placeholder(primals[i].name)
    for value in residuals:
        backward_env[value] = restride(backward, backward.placeholder(f"saved_{value.name}"), value.meta.get("val"))
    for node in cotangents:
        backward_env[node] = backward.placeholder(node.name)
    _copy_nodes(joint, backward, backward_env, lambda n: n in backward_nodes or n in recomputed)
    backward.output(tuple(_fresh_outputs(backward, backward_env, grads)))

    forward_gm, backward_gm = fx.GraphModule(joint, forward), fx.GraphModule(joint, backward)
    for gm in (forward_gm, backward_gm):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return SplitJoint(forward_gm, backward_gm, num_outputs, len(residuals), primals_in_backward)


def _forward_nodes(joint: fx.GraphModule, outputs: Sequence[Any]) -> set[fx.Node]:
    """The nodes the forward outputs are computed from (placeholders aside)."""
    forward_nodes: set[fx.Node] = set()
    stack = [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in forward_nodes or node.op == "placeholder":
            continue
        forward_nodes.add(node)
        stack.extend(node.all_input_nodes)
    for node in joint.graph.nodes:
        # An element of a forward node's tuple result (a region's residual) is read in the
        # forward: the tuple itself cannot be saved.
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in forward_nodes:
            forward_nodes.add(node)
    return forward_nodes


def _invariant_nodes(joint: fx.GraphModule, forward_nodes: set[fx.Node], invariant_primals: Sequence[fx.Node]) -> set[fx.Node]:
    """The invariant primals and the forward values computed from them (and constants) alone,
    by ops that draw no random numbers: the backward recomputes them instead of saving them."""
    invariant_nodes = set(invariant_primals)
    for node in joint.graph.nodes:
        if (
            node in forward_nodes
            and node.op == "call_function"
            and node.all_input_nodes
            and not draws_random_numbers(node)
            and all(a in invariant_nodes or a.op == "get_attr" for a in node.all_input_nodes)
        ):
            invariant_nodes.add(node)
    return invariant_nodes


def _backward_reads(
    joint: fx.GraphModule,
    primals: Sequence[fx.Node],
    available_primals: set[int],
    backward_nodes: set[fx.Node],
    grads: Sequence[Any],
    recompute: Callable[[fx.Node], bool],
) -> tuple[set[fx.Node], list[fx.Node], set[fx.Node]]:
    """What the backward reads of the forward: the primals it is handed, the residuals it is
    saved (in graph order; a primal it is not handed is one) and the forward values it
    recomputes."""
    primal_index = {p: i for i, p in enumerate(primals)}
    read_primals: set[fx.Node] = set()
    residuals: list[fx.Node] = []
    recomputed: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    pending = [v for n in backward_nodes for v in n.all_input_nodes] + [g for g in grads if isinstance(g, fx.Node)]
    while pending:
        value = pending.pop()
        if value in seen or value in backward_nodes:
            continue
        seen.add(value)
        if value.op == "placeholder":
            if value in primal_index and primal_index[value] not in available_primals:
                residuals.append(value)  # a primal the backward is not handed: saved itself
            elif value in primal_index:
                read_primals.add(value)
        elif recompute(value):
            recomputed.add(value)
            pending.extend(value.all_input_nodes)
        else:
            residuals.append(value)
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    residuals.sort(key=order.__getitem__)
    return read_primals, residuals, recomputed


def _copy_nodes(joint: fx.GraphModule, graph: fx.Graph, env: dict[fx.Node, Any], keep: Callable[[fx.Node], bool]) -> None:
    """Copy into ``graph`` the ops of ``joint`` that ``keep`` selects, in order."""
    for node in joint.graph.nodes:
        if node.op in ("call_function", "get_attr") and keep(node) and node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])


def _fresh_outputs(graph: fx.Graph, env: dict[fx.Node, Any], values: Sequence[Any]) -> list[Any]:
    """``values`` as outputs: one that is a graph input or a view of one is a copy."""
    out: list[Any] = []
    for value in values:
        mapped = env[value] if isinstance(value, fx.Node) else value
        if isinstance(value, fx.Node) and _aliases_placeholder(value):
            mapped = graph.call_function(torch.ops.aten.clone.default, (mapped,))
        out.append(mapped)
    return out


def restride(graph: fx.Graph, value: fx.Node, traced: Any) -> fx.Node:
    """``value`` (contiguous, as a residual crosses a HOP's boundary: see
    ``hops._body_hop.body.at_boundary``) in ``traced``'s layout, which the backward's ops were traced
    on: an SDPA output saved for backward is permuted, and the ``view`` its backward holds is
    valid on that layout only. A dense permuted layout is made exactly (dims ordered by
    stride, made contiguous, ordered back: one copy); any other is left contiguous."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    if not isinstance(traced, torch.Tensor):
        return value
    # Read as the trace's metadata, not recorded into an enclosing trace (symbolic strides).
    with disable_proxy_modes_tracing():
        if traced.is_contiguous() or not _is_dense(traced):
            return value
        order = sorted(range(traced.dim()), key=lambda d: (-traced.stride(d), d))
        back = sorted(range(traced.dim()), key=order.__getitem__)
    permuted = graph.call_function(torch.ops.aten.permute.default, (value, order))
    packed = graph.call_function(torch.ops.aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
    return graph.call_function(torch.ops.aten.permute.default, (packed, back))


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (a permutation of a
    contiguous layout), sizes-1 dims aside."""
    expected = 1
    for dim in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.size(dim) != 1:
            if t.stride(dim) != expected:
                return False
            expected *= t.size(dim)
    return True


def _aliases_placeholder(value: fx.Node) -> bool:
    while is_view(value):
        value = value.args[0]
    return value.op == "placeholder"
