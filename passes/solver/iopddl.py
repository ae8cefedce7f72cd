"""``read_iopddl``: a problem of the IOPDDL contest (ASPLOS / EuroSys 2025, google/iopddl) as a
``StrategyProblem``."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

from passes.solver.problem import FORBIDDEN_COST, StrategyProblem

__all__ = ["read_iopddl", "IOPDDL_INFINITY"]

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
