"""Target ``"unroll"``: every scan replaced by ``length`` copies of its body.

For backends without loops. Only scans change; every other HOP of this package is kept
(its bodies are still visited, so a scan nested in a region body unrolls too). A scan
nested in a scan's body unrolls first, so the outer copies are loop-free.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from hops.einsum import einsum_kernel, einsum_linear_kernel
from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.lowering import split_scan_operands
from hops.named_scope import named_scope_hop
from hops.scan import ScanSpec, scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from passes._infra import HopRulePass, PassError, body_module, copy_body_into, keep, register_rule, replace_tuple_output, typed_spec

__all__ = ["unroll_scan"]

TARGET = "unroll"

register_rule(TARGET, sharding_annotation_hop, local_map_hop, named_scope_hop, Kernel, einsum_kernel, einsum_linear_kernel)(keep)


@register_rule(TARGET, scan_hop)
def unroll(node: fx.Node) -> None:
    spec = typed_spec(node, TARGET, ScanSpec)
    if spec.length is None:
        raise PassError(
            f"unroll_scan: {node.format_node()} has a symbolic length; unrolling needs a static one "
            "(trace with static shapes, or keep the scan and run it with its eager rule)"
        )
    if spec.length == 0:
        raise PassError(f"unroll_scan: {node.format_node()} has length 0; nothing to unroll (keep the scan)")
    graph = node.graph
    body = body_module(node)
    carry, xs, additional = split_scan_operands(node.args[1:-1], spec)
    ys_per_step: list[Any] = [None] * spec.length
    order = range(spec.length - 1, -1, -1) if spec.reverse else range(spec.length)
    for i in order:
        with graph.inserting_before(node):
            x = [graph.call_function(torch.ops.aten.select.int, (value, 0, i)) for value in xs]
        outputs = copy_body_into(node, body, [*carry, *x, *additional])
        carry, ys_per_step[i] = outputs[: spec.num_carry], outputs[spec.num_carry :]
    with graph.inserting_before(node):
        ys = [
            graph.call_function(torch.ops.aten.stack.default, ([step[j] for step in ys_per_step],))
            for j in range(len(ys_per_step[0]))
        ]
    replace_tuple_output(node, [*carry, *ys])


def unroll_scan(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every scan (in ``gm`` and its subgraphs) by ``length`` copies of its body."""
    HopRulePass(TARGET, name="unroll_scan")(gm)
    return gm
