"""``check_placements``: do the layouts a graph states agree with each local_map region's?

A graph states a layout wherever a typed spec meets a region directly:
- a sharding annotation feeds a region input: its placements must be the input's
  ``in_placements`` (and, if it has gradient placements, they must be the input's gradient
  placements: the layout the region produces for that gradient);
- a region output is annotated: the annotation must match the output's ``out_placements``;
- a region output feeds another region: ``out_placements`` must be the consumer's
  ``in_placements``.
A mismatch is not wrong arithmetic (global values are well defined), but it means the
plan asks for a redistribution nobody wrote down, which is what a sharding solver's
verifier must catch. Reads node args only; recurses into subgraphs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from hops.local_map import local_map_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, ShardingSpec
from passes._infra import PassError, check_spec, graph_modules, is_package_hop, typed_spec


def _stated_layout(value: Any) -> tuple[str, Any, Any, Any] | None:
    """(what, mesh, placements, grad placements) a producer node states for ``value``."""
    if not isinstance(value, fx.Node) or value.op != "call_function":
        return None
    if value.target is sharding_annotation_hop:
        spec = typed_spec(value, "check_placements", ShardingSpec)
        return (f"annotation {value.name}", spec.mesh, spec.placements, spec.grad_placements)
    if value.target is operator.getitem and _is_region(value.args[0]):
        region, index = value.args
        spec = typed_spec(region, "check_placements", LocalMapSpec)
        return (f"output {index} of {region.name}", spec.mesh, spec.out_placements[index], None)
    return None


def _is_region(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is local_map_hop


def _mismatches(region: fx.Node) -> list[str]:
    spec = typed_spec(region, "check_placements", LocalMapSpec)
    if len(region.args) - 2 != len(spec.in_placements):
        raise PassError(
            f"check_placements: {region.format_node()}: {len(region.args) - 2} operands but its spec has "
            f"{len(spec.in_placements)} in_placements"
        )
    problems = []
    grad_placements = spec.grad_placements()
    for index, value in enumerate(region.args[1:-1]):
        stated = _stated_layout(value)
        if stated is None or spec.in_placements[index] is None:
            continue
        what, mesh, placements, grads = stated
        if mesh != spec.mesh:
            problems.append(f"{region.name} input {index}: {what} is on {mesh!r}, the region on {spec.mesh!r}")
        elif placements != spec.in_placements[index]:
            problems.append(
                f"{region.name} input {index}: {what} lays it out as {placements}, the region's "
                f"in_placements expect {spec.in_placements[index]}"
            )
        elif grads is not None and grads != grad_placements[index]:
            problems.append(
                f"{region.name} input {index}: {what} wants its gradient as {grads}, the region "
                f"produces {grad_placements[index]}"
            )
    for user in region.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            continue
        index = user.args[1]
        for consumer in user.users:
            if consumer.op == "call_function" and consumer.target is sharding_annotation_hop:
                # Its gradient layout is the region's business.
                annotation = typed_spec(consumer, "check_placements", ShardingSpec)
                if annotation.mesh != spec.mesh or annotation.placements != spec.out_placements[index]:
                    problems.append(
                        f"{region.name} output {index}: annotation {consumer.name} lays it out as "
                        f"{annotation.placements}, the region's out_placements give {spec.out_placements[index]}"
                    )
    return problems


class CheckPlacements(PassBase):
    """Raise ``PassError`` listing every stated layout that disagrees with a region's."""

    def requires(self, graph_module: fx.GraphModule) -> None:
        if not isinstance(graph_module, fx.GraphModule):
            raise TypeError(f"check_placements expects a torch.fx.GraphModule, got {type(graph_module).__name__}")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        problems = []
        for module in graph_modules(graph_module):
            for node in module.graph.nodes:
                if node.op == "call_function" and is_package_hop(node.target):
                    check_spec(node, "check_placements")
                if _is_region(node):
                    problems += _mismatches(node)
        if problems:
            raise PassError("check_placements found layouts that disagree:\n  " + "\n  ".join(problems))
        return PassResult(graph_module, False)


def check_placements(gm: fx.GraphModule) -> fx.GraphModule:
    """Verify stated layouts against every local_map region in ``gm`` and its subgraphs."""
    CheckPlacements()(gm)
    return gm
