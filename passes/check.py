"""``check_placements``: do the layouts a graph states agree with each local_map region's?

A graph states a layout wherever a typed spec meets a region directly:
- a sharding annotation feeds a region input: its placements must be the input's
  ``in_placements`` (a ``Replicate`` placement may feed a ``Partial`` one: the region makes
  the pending sum locally, one device keeping the value and the others adding zeros); if it
  has gradient placements, they must be the layout the region produces for that gradient;
- a region output is annotated: the annotation must match the output's ``out_placements``;
- a region output feeds another region: ``out_placements`` must be the consumer's
  ``in_placements`` (as for an annotation feeding it).
Where a region makes a pending sum (an output, or a gradient placed ``Partial``), the
statement says where the sum goes once reduced (``Replicate``: all-reduced, ``Shard``:
reduce-scattered), since no XLA sharding can state the sum itself; its other mesh axes must
agree. A mismatch is not wrong arithmetic (global values are well defined), but it means the
plan asks for a redistribution nobody wrote down, which is what a sharding solver's
verifier must catch. Reads node args only; recurses into subgraphs.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from hops.kernel import Kernel
from hops.local_map import local_map_hop
from hops.named_scope import named_scope_hop
from hops.scan import scan_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import LocalMapSpec, Mesh, Partial, Replicate, ShardingSpec
from passes._infra import PassError, check_spec, graph_modules, hop_row, hop_table, is_package_hop, ordinary_op, typed_spec

Stated = tuple  # (what, mesh, placements, grad placements)


class CheckRule(NamedTuple):
    """``check_placements``' row of a HOP: ``states(node, index)`` is the layout the node states
    for its output ``index`` (``None``: the node's single value), as ``(what, mesh, placements,
    grad placements)``, or None; ``problems(node)`` lists where the node disagrees with the
    layouts stated for what it reads and what reads it."""

    states: Callable[[fx.Node, int | None], Stated | None]
    problems: Callable[[fx.Node], list[str]]


def _states_nothing(node: fx.Node, index: int | None) -> None:
    return None


def _no_problems(node: fx.Node) -> list[str]:
    return []


def _annotation_states(node: fx.Node, index: int | None) -> Stated | None:
    if index is not None:
        return None
    spec = typed_spec(node, "check_placements", ShardingSpec)
    return (f"annotation {node.name}", spec.mesh, spec.placements, spec.grad_placements)


def _region_states(region: fx.Node, index: int | None) -> Stated | None:
    if index is None:
        return None
    spec = typed_spec(region, "check_placements", LocalMapSpec)
    return (f"output {index} of {region.name}", spec.mesh, spec.out_placements[index], None)


def _rule(node: Any) -> CheckRule | None:
    """The check row of ``node``'s HOP (``ordinary_op`` rows state nothing), None if not a HOP node."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and is_package_hop(node.target)):
        return None
    row = hop_row(CHECK_PLACEMENTS, node.target, "check_placements", node)
    return _ORDINARY if row is ordinary_op else row


def _stated_layout(value: Any) -> Stated | None:
    """(what, mesh, placements, grad placements) a producer node states for ``value``."""
    if not isinstance(value, fx.Node) or value.op != "call_function":
        return None
    rule = _rule(value)
    if rule is not None:
        return rule.states(value, None)
    if value.target is operator.getitem:
        rule = _rule(value.args[0])
        if rule is not None:
            return rule.states(value.args[0], value.args[1])
    return None


def _reduces(made: tuple, placements: tuple, mesh: Mesh) -> bool:
    """Whether a statement of ``placements`` agrees with a value a region makes as ``made``:
    the same placement on every mesh axis, except that a pending sum may be reduced into any
    placement that is not itself a pending sum. On an axis of size 1 every placement is the
    whole value on the one device: any two agree."""
    return len(made) == len(placements) and all(
        size == 1 or was == stated or (isinstance(was, Partial) and not isinstance(stated, Partial))
        for size, was, stated in zip(mesh.shape, made, placements)
    )


def _enters(expected: tuple, placements: tuple, mesh: Mesh) -> bool:
    """Whether a value stated as ``placements`` is what a region input ``expected`` reads: the
    same placement on every mesh axis, except that a replicated value enters as a pending sum
    locally (one device keeps it, the others add zeros); any two agree on an axis of size 1."""
    return len(expected) == len(placements) and all(
        size == 1 or want == stated or (isinstance(want, Partial) and isinstance(stated, Replicate))
        for size, want, stated in zip(mesh.shape, expected, placements)
    )


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
        elif not _enters(spec.in_placements[index], placements, mesh):
            problems.append(
                f"{region.name} input {index}: {what} lays it out as {placements}, the region's "
                f"in_placements expect {spec.in_placements[index]}"
            )
        elif grads is not None and not _reduces(grad_placements[index], grads, mesh):
            problems.append(
                f"{region.name} input {index}: {what} wants its gradient as {grads}, the region "
                f"produces {grad_placements[index]}"
            )
    for user in region.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            continue
        index = user.args[1]
        for consumer in user.users:
            # A consumer stating the layout of the very value it reads (an annotation); its
            # gradient layout is the region's business.
            rule = _rule(consumer)
            stated = rule.states(consumer, None) if rule is not None else None
            if stated is not None:
                what, mesh, placements, _ = stated
                if mesh != spec.mesh or not _reduces(spec.out_placements[index], placements, mesh):
                    problems.append(
                        f"{region.name} output {index}: {what} lays it out as "
                        f"{placements}, the region's out_placements give {spec.out_placements[index]}"
                    )
    return problems


_ORDINARY = CheckRule(_states_nothing, _no_problems)

# ``check_placements``' row of each HOP: what layout it states, what it checks (a region
# checks the layouts stated for its inputs and outputs), or ``ordinary_op``: neither.
CHECK_PLACEMENTS = "check_placements"
hop_table(CHECK_PLACEMENTS).update(
    {
        sharding_annotation_hop: CheckRule(_annotation_states, _no_problems),
        local_map_hop: CheckRule(_region_states, _mismatches),
        scan_hop: ordinary_op,
        named_scope_hop: ordinary_op,
        Kernel: ordinary_op,
    }
)


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
                    problems += _rule(node).problems(node)
        if problems:
            raise PassError("check_placements found layouts that disagree:\n  " + "\n  ".join(problems))
        return PassResult(graph_module, False)


def check_placements(gm: fx.GraphModule) -> fx.GraphModule:
    """Verify stated layouts against every local_map region in ``gm`` and its subgraphs."""
    CheckPlacements()(gm)
    return gm
