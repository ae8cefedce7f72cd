"""A traced function run from its cached graphs: one forward call, one backward call.

``split(graph, tensors, ...)`` traces the joint forward-backward graph of ``graph`` (a
``make_fx`` trace) with AOTAutograd, partitions it into a forward graph (outputs, then the
residuals the backward reads) and a backward graph, and returns a ``GraphFunction`` whose
call runs the forward graph once and whose backward runs the backward graph once, through
one ``torch.autograd.Function``: no per-call work proportional to the program beyond
binding tensors.

Residuals are what a call costs per tensor (each is an output of the forward computation, a
tensor the autograd engine saves, an input of the backward computation), so the forward
graph outputs as few as it can: a residual that is a view (a reshape, a transpose, ...) of
an input or of another value is recomputed by the backward graph from that base; a base
that is an input of the call is saved as that tensor (not output again); a residual that
is an output of the call is saved as that output.

Outputs are new tensors: one that is a view of an intermediate is returned as a copy.
``split`` returns None for what it does not run this way (an output that aliases an input):
the caller then uses AOTAutograd's own runtime.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

__all__ = ["GraphFunction", "split"]

Compiler = Callable[[fx.GraphModule, list], Callable]


class GraphFunction:
    """Cached forward and backward graphs of a function of ``tensors`` and how a call runs them.

    ``forward`` takes the call's tensors and returns ``(*outputs, *residuals)``; ``backward``
    takes ``(*residuals, *inputs[saved_inputs], *outputs[saved_outputs], *tangents)`` (one
    tangent per output that requires grad, ``differentiable``) and returns one gradient per
    input (None where an input needs none). Without ``backward`` (no input needs a gradient,
    or grad mode is off) a call runs ``forward`` alone."""

    def __init__(
        self,
        forward: fx.GraphModule,
        backward: fx.GraphModule | None,
        *,
        num_outputs: int,
        saved_inputs: tuple[int, ...] = (),
        saved_outputs: tuple[int, ...] = (),
        differentiable: tuple[bool, ...] = (),
        compiler: Compiler | None = None,
        on_backward_compiled: Callable[[fx.GraphModule], None] | None = None,
    ) -> None:
        self.forward_graph, self.backward_graph = forward, backward
        self.num_outputs = num_outputs
        self.saved_inputs, self.saved_outputs = saved_inputs, saved_outputs
        self.differentiable = differentiable
        self.compiler = compiler
        self.on_backward_compiled = on_backward_compiled
        self._forward: Callable | None = None
        self._backward: Callable | None = None

    @property
    def num_residuals(self) -> int:
        """Tensors the forward graph outputs for the backward graph alone."""
        return len(self.forward_graph.graph.output_node().args[0]) - self.num_outputs

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        if self.backward_graph is None:
            return tuple(self.run_forward(tensors)[: self.num_outputs])
        return _CachedGraphs.apply(self, *tensors)

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> list:
        if self._forward is None:
            self._forward = self._compile(self.forward_graph, tensors)
        return self._forward(list(tensors))

    def run_backward(self, tensors: Sequence[torch.Tensor]) -> list:
        if self._backward is None:
            self._backward = self._compile(self.backward_graph, tensors)
            if self.on_backward_compiled is not None:
                self.on_backward_compiled(self.backward_graph)
        return self._backward(list(tensors))

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.compiler is not None:
            return self.compiler(gm, list(example_inputs))

        def run(args: list) -> list:
            return list(gm(*args))

        return run


class _CachedGraphs(torch.autograd.Function):
    """The forward graph in ``forward``, the backward graph in ``backward``; residuals saved
    with ``save_for_backward`` (so an input modified in place before the backward is
    caught, as in eager)."""

    @staticmethod
    def forward(ctx: Any, graphs: GraphFunction, *tensors: torch.Tensor) -> tuple:
        results = graphs.run_forward(tensors)
        outputs, residuals = results[: graphs.num_outputs], results[graphs.num_outputs :]
        ctx.graphs = graphs
        ctx.save_for_backward(
            *residuals, *(tensors[i] for i in graphs.saved_inputs), *(outputs[i] for i in graphs.saved_outputs)
        )
        frozen = [output for output, grad in zip(outputs, graphs.differentiable) if not grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        graphs: GraphFunction = ctx.graphs
        # The backward graph was traced with contiguous tangents (a view in it may need that).
        tangents = [grad.contiguous() for grad, needed in zip(grads, graphs.differentiable) if needed]
        return (None, *graphs.run_backward([*ctx.saved_tensors, *tangents]))


def split(
    graph: fx.GraphModule,
    tensors: Sequence[torch.Tensor],
    *,
    needs_grad: bool,
    output_requires_grad: Sequence[bool] = (),
    compiler: Compiler | None,
    partition: Callable | None = None,
    on_backward_compiled: Callable[[fx.GraphModule], None] | None = None,
) -> GraphFunction | None:
    """``graph`` (a ``make_fx`` trace of a function of ``tensors``, tensors out) as a
    ``GraphFunction``: its joint graph traced and partitioned by ``partition`` (default:
    AOTAutograd's default partitioner) when ``needs_grad`` (``output_requires_grad``: which
    outputs require grad, as traced), else its inference graph. None when an output aliases
    an input (see the module docstring)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._functorch.partitioners import default_partition

    outputs = list(graph.graph.output_node().args[0])
    copied = _outputs_to_copy(outputs)
    if copied is None:
        return None
    traced = _with_copies(graph, copied) if copied else graph
    try:
        joint = aot_export_joint_simple(traced, tuple(tensors), trace_joint=needs_grad)
    except RuntimeError:  # what it refuses (aliasing it found): AOTAutograd's runtime handles it
        return None
    if not needs_grad:
        return GraphFunction(joint, None, num_outputs=len(outputs), compiler=compiler)
    tangents = [node for node in joint.graph.find_nodes(op="placeholder") if node.name.startswith("tangents")]
    differentiable = tuple(bool(flag) for flag in output_requires_grad)
    if len(differentiable) != len(outputs) or len(tangents) != sum(differentiable):
        return None
    forward, backward = (partition or default_partition)(joint, tuple(tensors), num_fwd_outputs=len(outputs))
    plan = _saved_by_base(forward, backward, len(outputs), len(tangents))
    if plan is None:
        return None
    saved_inputs, saved_outputs = plan
    _stack_residuals(forward, backward, len(outputs))
    return GraphFunction(
        forward,
        backward,
        num_outputs=len(outputs),
        saved_inputs=saved_inputs,
        saved_outputs=saved_outputs,
        differentiable=differentiable,
        compiler=compiler,
        on_backward_compiled=on_backward_compiled,
    )


