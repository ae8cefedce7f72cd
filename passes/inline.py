"""``inline_hops``: replace this package's HOPs by plain ATen any backend runs.

One rule per HOP (``INLINE_RULES``); a new HOP registers its rule with
``@register_inline_rule(hop)``.
"""

from __future__ import annotations

import torch.fx as fx

from hops.sharding_annotation import sharding_annotation_hop
from passes._infra import HopRulePass, Rule

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


def inline_hops(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline every HOP of this package in ``gm`` and its subgraphs (in place); return ``gm``."""
    HopRulePass("inline_hops", INLINE_RULES)(gm)
    return gm
