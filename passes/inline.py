"""``inline_hops``: replace this package's HOPs by plain ATen any backend runs.

One rule per HOP (``INLINE_RULES``); a new HOP registers its rule with
``@register_inline_rule(hop)``.
"""

from __future__ import annotations

import torch.fx as fx

from hops.local_map import local_map_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, Replicate
from passes._infra import HopRulePass, PassError, Rule, body_module, copy_body_into, replace_tuple_output

INLINE_RULES: dict[object, Rule] = {}


def register_inline_rule(hop: object):
    def register(rule: Rule) -> Rule:
        INLINE_RULES[hop] = rule
        return rule

    return register


@register_inline_rule(sharding_annotation_hop)
def inline_sharding_annotation(node: fx.Node) -> None:
    # The annotation is the identity on values. In a functional graph nothing mutates, so
    # using the input itself (instead of a copy) is equivalent and lets backends skip a copy.
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)


def _inline_body(node: fx.Node) -> None:
    """Replace a HOP node by a copy of its body, fed the node's (non-spec) inputs."""
    inputs = [a for a in node.args[1:] if not isinstance(a, LocalMapSpec)]
    replace_tuple_output(node, copy_body_into(node, body_module(node), inputs))


def _local_equals_global(spec: LocalMapSpec) -> bool:
    """Each device sees the whole value and returns it whole: the body computes globally."""
    if spec.mesh.size == 1:
        return True
    groups = [*spec.in_placements, *spec.out_placements]
    return all(group is None or all(isinstance(p, Replicate) for p in group) for group in groups)


@register_inline_rule(local_map_hop)
def inline_local_map(node: fx.Node) -> None:
    spec = node.args[-1]
    if not _local_equals_global(spec):
        raise PassError(
            f"inline_hops: {node.format_node()} shards or reduces over the mesh, so its body computes "
            "on per-device pieces: inlined into a graph of global tensors it would give different "
            "results. If the graph is already in per-device form (a solver applied the shardings), call "
            "inline_hops(gm, per_device=True); otherwise use lower_to_xla or run the eager simulation"
        )
    _inline_body(node)


def inline_local_map_per_device(node: fx.Node) -> None:
    # The caller states the graph computes per device: the region's inputs are already local.
    _inline_body(node)


def inline_hops(gm: fx.GraphModule, *, per_device: bool = False) -> fx.GraphModule:
    """Inline every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``.

    A ``local_map`` region is inlined into its body only where that keeps the results: when
    every placement is ``Replicate`` or the mesh has one device (local equals global), or
    with ``per_device=True``, which states that ``gm`` already computes on per-device tensors
    (the form a sharding solver produces when it applies shardings). Otherwise ``PassError``.
    """
    rules = dict(INLINE_RULES)
    if per_device:
        rules[local_map_hop] = inline_local_map_per_device
    HopRulePass("inline_hops", rules)(gm)
    return gm
