"""The collectives a solved plan issues when it runs: ``PlacementSolution.collectives()``.

Kinds are named as in ``passes.solver.cost``: ``"all_gather"`` (``Shard -> Replicate``),
``"all_reduce"`` (``Partial -> Replicate``), ``"reduce_scatter"`` (``Partial -> Shard``),
``"all_to_all"`` (``Shard(i) -> Shard(j)``); ``Replicate -> Shard`` and ``Replicate -> Partial`` are
local. ``passes.dtensor.collective_counts`` names what DTensor's ``CommDebugMode`` counted the same way.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from hops.specs import Mesh, Partial, Replicate, Shard
from passes.solver.cost import redistribution_steps
from passes.solver.graph import UseKind, read_as, required_placement

if TYPE_CHECKING:  # the solution's type only: solve.py imports this module
    from passes.solver.solve import PlacementSolution

__all__ = ["COLLECTIVE_KINDS", "predicted_collectives", "redistribution_collectives"]

COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def redistribution_collectives(
    source: Sequence[Any], target: Sequence[Any], mesh: Mesh, *, device_type: str | None = None
) -> list[str]:
    """The collectives (one per step of ``redistribution_steps`` that communicates) that turn a
    value laid out as ``source`` into ``target``: what ``CostModel.redistribute_seconds`` prices.

    ``device_type="cpu"``: ``Shard(i) -> Shard(j)`` is an ``all_gather``, because DTensor runs it
    on CPU meshes as an all-gather and a local chunk (gloo has no all-to-all).
    ``Shard -> Partial`` is an ``all_gather`` (to ``Replicate``, then the pending sum kept locally).
    """
    kinds = []
    for axis, before, after in redistribution_steps(source, target):
        if mesh.shape[axis] == 1 or isinstance(before, Replicate):
            continue
        if isinstance(before, Shard):
            if isinstance(after, Shard) and device_type != "cpu":
                kinds.append("all_to_all")
            else:
                kinds.append("all_gather")
        elif isinstance(before, Partial):
            if isinstance(after, Replicate):
                kinds.append("all_reduce")
            elif isinstance(after, Shard):
                kinds.append("reduce_scatter")
    return kinds


def predicted_collectives(
    solution: PlacementSolution, graph: str | None = None, *, device_type: str | None = None
) -> dict[str, int]:
    """See ``PlacementSolution.collectives``."""
    scopes = {data["scope"].split("/")[0] for _, data in solution.graph.nodes(data=True)}
    if graph is not None and graph not in scopes:
        raise ValueError(f"PlacementSolution.collectives(graph={graph!r}): the program's graphs are {sorted(scopes)}")
    counts: Counter = Counter()
    for u, v, edge in solution.graph.edges(data=True):
        if not edge["uses"] or u not in solution.placements:
            continue
        source = solution.graph.nodes[u]
        if graph is not None and source["scope"].split("/")[0] != graph:
            continue
        for use in edge["uses"]:
            # A value that arrives whole (a saved value, a final carry) is placed without its
            # pending sum; a carry is read as it left the step before.
            produced = read_as(use, solution.placements[u])
            required = required_placement(solution, v, use, solution.placements[u])
            if use.kind is UseKind.VALUE and any(isinstance(p, Partial) for p in required):
                continue  # a pending sum is not stated: the reader takes the value as made
            # The redistribution runs as often as the read: a scan's operands once, before its
            # loop; a value in its body once per step; a carry between steps, one fewer.
            for kind in redistribution_collectives(produced, required, solution.mesh, device_type=device_type):
                counts[kind] += use.multiplier
    return dict(counts)
