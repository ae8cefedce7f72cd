"""Target ``"dtensor"``: this package's HOPs rewritten into what DTensor runs on real processes.

Outside ``local_map`` region bodies a lowered graph computes on DTensors; a region body
computes on this rank's plain local tensors. One rule per HOP:

- an annotation becomes ``annotate_on_dtensors`` (a redistribute to its placements, its
  gradient to its gradient placements); inside a region body, where values are local, it is
  the identity (a layout of a local tensor means nothing);
- a ``local_map`` region becomes ``enter_region`` per input, its body (lowered in turn)
  copied in on the local tensors, ``exit_region`` per output; a region inside a region
  body is refused;
- a scan becomes ``run_scan_on_dtensors``: a Python loop over steps whose body is the lowered
  step. DTensor has no control-flow rules (no ``while_loop``/``scan`` sharding propagation),
  so the loop runs in Python, each step as DTensor ops on ``xs[i]``, the per-step outputs
  stacked; it is differentiated by autograd like any Python loop;
- a named scope is inlined (with ``record_scopes=True``, ``run_in_profiler_scope`` runs its
  body under ``torch.profiler.record_function(name)``);
- a kernel runs on local tensors only: inside a region body it becomes a call of its
  ``torch.library`` op; outside one it is refused (a kernel's implementation sees whole
  plain tensors, not shards); einsum becomes ``aten.einsum`` anywhere (DTensor has rules).

An ATen op outside region bodies for which DTensor's sharding propagator has no strategy
(``passes.solver._dtensor.rule_of``: what the solver prices as run replicated and lists in
``stats["unsupported_ops"]``, e.g. CPU flash attention and its backward) becomes
``run_replicated``: inputs gathered to ``Replicate``, the op on local tensors, outputs
replicated DTensors. One that takes tensors and returns none (an assertion such as
``torch.export``'s ``_assert_tensor_metadata``) becomes ``check_on_dtensors``: it checks the
DTensor's global metadata, or its gathered value. An in-place op without a strategy is
refused (it would update a copy).
A tensor made there from no tensor (a tensor constant, a factory op such as ``arange``) is
taken as a replicated DTensor (``replicated``): every rank computes it whole.

Every spec's mesh must be the lowering's DeviceMesh (shape, axis names, ranks): else a
``PassError`` naming the node.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
import torch.fx as fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.lowering import DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT, DTENSOR_RUNS_FILL_SCALAR
from hops.named_scope import ScopeSpec, named_scope_hop
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import Mesh, ShardingSpec
from passes._infra import (
    PassError,
    body_module,
    body_modules,
    copy_body_into,
    graph_modules,
    register_rule,
    replace_tuple_output,
    typed_spec,
)
from passes.dtensor.runtime import (
    annotate_on_dtensors,
    check_on_dtensors,
    enter_region,
    exit_region,
    register_device_mesh,
    replicated,
    run_by_inplace_rule,
    run_in_profiler_scope,
    run_replicated,
    run_scan_on_dtensors,
    run_with_replicated_parameters,
)
from passes.inline import call_kernel_op, einsum_linear_to_aten, einsum_to_aten, region_operands
from passes.solver._dtensor import rule_of

TARGET = "dtensor"

# What the running lowering knows about the graph it walks: the ids of GraphModules that
# run on local tensors (region bodies and everything nested in them), and its DeviceMesh.
_LOWERING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hops_dtensor_lowering", default=None)


def local_bodies(gm: fx.GraphModule) -> set[int]:
    """Ids of the GraphModules in ``gm`` that compute on local tensors: the body of every
    ``local_map`` node, and every graph nested in one (found from node args only)."""
    local: set[int] = set()
    for module in graph_modules(gm):
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is local_map_hop:
                local.update(id(m) for body in body_modules(node) for m in graph_modules(body))
    return local


def _without_rule(op: torch._ops.OpOverload) -> Any:
    """How ``op`` runs when DTensor cannot run it as is and it takes tensors: ``run_replicated``
    when it computes tensors, ``check_on_dtensors`` when it returns nothing (an assertion);
    else ``None`` (DTensor runs it, or answers it itself: ``sym_size``, ``_local_scalar_dense``).
    DTensor cannot run as is: an op without a strategy; a functional op the solver places by
    its in-place variant's rule (``rule_of``) where DTensor does not run it so (torch 2.9:
    ``fill.Scalar``), run as that variant on a copy (``run_by_inplace_rule``); a norm's backward
    DTensor runs on its parameters as they arrive (torch 2.9), run with them replicated
    (``run_with_replicated_parameters``)."""
    schema = op._schema
    rule = rule_of(op)
    if rule is not None and rule is not op and not DTENSOR_RUNS_FILL_SCALAR:
        return run_by_inplace_rule
    if str(op) in DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT:
        return run_with_replicated_parameters
    if rule is not None or not any("Tensor" in str(a.type) for a in schema.arguments):
        return None
    if any("Tensor" in str(r.type) for r in schema.returns):
        return run_replicated
    return check_on_dtensors if not schema.returns else None


def run_ops_without_rules_replicated(gm: fx.GraphModule, local: set[int]) -> bool:
    """Rewrite every ATen op DTensor has no strategy for, in the graphs of ``gm`` that compute
    on DTensors (not in ``local``), into ``run_replicated(op, ...)`` or, for one returning
    nothing, ``check_on_dtensors(op, ...)`` (``_without_rule``); whether any was."""
    changed = False
    for module in graph_modules(gm):
        if id(module) in local:
            continue
        found = False
        for node in list(module.graph.nodes):
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            runner = _without_rule(node.target)
            if runner is None:
                continue
            if node.target._schema.is_mutable:
                raise PassError(
                    f"lower_to_dtensor: {node.format_node()}: DTensor has no sharding strategy for the in-place "
                    f"op {node.target}; run on gathered copies it would not update its DTensor inputs"
                )
            node.args = (rule_of(node.target) if runner is run_by_inplace_rule else node.target, *node.args)
            node.target = runner  # in place: the node keeps its name, kwargs and users
            found = True
        if found:
            module.graph.lint()
            module.recompile()
            changed = True
    return changed


def _makes_plain_tensor(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` makes a tensor from no tensor: a tensor constant (``get_attr``) or an
    ATen factory op (``arange``, ``full``, ``scalar_tensor``: no tensor argument, one tensor
    result). Read from the graph and the ops' schemas only, never from ``meta``."""
    if node.op == "get_attr":
        value = module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return isinstance(value, torch.Tensor)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    returns = [str(r.type) for r in schema.returns]
    return returns == ["Tensor"] and not any("Tensor" in str(a.type) for a in schema.arguments)


