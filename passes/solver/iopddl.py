"""The IOPDDL contest's file format (ASPLOS / EuroSys 2025, google/iopddl): ``read_iopddl`` reads a
file as a ``StrategyProblem``; ``write_iopddl`` writes one (the FX front's too:
``passes.solver.solve.placement_problem``), so other solvers can be run on the project's problems."""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np

from passes.solver.problem import FORBIDDEN_COST, StrategyProblem

__all__ = ["read_iopddl", "write_iopddl", "IOPDDL_INFINITY"]

# The contest writes a forbidden choice as this cost.
IOPDDL_INFINITY = FORBIDDEN_COST


def _costs(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    return np.where(array >= IOPDDL_INFINITY, np.inf, array)


def read_iopddl(path: str | os.PathLike) -> StrategyProblem:
    """The contest's JSON file at ``path`` (``.gz`` or plain), costs of 1e18 and above as ``inf``.

    Node i's strategies are ``nodes.costs[i]`` / ``nodes.usages[i]``, live over
    ``nodes.intervals[i] = [start, end)``; edge k joins ``edges.nodes[k] = [i, j]`` with the
    row-major matrix ``edges.costs[k]``; ``usage_limit`` bounds every time step's live usage.
    """
    path = os.fspath(path)
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rt") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from e
    problem = data.get("problem", data) if isinstance(data, dict) else None
    if not isinstance(problem, dict) or "nodes" not in problem:
        raise ValueError(f"{path}: expected an object with 'problem' holding 'nodes', 'edges' and 'usage_limit'")
    nodes = problem["nodes"]
    edges = problem.get("edges") or {"nodes": [], "costs": []}
    for key in ("costs", "usages", "intervals"):
        if key not in nodes:
            raise ValueError(f"{path}: problem.nodes has no {key!r}")
    limit = problem.get("usage_limit")
    intervals = np.array(nodes["intervals"], dtype=np.int64).reshape(-1, 2) if nodes["intervals"] else np.zeros((0, 2), np.int64)
    return StrategyProblem(
        node_costs=tuple(_costs(c) for c in nodes["costs"]),
        node_usages=tuple(np.asarray(u, dtype=np.float64) for u in nodes["usages"]),
        intervals=intervals,
        edges=np.array(edges.get("nodes", []), dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(_costs(c) for c in edges.get("costs", [])),
        usage_limit=None if limit is None else float(limit),
        name=str(problem.get("name", os.path.basename(path))),
    )


def _number(value: float) -> int | float:
    """A cost or usage as the files write it: an integer where it is whole, 1e18 for ``inf``."""
    if math.isinf(value):
        return int(FORBIDDEN_COST)
    return int(value) if value == int(value) and abs(value) < 2**63 else value


def write_iopddl(
    problem: StrategyProblem,
    path: str | os.PathLike,
    *,
    cost_scale: float | None = None,
    name: str | None = None,
) -> None:
    """Write ``problem`` to ``path`` in the contest's JSON format (gzipped if ``path`` ends in
    ``.gz``); ``read_iopddl`` reads back a problem with the same plans and costs (class tables
    expanded, the ``constant`` added to the first node's costs, ``axes`` not written).
    Forbidden choices are written as 1e18, whole numbers as integers. ``cost_scale``: costs are
    multiplied by it and rounded to integers (the contest's solvers read integer costs: the FX
    front's seconds need e.g. ``1e9``, nanoseconds); ``None`` writes them as they are (floats
    where they are not whole).
    """
    if not isinstance(problem, StrategyProblem):
        raise TypeError(f"problem must be a StrategyProblem, got {type(problem).__name__}")
    if cost_scale is not None and not (isinstance(cost_scale, (int, float)) and cost_scale > 0 and math.isfinite(cost_scale)):
        raise ValueError(f"cost_scale must be a finite number > 0 or None, got {cost_scale!r}")

    def costs(values: np.ndarray) -> list:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if cost_scale is not None:
            values = np.where(np.isfinite(values), np.round(values * cost_scale), values)
        return [_number(v) for v in values.tolist()]

    data = {
        "problem": {
            "name": problem.name if name is None else name,
            "nodes": {
                "intervals": problem.intervals.tolist(),
                "costs": [costs(c + (problem.constant if i == 0 else 0.0)) for i, c in enumerate(problem.node_costs)],
                "usages": [[_number(v) for v in u.tolist()] for u in problem.node_usages],
            },
            "edges": {"nodes": problem.edges.tolist(), "costs": [costs(problem.edge_matrix(k)) for k in range(len(problem.edges))]},
        }
    }
    if problem.usage_limit is not None:
        data["problem"]["usage_limit"] = _number(float(problem.usage_limit))
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(data, f)