def _outputs_to_copy(outputs: list) -> set[int] | None:
    """Positions of outputs that are views of an intermediate or repeat an earlier output
    (returned as copies); None if an output is, or is a view of, an input."""
    copied, seen = set(), set()
    for position, output in enumerate(outputs):
        if not isinstance(output, fx.Node):
            return None
        base = _view_base(output, alias_only=True)
        if base.op == "placeholder" or base.op == "get_attr":
            return None
        if base is not output or output in seen:
            copied.add(position)
        seen.add(output)
    return copied


def _with_copies(graph: fx.GraphModule, copied: set[int]) -> Callable:
    def traced(*tensors: torch.Tensor) -> tuple:
        return tuple(
            value.clone() if position in copied else value for position, value in enumerate(graph(*tensors))
        )

    return traced


# Ops that change how a tensor's elements are indexed and nothing else (besides the aliasing
# view ops, found by their schema): recomputing them in the backward costs no arithmetic.
_RESHAPES = frozenset({"aten::_unsafe_view", "aten::reshape", "aten::clone"})


def _view_link(node: fx.Node, *, alias_only: bool) -> fx.Node | None:
    """The tensor ``node`` is a view (or, unless ``alias_only``, a reshape) of, else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:  # one output of a multi-output view op (unbind, split)
        source = node.args[0]
        if isinstance(source, fx.Node) and _view_link(source, alias_only=alias_only) is not None:
            return source
        return None
    if not isinstance(node.target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    schema = node.target._schema
    aliasing = bool(schema.arguments) and schema.arguments[0].alias_info is not None
    if aliasing and schema.arguments[0].alias_info.is_write:
        return None
    if not aliasing and (alias_only or schema.name not in _RESHAPES):
        return None
    other_tensors = [
        arg for arg in (*node.args[1:], *node.kwargs.values()) if isinstance(arg, (fx.Node, list, tuple)) and _has_node(arg)
    ]
    return None if other_tensors else node.args[0]


def _has_node(value: Any) -> bool:
    if isinstance(value, fx.Node):
        return True
    return isinstance(value, (list, tuple)) and any(_has_node(v) for v in value)


def _view_base(node: fx.Node, *, alias_only: bool = False) -> fx.Node:
    while (source := _view_link(node, alias_only=alias_only)) is not None:
        node = source
    return node


def _saved_by_base(
    forward: fx.GraphModule, backward: fx.GraphModule, num_outputs: int, num_tangents: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Rewrite the partitioned graphs so the backward recomputes each saved view from its
    base and the forward outputs only the bases that are neither inputs nor outputs.
    Returns the positions of the inputs and of the outputs the backward reads (after the
    residuals), or None if the graphs do not have the expected form."""
    forward_outputs = list(forward.graph.output_node().args[0])
    outputs, saved = forward_outputs[:num_outputs], forward_outputs[num_outputs:]
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(saved) + num_tangents:
        return None
    saved_placeholders, tangents = placeholders[: len(saved)], placeholders[len(saved) :]
    if [p.name for p in saved_placeholders] != [getattr(s, "name", None) for s in saved]:
        return None
    forward_inputs = list(forward.graph.find_nodes(op="placeholder"))
    output_positions: dict[fx.Node, int] = {}
    for position, output in enumerate(outputs):
        output_positions.setdefault(output, position)

    graph = backward.graph
    first_computation = next((n for n in graph.nodes if n.op != "placeholder"), None)
    by_name = {p.name: p for p in saved_placeholders}
    base_placeholders: dict[fx.Node, fx.Node] = {}  # forward base -> backward placeholder

    def placeholder_for(base: fx.Node) -> fx.Node:
        if base not in base_placeholders:
            existing = by_name.get(base.name)
            if existing is None:
                with graph.inserting_before(first_computation):
                    existing = graph.placeholder(base.name)
                existing.meta = dict(base.meta)
            base_placeholders[base] = existing
        return base_placeholders[base]

    recomputed: dict[fx.Node, fx.Node] = {}
    for value, placeholder in zip(saved, saved_placeholders):
        chain = [value]
        while (source := _view_link(chain[-1], alias_only=False)) is not None:
            chain.append(source)
        base = chain.pop()
        if not chain:
            placeholder_for(base)
            continue
        environment = {base: placeholder_for(base), **recomputed}
        with graph.inserting_before(first_computation):
            for link in reversed(chain):
                if link not in environment:
                    environment[link] = graph.node_copy(link, environment.__getitem__)
                    recomputed[link] = environment[link]
        placeholder.replace_all_uses_with(environment[value])
        if placeholder not in base_placeholders.values():
            graph.erase_node(placeholder)

    residuals, saved_inputs, saved_outputs = [], [], []
    for base in base_placeholders:
        if base.op == "placeholder":
            saved_inputs.append(base)
        elif base in output_positions:
            saved_outputs.append(base)
        else:
            residuals.append(base)
    order = [*residuals, *saved_inputs, *saved_outputs]
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for base in order:
        anchor.prepend(base_placeholders[base])
    for tangent in tangents:
        anchor.prepend(tangent)
    graph.lint()
    backward.recompile()

    forward.graph.output_node().args = ((*outputs, *residuals),)
    forward.graph.eliminate_dead_code()
    forward.graph.lint()
    forward.recompile()
    return (
        tuple(forward_inputs.index(base) for base in saved_inputs),
        tuple(output_positions[base] for base in saved_outputs),
    )