def replicate_plain_tensors(gm: fx.GraphModule, local: set[int], mesh: Mesh) -> bool:
    """In the graphs of ``gm`` that compute on DTensors (not in ``local``), every tensor made
    from no tensor (``_makes_plain_tensor``: the same on every rank) is taken as a replicated
    DTensor (``replicated``) before its users see it: DTensor refuses an op that mixes plain
    tensors and DTensors. (The solver places such values like any other; an annotation after
    one redistributes it.) Whether any was."""
    changed = False
    for module in graph_modules(gm):
        if id(module) in local:
            continue
        graph = module.graph
        found = False
        for node in list(graph.nodes):
            users = [user for user in node.users if user.target is not replicated]
            if not users or not _makes_plain_tensor(module, node):
                continue
            with graph.inserting_after(node):
                wrapped = graph.call_function(replicated, (node, mesh))
            for user in users:
                user.replace_input_with(node, wrapped)
            found = True
        if found:
            graph.lint()
            module.recompile()
            changed = True
    return changed


def in_region_body(node: fx.Node) -> bool:
    state = _LOWERING.get()
    return state is not None and id(node.graph.owning_module) in state["local"]


def check_mesh(node: fx.Node, mesh: Mesh) -> None:
    """``PassError`` naming ``node`` unless ``mesh`` is the lowering's DeviceMesh."""
    state = _LOWERING.get()
    if state is None:
        return
    given = state["mesh"]
    problems = []
    if mesh.shape != given.shape:
        problems.append(f"shape {mesh.shape} vs {given.shape}")
    if state["named"] and mesh.axis_names != given.axis_names:
        problems.append(f"axis names {mesh.axis_names} vs {given.axis_names}")
    if mesh.device_ids != given.device_ids and mesh.shape == given.shape:
        problems.append(f"ranks {mesh.device_ids} vs {given.device_ids}")
    if problems:
        raise PassError(
            f"lower_to_dtensor: {node.format_node()}: its mesh {mesh!r} does not match the DeviceMesh "
            f"{given!r} it is lowered for ({'; '.join(problems)})"
        )
    register_device_mesh(mesh, state["device_mesh"])  # what the lowered graph runs on


