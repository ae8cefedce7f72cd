"""``draw_placements``: a picture of a solved program (PNG or SVG, drawn with matplotlib).

Values are laid out left to right in data-flow order; each is coloured by its placement
(the legend names them), a scan body's values are drawn once with a black outline, regions are
squares, annotations diamonds. An edge whose reader needs another layout than the value has
(a redistribution) is red, wider the more seconds it costs; edges that only tie placements
(a getitem, a carry, a saved value) are dashed. Values inside region bodies are not drawn.
"""

from __future__ import annotations

import os
from typing import Any

import networkx as nx

from passes.solver.graph import NodeKind, format_placement, read_as, required_placement
from passes.solver.solve import PlacementSolution, _itemsize

__all__ = ["draw_placements"]

_SHAPES = {NodeKind.REGION: "s", NodeKind.ANNOTATION: "D"}


def _import_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "draw_placements needs matplotlib (pip install matplotlib, or the 'draw' extra of torch-hops)"
        ) from e
    return matplotlib


def draw_placements(gm: Any, solution: PlacementSolution, path: str | os.PathLike) -> str:
    """Draw ``solution`` (solved for ``gm``) to ``path``; the format is its extension (``.png`` or
    ``.svg``). Returns the path."""
    path = os.fspath(path)
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".png", ".svg"):
        raise ValueError(f"draw_placements(path=...) must end in .png or .svg, got {path!r}")
    if not isinstance(solution, PlacementSolution):
        raise TypeError(f"draw_placements(solution=...) must be a PlacementSolution, got {type(solution).__name__}")
    _import_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    graph = solution.graph
    shown = [n for n, d in graph.nodes(data=True) if d["kind"] is not NodeKind.LOCAL]
    view, layers, widest = _layered_view(graph, shown)
    position = nx.multipartite_layout(view, subset_key="layer", align="vertical")
    labels = _labels(solution, shown)
    palette = _palette(sorted(set(labels.values())))

    figure = Figure(figsize=(min(4 + layers * 0.35, 200), min(3 + widest * 0.35, 120)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_axis_off()
    redistributions = _draw_edges(solution, view, position, axes)
    _draw_nodes(graph, shown, view, position, axes, [palette[labels[n]] for n in shown])
    _draw_legend(axes, palette)
    mesh = solution.mesh
    axes.set_title(
        f"placements on mesh {dict(zip(mesh.axis_names, mesh.shape))}: {solution.cost * 1e6:.4g} us per step, "
        f"{redistributions} redistributions",
        fontsize=9,
    )
    figure.savefig(path, format=extension[1:], bbox_inches="tight", dpi=110)
    return path


def _layered_view(graph: nx.DiGraph, shown: list) -> tuple[nx.DiGraph, int, int]:
    """The drawn nodes' data flow (no loop or gradient edges), each node in the layer of its
    topological generation; the number of layers and the widest layer's size."""
    view = nx.DiGraph()
    view.add_nodes_from(shown)
    for u, v, data in graph.edges(data=True):
        if u in view and v in view and not data.get("loop") and not data.get("gradient"):
            view.add_edge(u, v)
    for layer, nodes in enumerate(nx.topological_generations(view)):
        for n in nodes:
            view.nodes[n]["layer"] = layer
    layers = 1 + max((view.nodes[n]["layer"] for n in view), default=0)
    widest = max((sum(1 for n in view if view.nodes[n]["layer"] == k) for k in range(layers)), default=1)
    return view, layers, widest


def _labels(solution: PlacementSolution, shown: list) -> dict:
    """Each drawn node's label: its placements, "region" / "tuple", or "-" (not placed)."""
    labels = {}
    for n in shown:
        if n in solution.placements:
            labels[n] = format_placement(solution.placements[n])
        elif n in solution.strategies:
            labels[n] = "region" if solution.graph.nodes[n]["kind"] is NodeKind.REGION else "tuple"
        else:
            labels[n] = "-"
    return labels


def _draw_edges(solution: PlacementSolution, view: nx.DiGraph, position: dict, axes: Any) -> int:
    """Draw the edges: plain, ties (dashed), redistributions (red, as wide as their seconds).
    Returns the number of redistributions."""
    redistributions, ties, plain = [], [], []
    widths = []
    for u, v, data in solution.graph.edges(data=True):
        if u not in view or v not in view:
            continue
        if data["tie"]:
            ties.append((u, v))
            continue
        seconds = _edge_seconds(solution, u, v, data)
        if seconds > 0:
            redistributions.append((u, v))
            widths.append(seconds)
        else:
            plain.append((u, v))
    nx.draw_networkx_edges(view, position, edgelist=plain, ax=axes, edge_color="#bbbbbb", width=0.6, arrows=False)
    nx.draw_networkx_edges(view, position, edgelist=ties, ax=axes, edge_color="#999999", width=0.6, style="dashed", arrows=False)
    if redistributions:
        top = max(widths)
        nx.draw_networkx_edges(
            view, position, edgelist=redistributions, ax=axes, edge_color="#d62728",
            width=[1.0 + 3.0 * w / top for w in widths], arrows=True, arrowsize=6,
        )
    return len(redistributions)


def _draw_nodes(graph: nx.DiGraph, shown: list, view: nx.DiGraph, position: dict, axes: Any, colors: list) -> None:
    """Draw the nodes: a shape per kind, a colour per label, outlined inside a scan's body."""
    color_of = dict(zip(shown, colors))
    for kind_shape in ("o", "s", "D"):
        for in_body in (False, True):
            nodes = [
                n for n in shown
                if _SHAPES.get(graph.nodes[n]["kind"], "o") == kind_shape and (graph.nodes[n]["multiplier"] > 1) == in_body
            ]
            if not nodes:
                continue
            nx.draw_networkx_nodes(
                view, position, nodelist=nodes, ax=axes, node_shape=kind_shape, node_size=60,
                node_color=[color_of[n] for n in nodes],
                edgecolors="black" if in_body else "none", linewidths=1.2 if in_body else 0.0,
            )


def _draw_legend(axes: Any, palette: dict) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], marker="o", linestyle="", color=palette[label], label=label) for label in palette
    ]
    handles += [
        Line2D([], [], color="#d62728", label="redistribution (width: seconds)"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor="black", label="scan body (drawn once)"),
    ]
    axes.legend(handles=handles, loc="upper left", fontsize=7, frameon=False, ncol=max(1, len(handles) // 20))


def _edge_seconds(solution: PlacementSolution, u: str, v: str, data: dict) -> float:
    if u not in solution.placements:
        return 0.0
    source = solution.graph.nodes[u]
    produced = solution.placements[u]
    return sum(
        solution.cost_model.redistribute_seconds(
            source["shape"], _itemsize(source["dtype"]), read_as(use, produced),
            required_placement(solution, v, use, produced), solution.mesh,
        )
        for use in data["uses"]
    )


def _palette(labels: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors
    return {label: colors[i % len(colors)] if label != "-" else (0.8, 0.8, 0.8) for i, label in enumerate(labels)}