def _provenance(forward: fx.GraphModule) -> dict[fx.Node, int]:
    """An id per forward node, equal for nodes computed by the same ops from values of the
    same provenance, back to the inputs (by shape and dtype) or to the nearest value whose
    sharding the program states (a sharding annotation, a ``local_map`` region)."""
    from hops.specs import LocalMapSpec, ShardingSpec

    ids: dict[Any, int] = {}
    provenance: dict[fx.Node, int] = {}

    def literal(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ("node", provenance[value])
        if isinstance(value, (list, tuple)):
            return tuple(literal(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, literal(v)) for k, v in value.items()))
        try:
            hash(value)
        except TypeError:
            return repr(value)
        return value

    for node in forward.graph.nodes:
        value = node.meta.get("val")
        described = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
        if node.op == "placeholder":
            key: Any = ("input", described)
        elif any(isinstance(arg, (ShardingSpec, LocalMapSpec)) for arg in node.args):
            # The program fixes this value's layout: what computed it does not matter.
            key = ("stated", node.target, described, tuple(a for a in node.args if not isinstance(a, fx.Node)))
        elif node.op in ("call_function", "call_method", "call_module", "get_attr"):
            key = (node.op, node.target, described, literal(node.args), literal(node.kwargs))
        else:
            continue
        provenance[node] = ids.setdefault(key, len(ids))
    return provenance


