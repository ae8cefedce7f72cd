"""OR-Tools CP-SAT on the solver core's problems, against ``solve_problem`` at the same limit.

The issue asks for each maintained engine to be measured on generated families and used where
it wins. This models a ``StrategyProblem`` for CP-SAT directly (an integer variable per node;
a table constraint per edge over its allowed strategy pairs and their costs, forbidden pairs
left out of the table; node costs and usages by element constraints; the memory limit as one
linear constraint per interval start, where the set of live values can grow) and solves it
with CP-SAT's portfolio on the machine's cores, then runs ``solve_problem(search="auto")`` on
the same problem with the same limit. Costs are scaled to integers (CP-SAT's objective); the
plan each returns is priced by ``problem_cost`` and checked by ``peak_usage`` (an independent
evaluation), and each bound is its engine's own (CP-SAT's scaled back, less the rounding).

Measured (torch 2.13 venv, ortools 9.15, CP-SAT on 2 workers, the 2-core machine shared with
other work, load ~3; ``families.contest_like``, 300 and 1000 nodes, no limit and 1.1x the least
peak, seeds 0 and 1, 10 s): with either formulation CP-SAT found no plan on any of the 8
problems (status UNKNOWN; building the model took another 0-5 s past the limit), where
``solve_problem`` found the best plan on all 8 and proved it optimal on 6 (1.0-3 s; the other
two within 0.1% / 3% of their bounds at 9.6 s). Given 30 s on the 300-node problem without a
limit, CP-SAT's plan cost 1.21x the optimum ``solve_problem`` proved in 0.8 s, its bound 0.71x.
So CP-SAT is not in the portfolio: on this class it loses to HiGHS over the reduced problem
and to toulbar2 at every size measured.

| nodes | tightness | seed | auto cost | auto bound | auto s | cp-sat (table) s | cp-sat (local) s |
|---|---|---|---|---|---|---|---|
| 300 | None | 0 | 1.0000 | 1.0000 | 1.9 | no plan, 12.0 | no plan, 12.9 |
| 300 | None | 1 | 1.0000 | 1.0000 | 0.8 | no plan, 8.1 | no plan, 9.0 |
| 300 | 1.1 | 0 | 1.0000 | 1.0000 | 0.9 | no plan, 9.9 | no plan, 9.6 |
| 300 | 1.1 | 1 | 1.0000 | 1.0000 | 1.2 | no plan, 10.7 | no plan, 9.9 |
| 1000 | None | 0 | 1.0000 | 1.0000 | 2.8 | no plan, 11.4 | no plan, 12.9 |
| 1000 | None | 1 | 1.0000 | 1.0000 | 3.0 | no plan, 9.5 | no plan, 15.2 |
| 1000 | 1.1 | 0 | 1.0000 | 0.9991 | 9.4 | no plan, 10.1 | no plan, 12.7 |
| 1000 | 1.1 | 1 | 1.0000 | 0.9713 | 9.6 | no plan, 7.9 | no plan, 15.5 |

Needs ``ortools`` (``pip install ortools``; not a dependency of the package).

Usage: python benchmarks/cpsat.py [--time-limit S] [--sizes 500,2000] [--seeds 0,1]
       [--tightness none,1.1] [--formulation local,table]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from passes.solver import NoPlanFoundError, peak_usage, problem_cost, solve_problem  # noqa: E402
from passes.solver.families import contest_like  # noqa: E402


def _scale_of(problem) -> float:
    """A factor making every finite cost an integer without losing what tells plans apart:
    1 when they are integers already, else one putting the largest near 1e9."""
    finite = [c[np.isfinite(c)] for c in problem.node_costs] + [
        problem.edge_matrix(k)[np.isfinite(problem.edge_matrix(k))] for k in range(len(problem.edges))
    ]
    values = np.concatenate([f.ravel() for f in finite]) if finite else np.zeros(0)
    if not len(values) or np.all(values == np.round(values)):
        return 1.0
    return 1e9 / max(1.0, float(np.abs(values).max()))


def solve_cpsat(problem, time_limit: float, workers: int = 2, formulation: str = "table"):
    """CP-SAT's best plan (a strategy per node, or ``None``), its lower bound, and its status.

    ``formulation``: ``"table"`` (an integer per node, a table constraint per edge) or
    ``"local"`` (a Boolean per strategy and per allowed pair, tied by the marginal equalities of
    the local polytope: the integer program an LP-based search would solve)."""
    if formulation == "local":
        return _solve_local(problem, time_limit, workers)
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    scale = _scale_of(problem)
    choice = [model.NewIntVar(0, len(c) - 1, f"s{i}") for i, c in enumerate(problem.node_costs)]
    objective = []
    rounding = 0.0
    for i, costs in enumerate(problem.node_costs):
        allowed = [a for a in range(len(costs)) if math.isfinite(costs[a])]
        model.AddAllowedAssignments([choice[i]], [(a,) for a in allowed])
        if np.any(costs[allowed] != 0):
            scaled = [int(round(costs[a] * scale)) if a in allowed else 0 for a in range(len(costs))]
            rounding += 0.5 * (scale != 1.0)
            cost = model.NewIntVar(min(scaled), max(scaled), f"c{i}")
            model.AddElement(choice[i], scaled, cost)
            objective.append(cost)
    for k, (i, j) in enumerate(problem.edges.tolist()):
        matrix = problem.edge_matrix(k)
        pairs = np.argwhere(np.isfinite(matrix))
        scaled = np.round(matrix[np.isfinite(matrix)] * scale).astype(np.int64)
        if len(pairs) == matrix.size and not scaled.any():
            continue  # every pair allowed and free
        cost = model.NewIntVar(int(scaled.min()) if len(scaled) else 0, int(scaled.max()) if len(scaled) else 0, f"e{k}")
        model.AddAllowedAssignments([choice[i], choice[j], cost], [(int(a), int(b), int(c)) for (a, b), c in zip(pairs, scaled)])
        if scaled.any():
            objective.append(cost)
            rounding += 0.5 * (scale != 1.0)
    if problem.usage_limit is not None:
        usage = []
        for i, u in enumerate(problem.node_usages):
            if np.any(u != 0):
                var = model.NewIntVar(int(u.min()), int(u.max()), f"u{i}")
                model.AddElement(choice[i], [int(x) for x in u], var)
                usage.append(var)
            else:
                usage.append(None)
        starts, ends = problem.intervals[:, 0], problem.intervals[:, 1]
        for t in sorted(set(starts.tolist())):
            live = [usage[i] for i in np.flatnonzero((starts <= t) & (t < ends)) if usage[i] is not None]
            if live:
                model.Add(sum(live) <= int(math.floor(problem.usage_limit)))
    solver, status, found = _minimize(model, objective, time_limit, workers)
    if not found:
        return None, -math.inf, status
    plan = [int(solver.Value(v)) for v in choice]
    return plan, (solver.BestObjectiveBound() - rounding) / scale + problem.constant, status


def _solve_local(problem, time_limit: float, workers: int):
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    scale = _scale_of(problem)
    x = [[model.NewBoolVar(f"x{i}_{a}") for a in range(len(c))] for i, c in enumerate(problem.node_costs)]
    terms, rounding = [], 0.0
    for i, costs in enumerate(problem.node_costs):
        model.AddExactlyOne(x[i])
        for a, c in enumerate(costs):
            if not math.isfinite(c):
                model.Add(x[i][a] == 0)
            elif c:
                terms.append(int(round(c * scale)) * x[i][a])
                rounding += 0.5 * (scale != 1.0)
    for k, (i, j) in enumerate(problem.edges.tolist()):
        matrix = problem.edge_matrix(k)
        finite = np.isfinite(matrix)
        if finite.all() and not matrix.any():
            continue
        y = {}
        for a, b in np.argwhere(finite).tolist():
            y[a, b] = model.NewBoolVar(f"y{k}_{a}_{b}")
            if matrix[a, b]:
                terms.append(int(round(matrix[a, b] * scale)) * y[a, b])
                rounding += 0.5 * (scale != 1.0)
        for a in range(matrix.shape[0]):
            model.Add(sum(y[a, b] for b in range(matrix.shape[1]) if (a, b) in y) == x[i][a])
        for b in range(matrix.shape[1]):
            model.Add(sum(y[a, b] for a in range(matrix.shape[0]) if (a, b) in y) == x[j][b])
    if problem.usage_limit is not None:
        starts, ends = problem.intervals[:, 0], problem.intervals[:, 1]
        for t in sorted(set(starts.tolist())):
            live = np.flatnonzero((starts <= t) & (t < ends))
            row = [int(u) * x[i][a] for i in live for a, u in enumerate(problem.node_usages[i]) if u]
            if row:
                model.Add(sum(row) <= int(math.floor(problem.usage_limit)))
    solver, status, found = _minimize(model, terms, time_limit, workers)
    if not found:
        return None, -math.inf, status
    plan = [next(a for a, v in enumerate(row) if solver.Value(v)) for row in x]
    return plan, (solver.BestObjectiveBound() - rounding) / scale + problem.constant, status


def _minimize(model, terms: list, time_limit: float, workers: int):
    """CP-SAT's solver after minimizing ``sum(terms)`` for ``time_limit`` s, its status's name,
    and whether it found a plan."""
    from ortools.sat.python import cp_model

    model.Minimize(sum(terms))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    return solver, solver.StatusName(status), status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def _ours(problem, limit: float) -> tuple[float, float, float]:
    began = time.perf_counter()
    try:
        solution = solve_problem(problem, time_limit=limit)
    except NoPlanFoundError:
        return math.inf, -math.inf, time.perf_counter() - began
    seconds = time.perf_counter() - began
    cost = problem_cost(problem, solution.strategies)
    assert problem.usage_limit is None or peak_usage(problem, solution.strategies) <= problem.usage_limit
    return cost, solution.lower_bound, seconds


def _cpsat(problem, limit: float, formulation: str) -> tuple[float, float, float, str]:
    began = time.perf_counter()
    plan, lower, status = solve_cpsat(problem, limit, formulation=formulation)
    seconds = time.perf_counter() - began
    if plan is None:
        return math.inf, lower, seconds, status
    assert problem.usage_limit is None or peak_usage(problem, plan) <= problem.usage_limit
    return problem_cost(problem, plan), lower, seconds, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--sizes", default="500,2000")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tightness", default="none,1.1")
    parser.add_argument("--formulation", default="local", choices=["local", "table"])
    args = parser.parse_args()
    limit = args.time_limit
    tightness = [None if t == "none" else float(t) for t in args.tightness.split(",")]
    print(f"time limit {limit:g} s (CP-SAT's includes building its model); relative to the better plan")
    print("| nodes | tightness | seed | auto cost | auto bound | auto s | cp-sat cost | cp-sat bound | cp-sat s | cp-sat status |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"auto": [], "cp-sat": []}
    for nodes in [int(n) for n in args.sizes.split(",")]:
        for tight in tightness:
            for seed in [int(s) for s in args.seeds.split(",")]:
                problem = contest_like(seed, nodes, tightness=tight)
                ours = _ours(problem, limit)
                theirs = _cpsat(problem, limit, args.formulation)
                best = min(ours[0], theirs[0])
                ratios["auto"].append(ours[0] / best)
                ratios["cp-sat"].append(theirs[0] / best)
                print(
                    f"| {nodes} | {tight} | {seed} | {ours[0] / best:.4f} | {ours[1] / best:.4f} | {ours[2]:.1f} | "
                    f"{theirs[0] / best:.4f} | {theirs[1] / best:.4f} | {theirs[2]:.1f} | {theirs[3]} |",
                    flush=True,
                )
    for engine, values in ratios.items():
        finite = [r for r in values if math.isfinite(r)]
        geo = math.exp(sum(math.log(r) for r in finite) / len(finite)) if finite else math.inf
        print(f"{engine}: geometric mean cost/best {geo:.4f}, worst {max(values):.4f}, no plan {len(values) - len(finite)}")


if __name__ == "__main__":
    main()
