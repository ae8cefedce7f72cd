"""Feasible problems get a plan: the feasibility phase (``passes.solver.feasible``).

``families.contest_like`` problems with the contest files' share of forbidden pairs (0.35) or
more have a planted plan, so they are feasible; before the feasibility phase, ``solve_problem``
raised ``NoPlanFoundError`` on many of them (the greedy constructions left a few forbidden
pairs, and neither the integer programs nor toulbar2 repaired them in the time). Every plan is
checked by an evaluator that reads only the problem's raw arrays (not the solver's
``problem_cost`` / ``peak_usage``). The repair itself is checked against brute force on small
problems with many forbidden pairs, with and without a memory limit."""

import math
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.solver import InfeasiblePlacementError, StrategyProblem, feasible, solve_problem
from passes.solver.families import contest_like_planted
from passes.solver.feasible import forbidden_edges, repair_forbidden
from passes.solver.reduce import Reduced
from passes.solver.search import Search
from tests.helpers.random_problems import brute_force, forbidden_as_1e18_problem


def evaluate(problem, plan):
    """(cost, peak memory) of ``plan`` read off the problem's arrays alone; ``inf`` cost if a
    choice is forbidden (a cost of 1e18 or more, the contest files' infinity)."""
    plan = [int(a) for a in plan]
    assert len(plan) == problem.num_nodes
    terms = [float(c[a]) for c, a in zip(problem.node_costs, plan)]
    for k, (i, j) in enumerate(problem.edges.tolist()):
        m = problem.edge_costs[k]
        if problem.edge_classes is not None and problem.edge_classes[k] is not None:
            rows, cols = problem.edge_classes[k]
            terms.append(float(m[rows[plan[i]], cols[plan[j]]]))
        else:
            terms.append(float(m[plan[i], plan[j]]))
    cost = math.inf if any(not t < 1e18 for t in terms) else math.fsum(terms) + problem.constant
    # Memory: per time step, the chosen usages of the nodes live then (a sweep over start and end events).
    events = {}
    for v, (start, end) in enumerate(problem.intervals.tolist()):
        if end > start:
            used = float(problem.node_usages[v][plan[v]])
            events[start] = events.get(start, 0.0) + used
            events[end] = events.get(end, 0.0) - used
    peak, live = 0.0, 0.0
    for step in sorted(events):
        live += events[step]
        peak = max(peak, live)
    return cost, peak


# (seed, nodes, forbidden share): before the feasibility phase, each raised NoPlanFoundError at
# this time limit (measured; the machine's load changes which, so several).
HARD = [(0, 1000, 0.5), (0, 3000, 0.35), (1, 3000, 0.5), (2, 2000, 0.5)]
TIME_LIMIT = 3.0


@pytest.mark.parametrize("seed, nodes, forbidden", HARD)
def test_generated_problems_with_many_forbidden_pairs_get_a_plan_in_time(seed, nodes, forbidden):
    problem, planted = contest_like_planted(seed, nodes, forbidden=forbidden)
    planted_cost, planted_peak = evaluate(problem, planted)
    assert math.isfinite(planted_cost) and planted_peak <= problem.usage_limit  # (the generator's promise)
    began = time.perf_counter()
    solution = solve_problem(problem, time_limit=TIME_LIMIT)
    seconds = time.perf_counter() - began
    cost, peak = evaluate(problem, solution.strategies)
    assert math.isfinite(cost), "the plan makes a forbidden choice"
    assert peak <= problem.usage_limit
    assert cost == pytest.approx(solution.cost, rel=1e-12)
    assert solution.lower_bound <= cost
    assert seconds <= TIME_LIMIT + max(1.0, 0.02 * TIME_LIMIT)


def small_search(problem):
    """The search of ``problem`` with no reduction but the required steps (forbidden strategies
    dropped, the memory rows: the reductions alone would solve most small problems), every
    node on its smallest usage (within the memory limit whenever any plan is); None if those
    steps prove it infeasible."""
    reduced = Reduced(problem)
    try:
        reduced.reduce(problem.usage_limit, deadline=0.0)
    except InfeasiblePlacementError:
        return None
    search = Search(reduced, seed=0)
    search.start(least_usage=True)
    return search


many_forbidden = st.builds(
    lambda seed, nodes, edges, forbid, memory: forbidden_as_1e18_problem(
        np.random.default_rng(seed), nodes, 4, edges, forbid, 0.1, memory, limit="near_least"
    ),
    seed=st.integers(0, 2**32 - 1),
    nodes=st.integers(2, 7),
    edges=st.integers(1, 12),
    forbid=st.sampled_from([0.2, 0.35, 0.5]),
    memory=st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=many_forbidden, seed=st.integers(0, 3), stall=st.sampled_from([feasible._STALL, 0]))
def test_the_repair_finds_a_plan_exactly_when_one_exists(case, seed, stall):
    # (``stall=0``: the exact neighbourhood search at once, not only where min-conflicts stalls.)
    problem, raw = case
    best = brute_force(raw)
    search = small_search(problem)
    if search is None:
        assert math.isinf(best)  # (the reductions' proof)
        return
    # A random start within the limit: memory nodes on their smallest usage, the others anywhere.
    rng = np.random.default_rng(seed)
    start = [a if search.memory[v] else int(rng.integers(len(search.cost[v]))) for v, a in enumerate(search.s.tolist())]
    search.assign(np.array(start, dtype=np.int64))
    if search.violation() > 0:
        assert math.isinf(best)  # (the least usages break the limit)
        return
    with mock.patch.object(feasible, "_STALL", stall):
        found = repair_forbidden(search, time.perf_counter() + 5.0, seed)
    assert search.violation() == 0  # every move kept the limit, found or not
    assert found == math.isfinite(best)
    if found:
        assert not len(forbidden_edges(search))
        cost, peak = evaluate(problem, search.plan())
        assert math.isfinite(cost) and cost >= best - 1e-9
        assert problem.usage_limit is None or peak <= problem.usage_limit


def test_a_forbidden_pair_locked_by_memory_is_repaired_by_making_room():
    # Nodes 0 and 1 are joined by a forbidden pair that either leaves by taking 5 more units;
    # node 2, live at the same time, holds the 5 units the limit allows and can give them up
    # (a dearer strategy, no forbidden pair): the repair must move it first. (The exact
    # neighbourhood search, which would also find this, is switched off.)
    problem = StrategyProblem(
        [[0.0, 1.0], [0.0, 1.0], [0.0, 7.0]],
        [[0.0, 5.0], [0.0, 5.0], [5.0, 0.0]],
        [[0, 2], [0, 2], [0, 2]],
        [[0, 1]],
        [[[1e18, 0.0], [0.0, 1e18]]],
        usage_limit=5.0,
    )
    reduced = Reduced(problem)
    reduced.reduce(problem.usage_limit, deadline=0.0)
    search = Search(reduced, seed=0)
    local = {int(v): k for k, v in enumerate(search.nodes)}
    search.assign(np.array([0, 0, 0])[search.nodes])  # within the limit, the pair forbidden
    assert len(forbidden_edges(search)) == 1 and search.violation() == 0
    with mock.patch.object(feasible, "_STALL", 0), mock.patch.object(feasible._Repair, "exact", lambda *args: (False, False)):
        assert repair_forbidden(search, time.perf_counter() + 2.0)
    cost, peak = evaluate(problem, search.plan())
    assert math.isfinite(cost) and peak <= 5.0
    assert search.plan()[2] == 1 and search.s[local[2]] == 1
