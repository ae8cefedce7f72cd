"""``lower_to_xla``: rewrite this package's HOPs into the functional ``hops_xla`` ops.

One rule per HOP (``XLA_RULES``); a new HOP registers its rule with
``@register_xla_rule(hop)``. The lowered GraphModule runs on XLA tensors under SPMD, where
each op emits its custom call and XLA's partitioner (GSPMD) distributes the program; on
other devices the ops are identities, so the graph still runs (e.g. for testing).
"""

from __future__ import annotations

import torch.fx as fx

import operator

from hops.local_map import local_map_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, ShardingSpec
from passes import xla_ops
from passes._infra import HopRulePass, PassError, Rule, replace_tuple_output

XLA_RULES: dict[object, Rule] = {}


def register_xla_rule(hop: object):
    def register(rule: Rule) -> Rule:
        XLA_RULES[hop] = rule
        return rule

    return register


def _spec_text(node: fx.Node, spec: object, argument: str) -> str:
    if not isinstance(spec, ShardingSpec):
        raise PassError(
            f"lower_to_xla: {node.format_node()}: {argument} must be a hops.ShardingSpec, "
            f"got {type(spec).__name__}"
        )
    if spec.has_partial:
        raise PassError(
            f"lower_to_xla: {node.format_node()}: {argument} {spec!r} has a Partial placement; "
            "an XLA sharding describes a whole value, so a sharding annotation cannot be Partial"
        )
    return repr(spec)


@register_xla_rule(sharding_annotation_hop)
def lower_sharding_annotation_to_xla(node: fx.Node) -> None:
    x, spec, *grad_spec = node.args
    args = (x, _spec_text(node, spec, "spec"))
    if grad_spec:
        args += (_spec_text(node, grad_spec[0], "grad_spec"),)
    # Rewriting the node in place keeps its name and stack trace.
    node.target = xla_ops.sharding_constraint
    node.args = args


@register_xla_rule(local_map_hop)
def lower_local_map_to_xla(node: fx.Node) -> None:
    """A manual-sharding region: enter each input per its placements, run the body on local
    tensors (the body stays a subgraph, lowered in turn), leave each output per its placements."""
    _, *inputs, spec = node.args
    if not isinstance(spec, LocalMapSpec):
        raise PassError(f"lower_to_xla: {node.format_node()}: last argument must be a hops.LocalMapSpec")
    graph = node.graph
    body = node.args[0]
    with graph.inserting_before(node):
        local_inputs = [
            value if placements is None
            else graph.call_function(xla_ops.enter_manual, (value, repr(ShardingSpec(spec.mesh, placements))))
            for value, placements in zip(inputs, spec.in_placements)
        ]
        local_outputs = graph.call_module(body.target, tuple(local_inputs))
        outputs = [
            graph.call_function(
                xla_ops.exit_manual,
                (graph.call_function(operator.getitem, (local_outputs, j)), repr(ShardingSpec(spec.mesh, placements))),
            )
            for j, placements in enumerate(spec.out_placements)
        ]
    replace_tuple_output(node, outputs)


def lower_to_xla(gm: fx.GraphModule) -> fx.GraphModule:
    """Lower every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``."""
    HopRulePass("lower_to_xla", XLA_RULES)(gm)
    return gm
