"""Target ``"inline"``: this package's HOPs as plain ATen (and torch ops) any backend runs.

One rule per HOP:

- an annotation is the identity on values: its uses read its input;
- a named scope becomes its body;
- a ``local_map`` region becomes the per-device program its eager semantics define: each
  device's shards sliced out (``narrow_copy``), the body once per device, the outputs
  assembled (concatenated, reduced, or one device's copy, checked to agree); with
  ``inline_hops(gm, per_device=True)`` (a graph already in per-device form, as a sharding
  solver leaves it) a region is just its body;
- a scan becomes a call of its loop (``run_scan_loop``, kept whole by FX);
- a kernel call becomes a call of the kernel's ``torch.library`` op (opaque to every
  backend); einsum becomes ``aten.einsum``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel, KernelParams
from hops.local_map import local_map_hop
from hops.lowering import device_coordinates, hop_prefix, replicated, run_scan_steps
from hops.named_scope import ScopeSpec, named_scope_hop
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, Partial, Shard, ShardingSpec
from passes._infra import (
    HopRulePass,
    PassError,
    body_module,
    copy_body_into,
    leaf_call,
    register_rule,
    replace_tuple_output,
    runner_spec,
    typed_spec,
)

__all__ = ["inline_hops", "run_scan_loop"]

TARGET = "inline"


@register_rule(TARGET, sharding_annotation_hop)
def inline_sharding_annotation(node: fx.Node) -> None:
    # The annotation is the identity on values. In a functional graph nothing mutates, so
    # using the input itself (instead of a copy) is equivalent and lets backends skip a copy.
    typed_spec(node, TARGET, ShardingSpec)
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)


@register_rule(TARGET, named_scope_hop)
def inline_named_scope(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScopeSpec)
    replace_tuple_output(node, copy_body_into(node, body_module(node), list(node.args[1:-1])))


def region_operands(node: fx.Node, target: str) -> tuple[list[Any], LocalMapSpec]:
    """A region node's operands and spec, checked to fit each other."""
    spec = typed_spec(node, target, LocalMapSpec)
    operands = list(node.args[1:-1])
    if len(operands) != len(spec.in_placements):
        raise PassError(
            f"{target}: {node.format_node()}: {len(operands)} operands but its spec has "
            f"{len(spec.in_placements)} in_placements"
        )
    for i, (value, placements) in enumerate(zip(operands, spec.in_placements)):
        example = value.meta.get("val") if isinstance(value, fx.Node) else None
        if isinstance(example, torch.Tensor) and placements is not None:
            try:
                ShardingSpec(spec.mesh, placements).check_tensor(example.dim(), f"operand {i}")
            except ValueError as error:
                raise PassError(f"{target}: {node.format_node()}: {error}") from None
    return operands, spec


def _local_value(graph: fx.Graph, value: Any, placements: Any, spec: LocalMapSpec, coordinate: tuple, memo: dict) -> Any:
    """Graph nodes computing what device ``coordinate`` holds of ``value`` (see hops._layout).

    ``memo`` shares the chunks of a value between the devices that need them."""
    if placements is None or not isinstance(value, fx.Node):
        return value
    local = value
    for axis, (size, placement, index) in enumerate(zip(spec.mesh.shape, placements, coordinate)):
        key = (value, coordinate[: axis + 1])
        if key in memo:
            local = memo[key]
            continue
        if isinstance(placement, Shard):
            # Shapes were checked to split evenly when the region was traced.
            chunks = memo.get((value, coordinate[:axis], "chunks"))
            if chunks is None:
                chunks = graph.call_function(torch.ops.aten.chunk.default, (local, size, placement.dim))
                memo[(value, coordinate[:axis], "chunks")] = chunks
            local = graph.call_function(operator.getitem, (chunks, index))
        elif isinstance(placement, Partial) and placement.reduce_op == "sum" and index != 0:
            local = graph.call_function(torch.ops.aten.zeros_like.default, (local,))
        memo[key] = local
    return local


_REDUCE = {"sum": torch.ops.aten.sum.dim_IntList, "avg": torch.ops.aten.mean.dim, "max": torch.ops.aten.amax.default, "min": torch.ops.aten.amin.default}


def _assemble(graph: fx.Graph, pieces: dict[tuple, fx.Node], placements: tuple, spec: LocalMapSpec, what: str) -> fx.Node:
    """Graph nodes assembling a global output from its per-device pieces (see hops._layout)."""
    grid = dict(pieces)
    for axis in reversed(range(spec.mesh.ndim)):
        placement = placements[axis]
        combined = {}
        for prefix in sorted({c[:axis] for c in grid}):
            row = [grid[prefix + (i,)] for i in range(spec.mesh.shape[axis])]
            if isinstance(placement, Shard):
                combined[prefix] = graph.call_function(torch.ops.aten.cat.default, (row, placement.dim))
            elif isinstance(placement, Partial):
                stacked = graph.call_function(torch.ops.aten.stack.default, (row,))
                combined[prefix] = graph.call_function(_REDUCE[placement.reduce_op], (stacked, [0]))
            else:
                # Every device must have computed the same value, checked as eagerly.
                args = (row, spec.mesh.axis_names[axis], what, spec.replicated_cotangents)
                combined[prefix] = graph.call_function(replicated, args)
        grid = combined
    return grid[()]


