"""The joint graph of a region body and its split into a forward and a backward graph.

A HOP whose backward is a second region (``named_scope``) traces its body's joint once,
where autograd is live::

    joint(*primals, *cotangents) -> (*outputs, *grads of the primals that need them)

and splits it so that no forward work is repeated in the backward:
- forward: the nodes the outputs need; it returns the outputs, then the residuals (forward
  values the backward reads);
- backward: every other node; it takes the primals it reads, the residuals and the
  cotangents, and returns the gradients.
Values that are cheap to recompute and must not cross the boundary are recomputed in the
backward instead of saved: symbolic ints (a HOP returns tensors) and views (a view of a
primal returned by the forward region would alias the region's input).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._higher_order_ops.utils import materialize_as_graph
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from hops._subgraph import _is_view, strip_detach


def is_tracing(values: Sequence[Any]) -> bool:
    """Whether a tracer (make_fx, AOTAutograd, export) is recording: a dispatch mode is
    active, or the values are fake or functionalized tensors (``torch.func.functionalize``;
    not XLA tensors, which torch_xla wraps for functionalization even in eager mode)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return bool(_get_current_dispatch_mode_stack()) or any(
        isinstance(v, (FakeTensor, FunctionalTensor))  # AOTAutograd's functional tensors
        or (isinstance(v, torch.Tensor) and torch._is_functional_tensor(v) and v.device.type != "xla")
        for v in values
    )


def _joint_function(body: Callable, needs_grad: Sequence[bool]) -> Callable:
    num_primals = len(needs_grad)

    def joint(*primals_and_cotangents: Any) -> tuple[Any, ...]:
        primals = [
            p.detach().requires_grad_(need) if isinstance(p, torch.Tensor) else p
            for p, need in zip(primals_and_cotangents[:num_primals], needs_grad)
        ]
        cotangents = primals_and_cotangents[num_primals:]
        with torch.enable_grad():
            result = body(*primals)
        outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        wanted = [p for p, need in zip(primals, needs_grad) if need]
        grads = (
            torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        return (
            *(o.detach() for o in outputs),
            *(torch.zeros_like(p) if g is None else g for g, p in zip(grads, wanted)),
        )

    return joint


def trace_joint(
    body: Callable, primals: Sequence[Any], cotangents: Sequence[torch.Tensor], needs_grad: Sequence[bool]
) -> fx.GraphModule:
    """Trace ``body``'s joint on ``primals`` and example ``cotangents`` (one per output)."""
    with disable_proxy_modes_tracing():
        examples = tuple(p.detach() if isinstance(p, torch.Tensor) else p for p in (*primals, *cotangents))
    return strip_detach(materialize_as_graph(_joint_function(body, needs_grad), examples, force_enable_grad=True))


@dataclasses.dataclass
class SplitJoint:
    """A joint graph split in two. ``forward(*primals) -> (*outputs, *residuals)`` (an output
    the backward reads is returned again as a residual: AOTAutograd then saves the region's
    result without adding ``detach`` nodes);
    ``backward(*(primals[i] for i in primals_for_backward), *residuals, *cotangents) -> grads``."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_outputs: int
    primals_for_backward: tuple[int, ...]


def _aliases_placeholder(value: fx.Node) -> bool:
    while _is_view(value):
        value = value.args[0]
    return value.op == "placeholder"


def split_joint(joint: fx.GraphModule, num_primals: int, num_outputs: int) -> SplitJoint:
    """Split a joint graph (see the module docstring) into forward and backward graphs."""
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals, cotangents = placeholders[:num_primals], placeholders[num_primals:]
    (output_node,) = joint.graph.find_nodes(op="output")
    results = list(output_node.args[0])
    outputs, grads = results[:num_outputs], results[num_outputs:]

    # Forward: what the outputs need. Everything else runs in the backward.
    forward_nodes: set[fx.Node] = set()
    stack = [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in forward_nodes or node.op == "placeholder":
            continue
        forward_nodes.add(node)
        stack.extend(node.all_input_nodes)
    backward_nodes = {n for n in joint.graph.nodes if n.op in ("call_function", "get_attr") and n not in forward_nodes}

    # What the backward reads from the forward: primals as they are, symbolic ints and views
    # recomputed, every other value saved as a residual.
    primal_needed: set[fx.Node] = set()
    residuals: list[fx.Node] = []
    recomputed: set[fx.Node] = set()
    pending = [v for n in backward_nodes for v in n.all_input_nodes] + [g for g in grads if isinstance(g, fx.Node)]
    while pending:
        value = pending.pop()
        if value in backward_nodes or value in recomputed or value in residuals or value in primal_needed:
            continue
        if value.op == "placeholder":
            primal_needed.add(value)
        elif value.op == "get_attr" or _is_view(value) or not isinstance(value.meta.get("val"), torch.Tensor):
            recomputed.add(value)
            pending.extend(value.all_input_nodes)
        else:
            residuals.append(value)
    residuals.sort(key=list(joint.graph.nodes).index)

    def copy_into(graph: fx.Graph, env: dict[fx.Node, Any], keep: Callable[[fx.Node], bool]) -> None:
        for node in joint.graph.nodes:
            if node.op in ("call_function", "get_attr") and keep(node) and node not in env:
                env[node] = graph.node_copy(node, lambda n: env[n])

    def fresh(graph: fx.Graph, env: dict[fx.Node, Any], value: Any) -> Any:
        # A region's outputs must not alias its inputs: such values leave as copies.
        if isinstance(value, fx.Node) and _aliases_placeholder(value):
            return graph.call_function(torch.ops.aten.clone.default, (env[value],))
        return env[value] if isinstance(value, fx.Node) else value

    forward = fx.Graph()
    forward_env: dict[fx.Node, Any] = {p: forward.placeholder(p.name) for p in primals}
    copy_into(forward, forward_env, lambda n: n in forward_nodes)
    forward.output(tuple(forward_env[v] if isinstance(v, fx.Node) else v for v in (*outputs, *residuals)))

    backward = fx.Graph()
    primals_for_backward = tuple(i for i, p in enumerate(primals) if p in primal_needed)
    backward_env: dict[fx.Node, Any] = {}
    for i in primals_for_backward:
        backward_env[primals[i]] = backward.placeholder(primals[i].name)
    for value in residuals:
        backward_env[value] = backward.placeholder(f"saved_{value.name}")
    for node in cotangents:
        backward_env[node] = backward.placeholder(node.name)
    copy_into(backward, backward_env, lambda n: n in backward_nodes or n in recomputed)
    backward.output(tuple(fresh(backward, backward_env, g) for g in grads))

    forward_gm, backward_gm = fx.GraphModule(joint, forward), fx.GraphModule(joint, backward)
    for gm in (forward_gm, backward_gm):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return SplitJoint(forward_gm, backward_gm, num_outputs, primals_for_backward)
