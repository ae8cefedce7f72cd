"""Target ``"xla"``: this package's HOPs rewritten into what torch_xla runs.

One rule per HOP. The lowered GraphModule runs on XLA tensors under SPMD, where each op
emits its custom call and XLA's partitioner (GSPMD) distributes the program; on other
devices the ops are identities, so the graph still runs (e.g. for testing):

- an annotation becomes ``hops_xla.sharding_constraint`` (a ``Sharding`` custom call);
- a ``local_map`` region becomes a manual-sharding region: ``hops_xla.enter_manual`` per
  input (``SPMDFullToShardShape``), its body (a subgraph, lowered in turn), and
  ``hops_xla.exit_manual`` per output (pending reductions all-reduced,
  ``SPMDShardToFullShape``);
- a scan becomes ``run_scan`` (one XLA ``While`` whose body holds the lowered body);
- a named scope becomes ``run_in_named_scope`` (its body inside torch_xla's op-name scope,
  so its HLO ops carry ``op_name="<name>.<n>/..."``);
- a kernel call becomes a call of the kernel's op (its ``xla=`` implementation on XLA
  tensors); einsum becomes ``aten.einsum``, one ``dot`` that keeps batch dims.

Besides the HOPs, every tensor constant of the graph and of every body (a ``get_attr`` of a
tensor: what tracing makes of ``torch.tensor([...], device=x.device)``, traced on the host)
is moved to the device the graph runs on (``on_graph_device``, the first of its inputs not on
the host): the host constants a traced program holds would otherwise meet XLA tensors (an
operand of a scan's ``While`` must be one). Staged (a scan's step, ``backend="hops_xla"``),
the move is a literal of the computation, not a transfer (``staging.py``).

Each rule checks the node before rewriting it: a spec of the wrong type, operands that do
not match it, a ``Shard(d)`` out of an operand's rank (where the graph records shapes), a
mesh that is not this process's XLA devices (where torch_xla is loaded) are a
``PassError`` naming the node.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.lowering import run_scan_steps, scan_length, split_scan_operands
from hops.named_scope import ScopeSpec, named_scope_hop, run_in_scope
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import Mesh, ShardingSpec
from passes._infra import (
    PassError,
    body_attr,
    body_module,
    graph_modules,
    leaf_call,
    register_rule,
    replace_tuple_output,
    runner_spec,
    typed_spec,
)
from passes.inline import call_kernel_op, einsum_linear_to_aten, einsum_to_aten, region_operands
from passes.xla import ops
from passes.xla.while_loop import xla_while

TARGET = "xla"


def check_mesh_fits_xla(mesh: Mesh, what: str) -> None:
    """``PassError`` unless ``mesh``'s device ids are the XLA devices of this process. Only
    where torch_xla is loaded: a graph may be lowered on one machine and run on another."""
    if "torch_xla" not in sys.modules:
        return  # checked where the lowered graph first runs (``ops.xla_mesh``)
    problem = mesh.xla_mismatch()
    if problem is not None:
        raise PassError(f"{what}: {problem}")


def _spec_text(node: fx.Node) -> str:
    spec = typed_spec(node, TARGET, ShardingSpec)
    for what, layout in (("its value", spec.layout), ("its gradient", spec.grad.layout)):
        if layout.has_partial:
            raise PassError(
                f"lower_to_xla: {node.format_node()}: {spec!r} lays out {what} with a Partial placement; "
                "an XLA sharding describes a whole value, so a sharding annotation cannot be Partial"
            )
    example = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if isinstance(example, torch.Tensor):
        try:
            spec.check_tensor(example.dim(), "its spec")
            spec.grad.check_tensor(example.dim(), "its gradient spec")
        except ValueError as error:
            raise PassError(f"lower_to_xla: {node.format_node()}: {error}") from None
    check_mesh_fits_xla(spec.mesh, f"lower_to_xla: {node.format_node()}")
    return repr(spec)


@register_rule(TARGET, sharding_annotation_hop)
def lower_sharding_annotation(node: fx.Node) -> None:
    text = _spec_text(node)
    # Rewriting the node in place keeps its name and stack trace.
    node.target = ops.sharding_constraint
    node.args = (node.args[0], text)


@register_rule(TARGET, local_map_hop)
def lower_local_map(node: fx.Node) -> None:
    """A manual-sharding region: enter each input per its placements, run the body on local
    tensors (the body stays a subgraph, lowered already), leave each output per its placements."""
    operands, spec = region_operands(node, TARGET)
    body = body_module(node)
    check_mesh_fits_xla(spec.mesh, f"lower_to_xla: {node.format_node()}")
    graph = node.graph
    with graph.inserting_before(node):
        local_inputs = [
            value if placements is None
            else graph.call_function(ops.enter_manual, (value, repr(ShardingSpec(spec.mesh, placements))))
            for value, placements in zip(operands, spec.in_placements)
        ]
        local_outputs = graph.call_module(body_attr(node).target, tuple(local_inputs))
        outputs = [
            graph.call_function(
                ops.exit_manual,
                (graph.call_function(operator.getitem, (local_outputs, j)), repr(ShardingSpec(spec.mesh, placements))),
            )
            for j, placements in enumerate(spec.out_placements)
        ]
    del body
    replace_tuple_output(node, outputs)


@leaf_call
def run_scan(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """The lowered scan: one XLA ``While`` on XLA tensors, a Python loop elsewhere."""
    *inputs, spec = inputs_and_spec
    runner_spec("run_scan", spec, ScanSpec)
    carry, xs, additional = split_scan_operands(inputs, spec)
    if not any(t.device.type == "xla" for t in inputs if isinstance(t, torch.Tensor)):
        return run_scan_steps(body, inputs, spec)
    return xla_while(body, carry, xs, additional, length=scan_length(xs, spec), reverse=spec.reverse, unroll=spec.unroll or 1)


@register_rule(TARGET, scan_hop)
def lower_scan(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScanSpec)
    body_module(node)
    node.target = run_scan  # same args; the body subgraph is lowered already


@leaf_call
def run_in_named_scope(body: Callable, *inputs_and_spec: Any) -> Any:
    """``body(*inputs)`` inside the op-name scope ``spec.name`` (on XLA tensors; elsewhere
    just the body): what a lowered named scope calls."""
    *inputs, spec = inputs_and_spec
    runner_spec("run_in_named_scope", spec, ScopeSpec)
    return run_in_scope(body, inputs, spec)


@register_rule(TARGET, named_scope_hop)
def lower_named_scope(node: fx.Node) -> None:
    """The body stays a subgraph (lowered already) and runs inside torch_xla's op-name scope."""
    typed_spec(node, TARGET, ScopeSpec)
    body_module(node)
    node.target = run_in_named_scope