def expand_region(node: fx.Node) -> None:
    """Replace a region by its per-device program: shards, the body per device, assembly."""
    operands, spec = region_operands(node, TARGET)
    body = body_module(node)
    graph = node.graph
    pieces: list[dict[tuple, fx.Node]] = [{} for _ in spec.out_placements]
    memo: dict = {}
    for coordinate in device_coordinates(spec.mesh):
        with graph.inserting_before(node):
            local = [_local_value(graph, v, p, spec, coordinate, memo) for v, p in zip(operands, spec.in_placements)]
        outputs = copy_body_into(node, body, local)
        if len(outputs) != len(spec.out_placements):
            raise PassError(f"{TARGET}: {node.format_node()}: its body returns {len(outputs)} values for {len(spec.out_placements)} out_placements")
        for j, output in enumerate(outputs):
            pieces[j][coordinate] = output
    with graph.inserting_before(node):
        assembled = [
            _assemble(graph, p, placements, spec, f"{hop_prefix(local_map_hop, body)}: output[{j}]")
            for j, (p, placements) in enumerate(zip(pieces, spec.out_placements))
        ]
    replace_tuple_output(node, assembled)


register_rule(TARGET, local_map_hop)(expand_region)


def inline_region_per_device(node: fx.Node) -> None:
    # The caller states the graph computes per device: the region's operands are already local.
    operands, _ = region_operands(node, TARGET)
    replace_tuple_output(node, copy_body_into(node, body_module(node), operands))


@leaf_call
def run_scan_loop(body: Callable, *inputs_and_spec: Any) -> tuple[torch.Tensor, ...]:
    """A scan node's loop, as any backend that runs Python runs it (the reference loop)."""
    *inputs, spec = inputs_and_spec
    runner_spec("run_scan_loop", spec, ScanSpec)
    return run_scan_steps(body, inputs, spec)


@register_rule(TARGET, scan_hop)
def inline_scan(node: fx.Node) -> None:
    typed_spec(node, TARGET, ScanSpec)
    body_module(node)
    node.target = run_scan_loop  # same args; the body (inlined already) stays a subgraph


# --------------------------------------------------------------------------- kernels


def kernel_call(node: fx.Node, target: str) -> tuple[Kernel, list[Any], KernelParams]:
    *tensors, params = node.args
    if not isinstance(params, KernelParams):
        raise PassError(
            f"{target}: {node.format_node()}: the last argument of a kernel call must be a hops.KernelParams, "
            f"got {type(params).__name__}"
        )
    return node.target, list(tensors), params


def call_kernel_op(node: fx.Node, target: str) -> None:
    """The node as a call of its kernel's ``torch.library`` op (which returns a list)."""
    kernel_hop, tensors, params = kernel_call(node, target)
    single = not node.users or any(user.target is not operator.getitem for user in node.users)
    # Rewritten in place: the node keeps its name, users and stack trace.
    node.target = kernel_hop.op
    node.args = (tensors, repr(params))
    node.kwargs = {}
    value = node.meta.get("val")
    if value is not None:  # the op returns a list where the HOP returned a tensor or a tuple
        node.meta["val"] = list(value) if isinstance(value, (tuple, list)) else [value]
    if single:  # a one-output kernel: its users read the op's only element
        with node.graph.inserting_after(node):
            first = node.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)


register_rule(TARGET, Kernel)(lambda node: call_kernel_op(node, TARGET))


def einsum_to_aten(node: fx.Node, target: str) -> None:
    _, operands, params = kernel_call(node, target)
    node.target = torch.ops.aten.einsum.default
    node.args = (params.as_dict()["equation"], list(operands))
    node.kwargs = {}


def einsum_linear_to_aten(node: fx.Node, target: str) -> None:
    _, (x, weight, bias), _ = kernel_call(node, target)
    with node.graph.inserting_before(node):
        product = node.graph.call_function(torch.ops.aten.einsum.default, ("...i,oi->...o", [x, weight]))
    node.target = torch.ops.aten.add.Tensor
    node.args = (product, bias)
    node.kwargs = {}


register_rule(TARGET, einsum_kernel)(lambda node: einsum_to_aten(node, TARGET))
register_rule(TARGET, einsum_linear_kernel)(lambda node: einsum_linear_to_aten(node, TARGET))


def inline_hops(gm: fx.GraphModule, *, per_device: bool = False) -> fx.GraphModule:
    """Inline every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``.

    A ``local_map`` region becomes its per-device program (see the module docstring), or
    just its body with ``per_device=True``, which states that ``gm`` already computes on
    per-device tensors (the form a sharding solver produces when it applies shardings).
    """
    overrides = {local_map_hop: inline_region_per_device} if per_device else None
    HopRulePass(TARGET, name="inline_hops", rules=overrides)(gm)
    return gm

