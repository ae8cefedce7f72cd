"""The placement graph with each scan unrolled: one copy of the body per step, each free to
take its own placements. Solving it gives the unrolled optimum a scan's shared placements are
measured against, on the same values, strategies and cost model.

Step ``i``'s copy of body value ``k`` is ``k@i``. The first step's carries are fed by the init,
each later step's carries by the previous step's carry outputs (each its own layout, a
redistribution between steps where they differ); the stacked ys are the last step's ys with a
leading dim, every other step's ys laid out like them (one slice each, pending sums kept). The
values the body reads alike at every step stay shared: additional inputs, and the slices of
stacked xs (one stacked value, laid out once before the loop; a step wanting its slice in
another layout redistributes it where it reads it). Every read is priced as in the scan, so a
scan plan costs the same here as in the scan, up to the stacked ys of steps whose layouts differ.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from passes._infra import PassError
from passes.solver.graph import NodeKind, Strategy, Use, UseKind

__all__ = ["unrolled_graph", "scan_plan_on_unrolled"]


def unrolled_graph(graph: nx.DiGraph) -> tuple[nx.DiGraph, dict[str, str]]:
    """``graph`` with every scan unrolled, and for each copy the body value it copies."""
    out = graph.copy()
    origin: dict[str, str] = {}
    for scan in graph.graph.get("scans", []):
        prefix = scan["scope"] + "/"
        if any(other is not scan and other["scope"].startswith(prefix) for other in graph.graph.get("scans", [])):
            raise PassError(f"unrolled_graph: scan {scan['scope']} holds another scan; nested scans are not unrolled")
        length = scan["length"]
        shared = {k for k in graph.nodes if k.startswith(prefix) and _is_shared_input(graph, k, scan)}
        body = [k for k in graph.nodes if k.startswith(prefix) and k not in shared]
        members = set(body)
        order = list(range(length))[::-1] if scan["reverse"] else list(range(length))
        for i in range(length):
            for key in body:
                data = dict(graph.nodes[key])
                data["multiplier"] = max(1, data["multiplier"] // length)
                alias = data["alias"]
                if alias is not None and alias[0] in body:
                    data["alias"] = (f"{alias[0]}@{i}", alias[1], alias[2])
                if data.get("body_values") is not None:  # a region: its own step's copy of its body
                    data["body_values"] = [tuple(f"{k}@{i}" if k in members else k for k in keys) for keys in data["body_values"]]
                out.add_node(f"{key}@{i}", **data)
                origin[f"{key}@{i}"] = key
        for u, v, data in graph.edges(data=True):
            if u not in body and v not in body:
                continue
            if u not in body and v in scan["carry_in"]:
                out.add_edge(u, f"{v}@{order[0]}", **data)  # the init feeds the first step only
                continue
            for i in range(length):
                copy_u = f"{u}@{i}" if u in body else u
                copy_v = f"{v}@{i}" if v in body else v
                if data.get("loop"):
                    continue  # carries are rewired below
                uses = [use._replace(multiplier=max(1, use.multiplier // length)) for use in data["uses"]]
                out.add_edge(copy_u, copy_v, **{**data, "uses": uses})
        for carry_in, carry_out in zip(scan["carry_in"], scan["carry_out"]):
            if not graph.has_edge(carry_out, carry_in) or not graph.edges[carry_out, carry_in].get("loop"):
                continue  # a carry the body passes through unchanged
            for previous, step in zip(order, order[1:]):
                out.add_edge(
                    f"{carry_out}@{previous}", f"{carry_in}@{step}", bytes=graph.nodes[carry_out]["bytes"],
                    tie=False, loop=True, uses=[Use(UseKind.CARRY, 0, scan["multiplier"])],
                )
        # The scan's results: the last step's carries; the ys stacked from every step's.
        last = order[-1]
        for index, key in scan["results"].items():
            data = out.nodes[key]
            target, item, shift = data["alias"]
            data["alias"] = (f"{target}@{last}", item, shift)
            if index >= scan["num_carry"]:
                y = scan["ys"][index - scan["num_carry"]]
                for step in order[:-1]:
                    out.add_edge(
                        f"{y}@{step}", key, bytes=0, tie=False,
                        uses=[Use(UseKind.VALUE, -1, scan["multiplier"], None, -1, graph.nodes[y]["shape"])],
                    )
        for key in body:
            out.remove_node(key)
    for key in list(out.nodes):
        alias = out.nodes[key]["alias"]
        if alias is not None and alias[0] not in out:
            raise PassError(f"unrolled_graph: {key} aliases {alias[0]}, which was unrolled")
    out.graph["scans"] = []
    return out, origin


def _is_shared_input(graph: nx.DiGraph, key: str, scan: dict) -> bool:
    """A body input every step reads alike: an additional input, or the slices of stacked xs."""
    data = graph.nodes[key]
    return data["kind"] is NodeKind.INPUT and data["fx_node"].op == "placeholder" and key not in scan["carry_in"]


def scan_plan_on_unrolled(unrolled: nx.DiGraph, origin: dict[str, str], solution: Any) -> dict[str, Strategy]:
    """The strategies a scan solution gives every node of the unrolled graph: each copy takes
    its body value's (a first carry input, its carry's placement)."""
    strategies = {}
    for key, data in unrolled.nodes(data=True):
        if data["strategies"] is None or data["kind"] is NodeKind.LOCAL:
            continue
        source = origin.get(key, key)
        if source in solution.strategies and solution.strategies[source] in data["strategies"]:
            strategies[key] = solution.strategies[source]
        else:
            placement = solution.placements[source]
            strategies[key] = next(s for s in data["strategies"] if s.outputs[0] == placement)
    return strategies