def _stack_residuals(forward: fx.GraphModule, backward: fx.GraphModule, num_outputs: int) -> None:
    """Residuals of one provenance (``_provenance``: the same shape, dtype and computation,
    hence the same layout, such as the same activation in each repeated layer) returned as
    one stacked tensor, unstacked by the backward graph. Each residual is a tensor a call
    binds and the autograd engine saves; a stack of them is one. Residuals of different
    provenance are never stacked together: under SPMD they may have different shardings,
    and stacking them would make XLA reshard one."""
    forward_outputs = list(forward.graph.output_node().args[0])
    outputs, residuals = forward_outputs[:num_outputs], forward_outputs[num_outputs:]
    residual_placeholders = list(backward.graph.find_nodes(op="placeholder"))[: len(residuals)]
    provenance = _provenance(forward)
    groups: dict[int, list[int]] = {}
    for position, residual in enumerate(residuals):
        groups.setdefault(provenance[residual], []).append(position)
    stacked = [group for group in groups.values() if len(group) > 1]
    if not stacked:
        return
    single = [group[0] for group in groups.values() if len(group) == 1]

    output_node = forward.graph.output_node()
    with forward.graph.inserting_before(output_node):
        stacks = [
            forward.graph.call_function(torch.ops.aten.stack.default, ([residuals[i] for i in group],))
            for group in stacked
        ]
    output_node.args = ((*outputs, *stacks, *(residuals[i] for i in single)),)
    forward.graph.lint()
    forward.recompile()

    graph = backward.graph
    first_computation = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(residual_placeholders[0]):
        stack_placeholders = [graph.placeholder(f"stacked_{stack.name}") for stack in stacks]
    for stack, group in zip(stack_placeholders, stacked):
        with graph.inserting_before(first_computation):
            parts = graph.call_function(torch.ops.aten.unbind.int, (stack, 0))
            for slot, position in enumerate(group):
                part = graph.call_function(operator.getitem, (parts, slot))
                residual_placeholders[position].replace_all_uses_with(part)
                graph.erase_node(residual_placeholders[position])
    graph.lint()
    backward.recompile()
