"""``apply_placements``: state a solution in the program as sharding annotations.

Each placed value gets a ``hops_sharding_annotation`` of its placement right after it is
produced (inside scan and named-scope bodies too); each read that needs another layout (a
consumer strategy's input placement, a scan operand laid out like its carry or slice, a
gradient laid out like its parameter) gets a second annotation in front of the reader. A
``Partial`` layout is not stated (an XLA sharding describes a whole value); the next stated
layout makes the partitioner reduce it (a region's output: first its sums alone, as
``check_placements`` wants), and a region entering a value as ``Partial`` reads it replicated
(its lowering makes the sum locally), or as made if the value already has that sum (another
region's output with it, read in another layout: reduced, then replicated, as XLA runs it).
Regions keep their own placements, switched to the chosen alternative. Values inside region bodies are per-device and are left alone.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from hops.local_map import local_map_hop
from hops.sharding_annotation import sharding_annotation_hop
from hops.specs import Partial, Replicate, ShardingSpec
from passes._infra import PassError
from passes.solver.graph import NodeKind, UseKind, as_program, required_placement
from passes.solver.solve import PlacementSolution

__all__ = ["apply_placements"]


def _stateable(placements: Any, produced: Any = None) -> bool:
    """Whether an annotation can state ``placements``: no pending sum, or (for a read of a
    value placed ``produced``) only the pending sums the value already has, on the same mesh
    axes (gathering or sharding the other axes keeps them)."""
    if placements is None:
        return False
    return all(not isinstance(p, Partial) or (produced is not None and produced[axis] == p) for axis, p in enumerate(placements))


def _is_region_output(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is local_map_hop
    )


def _reduced(produced: tuple, required: tuple) -> tuple:
    """``produced`` with each pending sum reduced into ``required``'s placement on its mesh axis
    (kept where ``required`` keeps it): the one step of a read that changes only the sums."""
    return tuple(want if isinstance(made, Partial) else made for made, want in zip(produced, required))


def _entered(produced: tuple, required: tuple) -> tuple:
    """The layout a region entering ``required`` reads a value placed ``produced`` from: each
    pending sum the value does not already have, replicated (the region makes it locally)."""
    return tuple(
        Replicate() if isinstance(want, Partial) and want != made else want for made, want in zip(produced, required)
    )


def choose_alternative(spec: Any, index: int) -> Any:
    """``spec`` with its alternative ``index`` as the region's placements."""
    if spec.alternatives:
        return spec.choose(index)
    if index == 0:
        return spec
    raise PassError(f"apply_placements: {spec!r} has no alternative {index}")


def _replace_leaf(reader: fx.Node, position: int, value: fx.Node) -> None:
    leaves, treespec = pytree.tree_flatten((reader.args, reader.kwargs))
    leaves[position] = value
    reader.args, reader.kwargs = pytree.tree_unflatten(leaves, treespec)


def apply_placements(gm: Any, solution: PlacementSolution, *, pending_sums: bool = False) -> Any:
    """Insert the annotations and region choices that state ``solution`` into ``gm`` (in place).

    ``gm`` is what the solution was solved for (a GraphModule, or ``(forward, backward)``);
    returns it. Afterwards ``passes.check_placements`` passes and ``passes.lower_to_xla``
    lowers the stated layouts to XLA shardings. Raises ``PassError`` if ``gm`` is not the
    solved program.

    ``pending_sums=True`` (for ``passes.lower_to_dtensor``) also states the reads that keep
    a value's pending sums on some mesh axes while laying out its other axes (a value placed
    ``(S(0), P)`` read as ``(R, P)``): DTensor then runs the plan's redistributions, which
    ``PlacementSolution.collectives`` predicts; left unstated, DTensor's own propagation
    chooses where those sums are reduced. An XLA sharding describes a whole value and cannot
    state a pending sum (``lower_to_xla`` refuses one): the default leaves them to XLA.
    """
    if not isinstance(solution, PlacementSolution):
        raise TypeError(f"apply_placements(solution=...) must be a PlacementSolution, got {type(solution).__name__}")
    program = as_program(gm, "apply_placements")
    solved = solution.graph.graph["program"]
    if [m for _, m in program] != [m for _, m in solved]:
        raise PassError("apply_placements: gm is not the program this solution was solved for")
    changed: set[fx.GraphModule] = set()  # the modules to lint and recompile
    stated = _state_placed_values(solution, changed)
    _state_reads(solution, stated, pending_sums, changed)
    _choose_region_alternatives(solution, changed)
    for module in changed:
        module.graph.lint()
        module.recompile()
    return gm


