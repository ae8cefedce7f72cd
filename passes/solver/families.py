"""Generated ``StrategyProblem`` families, for tests and measurements beyond four instances.

``contest_like(seed, nodes)``: a random problem with the statistics of the IOPDDL contest's
public files (measured on instances G and S): 3% of nodes with one strategy, a median of 4-11
strategies and a tail to ~40; about 1.35 edges per node, most between nearby nodes (a
program's data flow) and some across the program (a forward value read by the backward);
83% of node costs zero, the rest spread over six decades; per edge a layout-change table
(zero where the two layouts agree, a cost that grows with the size of the value otherwise)
with about a third of its pairs forbidden; most values live for two steps, a tenth for most
of the program (activations saved for the backward), each strategy's usage the value's
bytes over its sharding; a usage limit ``tightness`` times the least peak (the files: 1.10).
A plan is planted (every one of its pairs allowed, the long-lived values on their smallest
usage; the limit raised to its peak if that is above), so the problem is feasible; its cost is an upper bound on the optimum, not the optimum.
"""

from __future__ import annotations

import numpy as np

from passes.solver.problem import StrategyProblem, peak_usage

__all__ = ["contest_like", "contest_like_planted"]


def contest_like(
    seed: int,
    nodes: int = 2000,
    *,
    tightness: float | None = 1.1,
    forbidden: float = 0.35,
    max_strategies: int = 40,
) -> StrategyProblem:
    """A feasible random problem with the contest files' statistics (see the module docstring).

    ``tightness``: the usage limit over the least peak (``None``: no limit); ``forbidden``: the
    share of each edge's pairs that are forbidden (outside the planted plan's)."""
    return contest_like_planted(seed, nodes, tightness=tightness, forbidden=forbidden, max_strategies=max_strategies)[0]


def contest_like_planted(
    seed: int,
    nodes: int = 2000,
    *,
    tightness: float | None = 1.1,
    forbidden: float = 0.35,
    max_strategies: int = 40,
) -> tuple[StrategyProblem, list[int]]:
    """``contest_like``'s problem and its planted plan (a strategy per node: every pair it
    makes allowed, within the usage limit), a witness that the problem is feasible."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes!r}")
    if tightness is not None and tightness < 1.0:
        raise ValueError(f"tightness must be >= 1 (the least peak always fits) or None, got {tightness!r}")
    rng = np.random.default_rng(seed)
    one = rng.uniform(size=nodes) < 0.03
    sizes = np.where(one, 1, np.minimum(max_strategies, 2 + rng.geometric(0.12, size=nodes))).astype(np.int64)
    # A strategy is a layout (an integer label) and a sharding factor (how far it divides the value).
    layouts = [rng.integers(0, 2 * k + 1, size=k) for k in sizes]
    shards = [2.0 ** rng.integers(0, 6, size=k) for k in sizes]
    shards = [np.where(np.arange(len(s)) == 0, 1.0, s) for s in shards]  # strategy 0: replicated
    size_of = 10.0 ** rng.uniform(2, 7.5, size=nodes)  # bytes of each value
    plan = np.array([int(rng.integers(k)) for k in sizes])
    costs = []
    for k in sizes:
        c = np.zeros(k)
        paid = rng.uniform(size=k) < 0.17
        c[paid] = np.round(10.0 ** rng.uniform(0, 6.5, size=int(paid.sum())))
        costs.append(c)
    usages = [np.round(b / s) for b, s in zip(size_of, shards)]
    # Lifetimes: most values for two steps, a tenth until late in the program.
    steps = 2 * nodes
    starts = np.sort(rng.integers(0, steps, size=nodes))
    long = rng.uniform(size=nodes) < 0.1
    lengths = np.where(long, rng.integers(steps // 4, steps, size=nodes), 2)
    intervals = np.stack([starts, np.minimum(starts + lengths, steps + 1)], axis=1)
    empty = rng.uniform(size=nodes) < 0.06  # never live (as in the files)
    intervals[empty, 1] = intervals[empty, 0]
    # The planted plan keeps the long-lived values on their smallest usage (so it fits a tight limit).
    for v in np.flatnonzero(long).tolist():
        plan[v] = int(np.argmin(usages[v]))
    # Edges: each node reads one or two earlier nodes, most nearby, some across the program.
    pairs = []
    for j in range(1, nodes):
        reads = 1 + int(rng.uniform() < 0.35)
        for _ in range(reads):
            if rng.uniform() < 0.85:
                i = max(0, j - int(rng.geometric(0.15)))
            else:
                i = int(rng.integers(0, j))
            if i != j:
                pairs.append((i, j))
    matrices = []
    for i, j in pairs:
        same = layouts[i][:, None] == layouts[j][None, :]
        moved = np.round(size_of[i] * (0.5 + rng.uniform(size=(sizes[i], sizes[j]))) / shards[j][None, :])
        m = np.where(same, 0.0, moved)
        m[rng.uniform(size=m.shape) < forbidden] = np.inf
        m[plan[i], plan[j]] = 0.0 if same[plan[i], plan[j]] else moved[plan[i], plan[j]]
        matrices.append(m)
    edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    limit = None
    if tightness is not None:
        # (Peaks of a problem without edges: a problem's validation of every table, twice,
        # took 40% of the generation.)
        probe = StrategyProblem(costs, usages, intervals, np.zeros((0, 2), np.int64), [])
        least = peak_usage(probe, [int(np.argmin(u)) for u in usages])
        limit = float(np.ceil(least * tightness))
        limit = max(limit, peak_usage(probe, plan))
    problem = StrategyProblem(costs, usages, intervals, edges, matrices, limit, name=f"contest-like-{seed}-{nodes}")
    return problem, plan.tolist()