def _check_rank(node: fx.Node, spec: ShardingSpec) -> None:
    example = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if isinstance(example, torch.Tensor):  # a check only: the rewrite never reads meta
        try:
            spec.check_tensor(example.dim(), "its spec")
            spec.grad.check_tensor(example.dim(), "its gradient spec")
        except ValueError as error:
            raise PassError(f"lower_to_dtensor: {node.format_node()}: {error}") from None


@register_rule(TARGET, sharding_annotation_hop)
def lower_sharding_annotation(node: fx.Node) -> None:
    spec = typed_spec(node, TARGET, ShardingSpec)
    _check_rank(node, spec)
    if in_region_body(node):
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)
        return
    check_mesh(node, spec.mesh)
    node.target = annotate_on_dtensors  # in place: the node keeps its name and stack trace


@register_rule(TARGET, local_map_hop)
def lower_local_map(node: fx.Node) -> None:
    """Enter each input per its placements, the body (lowered already) on the local tensors,
    leave each output per its placements."""
    operands, spec = region_operands(node, TARGET)
    if in_region_body(node):
        raise PassError(
            f"lower_to_dtensor: {node.format_node()}: a local_map region inside a region body; "
            "the body already computes on local tensors (merge the regions)"
        )
    check_mesh(node, spec.mesh)
    graph = node.graph
    with graph.inserting_before(node):
        local_inputs = [
            value if placements is None else graph.call_function(enter_region, (value, spec, i))
            for i, (value, placements) in enumerate(zip(operands, spec.in_placements))
        ]
    # The body (lowered already) is copied in between: a region runs once per call, so its
    # body needs no module of its own (and module hooks do not fire per region).
    local_outputs = copy_body_into(node, body_module(node), local_inputs)
    if len(local_outputs) != len(spec.out_placements):
        raise PassError(
            f"lower_to_dtensor: {node.format_node()}: its body returns {len(local_outputs)} values for "
            f"{len(spec.out_placements)} out_placements"
        )
    with graph.inserting_before(node):
        outputs = [graph.call_function(exit_region, (local, spec, j)) for j, local in enumerate(local_outputs)]
    replace_tuple_output(node, outputs)


@register_rule(TARGET, scan_hop)
def lower_scan(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScanSpec)
    body_module(node)
    node.target = run_scan_on_dtensors  # same args; the body subgraph is lowered already


@register_rule(TARGET, named_scope_hop)
def inline_named_scope(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScopeSpec)
    replace_tuple_output(node, copy_body_into(node, body_module(node), list(node.args[1:-1])))


def profile_named_scope(node: fx.Node) -> None:
    """``record_scopes=True``: the body stays a subgraph, run under ``record_function``."""
    typed_spec(node, TARGET, ScopeSpec)
    body_module(node)
    node.target = run_in_profiler_scope


@register_rule(TARGET, Kernel)
def lower_kernel(node: fx.Node) -> None:
    if not in_region_body(node):
        raise PassError(
            f"lower_to_dtensor: {node.format_node()}: kernel {node.target.__name__!r} is called on DTensors "
            "(outside a local_map region); a kernel computes on plain tensors: call it inside a hops.local_map "
            "region, whose body runs on each rank's local tensors"
        )
    call_kernel_op(node, TARGET)


register_rule(TARGET, einsum_kernel)(lambda node: einsum_to_aten(node, TARGET))
register_rule(TARGET, einsum_linear_kernel)(lambda node: einsum_linear_to_aten(node, TARGET))
