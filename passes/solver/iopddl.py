"""The IOPDDL contest's file format (ASPLOS / EuroSys 2025, google/iopddl): ``read_iopddl`` reads a
file as a ``StrategyProblem``; ``write_iopddl`` writes one, or the FX front's ``ilp.Problem``
(through ``as_strategy_problem``), so other solvers can be run on the project's problems."""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np

from passes.solver import ilp
from passes.solver.problem import FORBIDDEN_COST, StrategyProblem

__all__ = ["read_iopddl", "write_iopddl", "as_strategy_problem", "IOPDDL_INFINITY"]

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


def as_strategy_problem(problem: ilp.Problem, memory_budget: float | None = None, name: str = "") -> StrategyProblem:
    """The FX front's problem as a plain one with the same plans and costs (the plan of node
    ``i < len(problem.choices)`` is choice i's option) and ``memory_budget`` as its usage limit.

    A choice is a node; a factor an edge (its class-compressed table expanded); a factor of a
    choice with itself part of its costs; the constant part of the first node's costs (a node
    of one strategy if there is no choice). With memory terms, a choice's first term gives its
    node's interval and usages, and each further term is a node of its own, zero cost, held to
    the choice's option by an edge (0 on the diagonal, forbidden elsewhere); without terms, the
    budget bounds the sum of every choice's memory, so every node is live at the one time step 0.
    """
    if not isinstance(problem, ilp.Problem):
        raise TypeError(f"problem must be a passes.solver.ilp.Problem, got {type(problem).__name__}")
    costs = [np.asarray(c.cost, dtype=np.float64).copy() for c in problem.choices]
    if not costs:
        costs = [np.zeros(1)]
    n = len(costs)
    usages = [np.zeros(len(c)) for c in costs]
    intervals = [(0, 0)] * n
    edges: list[tuple[int, int]] = []
    matrices: list[np.ndarray] = []
    for factor in problem.factors:
        table = np.asarray(factor.table, dtype=np.float64)[np.ix_(factor.rows, factor.cols)]
        if factor.a == factor.b:
            costs[factor.a] = costs[factor.a] + np.diag(table)
        else:
            edges.append((factor.a, factor.b))
            matrices.append(table)
    costs[0] = costs[0] + float(problem.constant)
    if problem.memory_terms:
        placed: set[int] = set()
        for term in problem.memory_terms:
            usage = np.asarray(term.usage, dtype=np.float64)
            if term.choice not in placed:
                placed.add(term.choice)
                usages[term.choice] = usage.copy()
                intervals[term.choice] = (term.start, term.end)
                continue
            k = len(usage)
            costs.append(np.zeros(k))
            usages.append(usage.copy())
            intervals.append((term.start, term.end))
            edges.append((term.choice, len(costs) - 1))
            tie = np.full((k, k), np.inf)
            np.fill_diagonal(tie, 0.0)
            matrices.append(tie)
    elif problem.choices:
        usages = [np.asarray(c.memory, dtype=np.float64).copy() for c in problem.choices]
        intervals = [(0, 1)] * n
    return StrategyProblem(
        tuple(costs), tuple(usages), np.array(intervals, dtype=np.int64).reshape(-1, 2),
        np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(matrices),
        None if memory_budget is None else float(memory_budget), name=name,
    )


def _number(value: float) -> int | float:
    """A cost or usage as the files write it: an integer where it is whole, 1e18 for ``inf``."""
    if math.isinf(value):
        return int(FORBIDDEN_COST)
    return int(value) if value == int(value) and abs(value) < 2**63 else value


def write_iopddl(
    problem: StrategyProblem | ilp.Problem,
    path: str | os.PathLike,
    *,
    memory_budget: float | None = None,
    cost_scale: float | None = None,
    name: str | None = None,
) -> None:
    """Write ``problem`` to ``path`` in the contest's JSON format (gzipped if ``path`` ends in
    ``.gz``); ``read_iopddl`` reads back an equal problem. An ``ilp.Problem`` (the FX front's)
    is written as ``as_strategy_problem(problem, memory_budget)``; ``memory_budget`` is only for
    it. Forbidden choices are written as 1e18, whole numbers as integers. ``cost_scale``:
    costs are multiplied by it and rounded to integers (the contest's solvers read integer
    costs: the FX front's seconds need e.g. ``1e9``, nanoseconds); ``None`` writes them as they
    are (floats where they are not whole).
    """
    if isinstance(problem, ilp.Problem):
        problem = as_strategy_problem(problem, memory_budget)
    elif not isinstance(problem, StrategyProblem):
        raise TypeError(f"problem must be a StrategyProblem or a passes.solver.ilp.Problem, got {type(problem).__name__}")
    elif memory_budget is not None:
        raise ValueError("memory_budget is for an ilp.Problem: a StrategyProblem carries its usage_limit")
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
                "costs": [costs(c) for c in problem.node_costs],
                "usages": [[_number(v) for v in u.tolist()] for u in problem.node_usages],
            },
            "edges": {"nodes": problem.edges.tolist(), "costs": [costs(m) for m in problem.edge_costs]},
        }
    }
    if problem.usage_limit is not None:
        data["problem"]["usage_limit"] = _number(float(problem.usage_limit))
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(data, f)