def _state_placed_values(solution: PlacementSolution, changed: set) -> dict[str, fx.Node]:
    """Producer side: an annotation of every placed value, right after it is made. Returns
    the node that holds each value laid out as placed (the value itself where it needs no
    statement: a region's local value, an annotation, a layout the target cannot state)."""
    graph, mesh = solution.graph, solution.mesh
    stated: dict[str, fx.Node] = {}
    for key, placements in solution.placements.items():
        data = graph.nodes[key]
        node: fx.Node = data["fx_node"]
        if data["kind"] in (NodeKind.LOCAL, NodeKind.ANNOTATION) or not _stateable(placements):
            stated[key] = node
            continue
        module_graph = node.graph
        if node.op == "placeholder":
            anchor = list(module_graph.find_nodes(op="placeholder"))[-1]
        else:
            anchor = node
        with module_graph.inserting_after(anchor):
            annotation = module_graph.call_function(sharding_annotation_hop, (node, ShardingSpec(mesh, placements)))
        node.replace_all_uses_with(annotation, delete_user_cb=lambda user, annotation=annotation: user is not annotation)
        stated[key] = annotation
        changed.add(data["module"])
    return stated


def _state_reads(solution: PlacementSolution, stated: dict[str, fx.Node], pending_sums: bool, changed: set) -> None:
    """Reader side: every read of a value in another layout than it is placed in."""
    reductions: dict[tuple, fx.Node] = {}  # (region output, layout) -> its pending sums reduced so
    for u, v, edge in solution.graph.edges(data=True):
        if not edge["uses"] or u not in solution.placements:
            continue
        produced = solution.placements[u]
        kept = produced if pending_sums else None  # the pending sums a statement may keep
        for use in edge["uses"]:
            required = required_placement(solution, v, use, produced)
            if required != produced and use.kind is not UseKind.CARRY:
                # (A carry is stated by the carry input's own annotation, at the top of every step.)
                _state_read(solution, u, use, produced, required, kept, stated, reductions, changed)


def _state_read(
    solution: PlacementSolution,
    u: str,
    use: Any,
    produced: tuple,
    required: tuple,
    kept: tuple | None,
    stated: dict[str, fx.Node],
    reductions: dict[tuple, fx.Node],
    changed: set,
) -> None:
    """State one read of value ``u`` (placed ``produced``) as ``required``."""
    graph, mesh = solution.graph, solution.mesh
    reader: fx.Node = use.reader
    statement = reader.target is sharding_annotation_hop  # the reader states its layout itself
    if not statement and not _stateable(required, kept):
        # A pending sum the target cannot state: the reader is a region entering the
        # value as Partial, which it makes locally from a replicated value; state that.
        required = _entered(produced, required)
        if required == produced:
            return
        if not _stateable(required, kept):
            if _is_region_output(stated[u]):
                # It keeps a region output's pending sum in another layout of its
                # other axes: the target reduces the sum as the value leaves its region
                # and the reader makes it again; state both steps (reduced, replicated).
                required = tuple(Replicate() if isinstance(p, Partial) else p for p in required)
            else:
                # It keeps a pending sum of the value: it reads the value as made.
                if stated[u] is not graph.nodes[u]["fx_node"]:
                    _replace_leaf(reader, use.position, graph.nodes[u]["fx_node"])
                    changed.add(reader.graph.owning_module)
                return
    source = stated[u]
    if _is_region_output(source):
        # The region's output is unstated (it has a pending sum): an annotation on it
        # may only reduce the sum (what check_placements accepts), so a read that also
        # moves its other mesh axes states the reduction first.
        reduced = _reduced(produced, required)
        if reduced == required and statement:
            return
        if not _stateable(reduced, kept):
            return  # a statement keeping a pending sum the target cannot state
        if (u, reduced) not in reductions:
            with source.graph.inserting_after(source):
                reductions[u, reduced] = source.graph.call_function(sharding_annotation_hop, (source, ShardingSpec(mesh, reduced)))
        source = reductions[u, reduced]
        if reduced == required or statement:
            _replace_leaf(reader, use.position, source)
            changed.add(reader.graph.owning_module)
            return
    elif statement:
        return
    with reader.graph.inserting_before(reader):
        annotation = reader.graph.call_function(sharding_annotation_hop, (source, ShardingSpec(mesh, required)))
    _replace_leaf(reader, use.position, annotation)
    changed.add(reader.graph.owning_module)


def _choose_region_alternatives(solution: PlacementSolution, changed: set) -> None:
    """Each region's node holds the alternative its chosen strategy is."""
    for key, strategy in solution.strategies.items():
        data = solution.graph.nodes[key]
        if data["kind"] is not NodeKind.REGION:
            continue
        node = data["fx_node"]
        index = data["strategies"].index(strategy)
        spec = node.args[-1]
        chosen = choose_alternative(spec, index)
        if chosen is not spec:
            node.args = (*node.args[:-1], chosen)
            changed.add(data["module"])
