"""Small random ``StrategyProblem``s whose forbidden pairs and strategies carry the contest
files' infinity (1e18, a finite number; or ``inf``, as ``read_iopddl`` gives them), with their
raw arrays, and a brute force over those arrays that knows nothing of the solver's conventions.

One generator for the tests of the solver's engines and of the core (``test_solver_engines``,
``test_solver_problem``, ``test_solver_iopddl_io``); its options keep each test's distribution,
and the draws from a seed are the same as those tests' own generators drew."""

from __future__ import annotations

import itertools
import math

import numpy as np

from passes.solver import StrategyProblem, peak_usage

__all__ = ["forbidden_as_1e18_problem", "brute_force"]

_LIMITS = ("spread", "near_least", "tight")


def forbidden_as_1e18_problem(
    rng: np.random.Generator,
    nodes: int,
    strategies: int,
    edges: int,
    forbid: float,
    forbid_own: float,
    memory: bool,
    large: bool = False,
    infinity: float = 1e18,
    *,
    limit: str = "spread",
    cost_top: int = 20,
    start_top: int = 6,
) -> tuple[StrategyProblem, tuple]:
    """A random problem and its raw arrays ``(costs, usages, intervals, pairs, matrices, limit)``.

    Each node has 1..``strategies`` strategies, costs and pair costs whole numbers below
    ``cost_top``, a strategy forbidden (cost ``infinity``) with probability ``forbid_own``, a
    pair with ``forbid``; with ``large``, some allowed costs just below 1e18. Usages below 10,
    live from a step below ``start_top`` for 0..3 steps; ``edges`` random pairs of nodes. With
    ``memory``, a usage limit: ``"spread"`` anywhere from 2 below the least peak to the largest;
    ``"near_least"`` from 1 below the least peak, half the time at most 3 above it (the memory
    rows bind), else up to the largest; ``"tight"`` the least peak (the cheapest plans break it)."""
    if limit not in _LIMITS:
        raise ValueError(f"limit must be one of {list(_LIMITS)}, got {limit!r}")
    sizes = rng.integers(1, strategies + 1, size=nodes)
    big = [1e15, 3e17, 9.9e17]
    costs = []
    for k in sizes:
        c = rng.integers(0, cost_top, size=k).astype(float)
        c[rng.uniform(size=k) < forbid_own] = infinity
        if large:
            c[rng.uniform(size=k) < 0.2] = rng.choice(big)
        costs.append(c)
    usages = [rng.integers(0, 10, size=k).astype(float) for k in sizes]
    starts = rng.integers(0, start_top, size=nodes)
    intervals = np.stack([starts, starts + rng.integers(0, 4, size=nodes)], axis=1)
    pairs = [tuple(int(v) for v in rng.choice(nodes, size=2, replace=False)) for _ in range(edges)] if nodes > 1 else []
    matrices = []
    for i, j in pairs:
        m = rng.integers(0, cost_top, size=(sizes[i], sizes[j])).astype(float)
        m[rng.uniform(size=m.shape) < forbid] = infinity
        if large:
            m[rng.uniform(size=m.shape) < 0.1] = rng.choice(big)
        matrices.append(m)
    usage_limit = None
    if memory:
        probe = StrategyProblem(costs, usages, intervals, np.array(pairs).reshape(-1, 2), matrices)
        least = peak_usage(probe, [int(np.argmin(u)) for u in usages])
        most = peak_usage(probe, [int(np.argmax(u)) for u in usages])
        if limit == "tight":
            usage_limit = float(least)
        elif limit == "near_least":
            usage_limit = float(rng.integers(max(0, least - 1), (least + 3 if rng.uniform() < 0.5 else most) + 1))
        else:
            usage_limit = float(rng.integers(max(0, least - 2), most + 1))
    raw = (costs, usages, intervals, pairs, matrices, usage_limit)
    return StrategyProblem(costs, usages, intervals, np.array(pairs).reshape(-1, 2), matrices, usage_limit), raw


def brute_force(raw: tuple) -> float:
    """The least cost of a plan that pays no 1e18 (or more) and meets the limit, from the raw
    arrays (``inf``: no such plan)."""
    costs, usages, intervals, pairs, matrices, limit = raw
    best = math.inf
    steps = range(int(intervals[:, 1].max(initial=0)) + 1)
    for plan in itertools.product(*(range(len(c)) for c in costs)):
        terms = [costs[v][a] for v, a in enumerate(plan)] + [m[plan[i], plan[j]] for (i, j), m in zip(pairs, matrices)]
        if any(t >= 1e18 for t in terms):
            continue
        if limit is not None:
            load = [sum(usages[v][a] for v, a in enumerate(plan) if intervals[v, 0] <= t < intervals[v, 1]) for t in steps]
            if max(load, default=0.0) > limit:
                continue
        best = min(best, math.fsum(terms))
    return best