register_rule(TARGET, Kernel)(lambda node: call_kernel_op(node, TARGET))
register_rule(TARGET, einsum_kernel)(lambda node: einsum_to_aten(node, TARGET))
register_rule(TARGET, einsum_linear_kernel)(lambda node: einsum_linear_to_aten(node, TARGET))


@leaf_call
def graph_device(*inputs: Any) -> torch.device | None:
    """The device a lowered graph runs on: that of its first tensor input not on the host,
    else of its first tensor input; ``None`` without tensor inputs."""
    devices = [t.device for t in inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)


@leaf_call
def on_graph_device(constant: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A tensor constant of a lowered graph on the device the graph runs on."""
    if device is None or constant.device == device:
        return constant
    # The copy a traced ``.to(device)`` is (``Tensor.to`` may reach a dispatch mode as
    # ``aten.to``): staging writes a small host value copied so as a literal (``staging.py``).
    return torch.ops.aten._to_copy.default(constant, device=device)


def _graph_device_node(graph: fx.Graph, placeholders: list[fx.Node]) -> fx.Node:
    """The node of ``graph`` giving the device it runs on (``graph_device`` of its inputs),
    made after its inputs if the graph has none yet: one per graph, whichever rewrite asks."""
    device = next(iter(graph.find_nodes(op="call_function", target=graph_device)), None)
    if device is None:
        with graph.inserting_after(placeholders[-1]):
            device = graph.call_function(graph_device, tuple(placeholders))
    return device


def constants_to_graph_device(gm: fx.GraphModule) -> bool:
    """Move every tensor constant of ``gm`` and of its bodies to the device each graph runs on
    (``on_graph_device`` after each ``get_attr`` of a tensor); whether any graph changed. A
    graph without tensor inputs keeps its constants (nothing says where it runs)."""
    changed = False
    for module in graph_modules(gm):
        graph = module.graph
        constants = [
            node
            for node in graph.find_nodes(op="get_attr")
            if isinstance(_attribute(module, node.target), torch.Tensor)
            and not any(user.target is on_graph_device for user in node.users)  # lowered already
        ]
        placeholders = list(graph.find_nodes(op="placeholder"))
        if not constants or not placeholders:
            continue
        device = _graph_device_node(graph, placeholders)
        anchor = device
        for node in constants:
            anchor.append(node)  # a get_attr reads no value: it may stand anywhere before its users
            anchor = node
            # Traced graphs copy a constant before use (``lift_fresh_copy``): the copy is made on
            # the host (torch_xla has no such op: it would run on the CPU, a read back), then moved.
            copies = [user for user in node.users if user.target is torch.ops.aten.lift_fresh_copy.default]
            values = copies + ([node] if len(copies) < len(node.users) else [])
            for value in values:
                if value is not node:
                    anchor.append(value)
                    anchor = value
                with graph.inserting_after(value):
                    moved = graph.call_function(on_graph_device, (value, device))
                value.replace_all_uses_with(moved, delete_user_cb=lambda user, moved=moved, copies=copies: user is not moved and user not in copies)
                anchor = moved
        graph.lint()
        module.recompile()
        changed = True
    return changed


def _names_the_host(node: fx.Node) -> bool:
    """An ATen op the trace recorded with ``device=cpu``: the tracing host's device, not a
    choice of the program. A graph traced on CPU says so wherever the program named a device
    relative to its values: factory ops (``torch.zeros(n, device=x.device)``: masks, positions;
    sizes may be symbolic nodes), copies (``t.to(x.device)``: ``_to_copy``) and the metadata
    checks ``torch.export`` records for them (``_assert_tensor_metadata``). A graph lowered for
    XLA runs on XLA, where ``cpu`` would move values back to the host or fail the check."""
    device = node.kwargs.get("device")
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and isinstance(device, torch.device)
        and device.type == "cpu"
    )


def host_device_to_graph_device(gm: fx.GraphModule) -> bool:
    """Make every op of ``gm`` and its bodies that names the tracing host's device
    (``_names_the_host``: a factory op, a copy, a metadata assertion) name the device each graph
    runs on, read at run time (``graph_device``). Whether any graph changed."""
    changed = False
    for module in graph_modules(gm):
        graph = module.graph
        on_the_host = [node for node in graph.nodes if _names_the_host(node)]
        placeholders = list(graph.find_nodes(op="placeholder"))
        if not on_the_host or not placeholders:
            continue
        device = _graph_device_node(graph, placeholders)
        for node in on_the_host:
            node.update_kwarg("device", device)
        graph.lint()
        module.recompile()
        changed = True
    return changed


def _attribute(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for name in target.split("."):
        value = getattr(value, name, None)
    return value
