"""The solver's core as a plain problem: strategies per node, pair costs per edge, memory over time.

A ``StrategyProblem`` has nodes, each with strategies (a cost, a memory usage, and the interval
of time steps ``[start, end)`` during which the node is live), edges with a cost per pair of
strategies of their two nodes, and a memory limit per device: at every time step the usages of
the live nodes' chosen strategies sum to at most ``usage_limit``. A solution picks one strategy
per node; its cost is the sum of the chosen node costs and edge costs (``inf`` costs are
forbidden choices). This is the problem of XLA's auto-sharding and of the IOPDDL contest
(``passes.solver.read_iopddl`` reads its files).

``solve_problem`` solves it within a time limit:

1. exact reductions (each keeps every optimum's cost): parallel edges merged; an edge's
   separable part (``u[a] + v[b]``) folded into its nodes' costs, and edges left all-zero
   dropped; strategies that are forbidden whatever the neighbours do, or dominated (no cheaper,
   no larger, and no worse on any edge than another strategy) dropped; memory constraints that
   no choice can break dropped, and those implied by a later time step's dropped (only the
   last start before some node ends can bind); nodes whose usage no remaining constraint sees
   are memory-free, and a memory-free node with at most two neighbours is eliminated (a leaf's
   minimum, a chain link's min-plus product) -- a node whose usage matters is never eliminated;
2. a primal heuristic: the cheapest strategies improved by coordinate descent (each node
   moves to its cheapest strategy given its neighbours), kept if within the memory limit; and
   greedy constructions (nodes assigned in order, each to the cheapest, or the smallest-usage,
   strategy that leaves every unassigned neighbour a strategy of finite cost and fits the
   memory left, the unassigned counted at their smallest usage, which fits whenever anything
   does), each improved by coordinate descent that keeps to the memory left over a node's
   lifetime; the best is the incumbent;
3. HiGHS's MILP (one binary per strategy; per edge a continuous variable per finite pair whose
   row and column sums equal the two nodes' binaries; a row per memory constraint), on the whole
   reduced problem when it is small, and otherwise on neighbourhoods of the incumbent (large
   neighbourhood search: a connected set of nodes around a random node, or, two rounds in
   three, one started where the incumbent pays most above the node minima and grown towards
   such nodes, is freed and the rest stay fixed; one memory row per stretch of time in
   which the same freed nodes are live), each started from the incumbent, which is never made
   worse. While the incumbent still has a forbidden pair, or breaks the memory limit, those
   are priced instead of excluded, so each neighbourhood is feasible and repairs what it can.

The result carries the best solution found, its cost, and a certified lower bound: the MILP's
dual bound on the whole reduced problem (HiGHS stops at a relative gap of 1e-7; with integer
costs, rounded up), or else the reduced problem's sum of node minima (weak).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from typing import Sequence

import numpy as np

from passes.solver.deadline import CANCEL_GRACE, solve_model_by, start_workers, wait_for_workers
from passes.solver.ilp import InfeasiblePlacementError, NoPlanFoundError

__all__ = ["StrategyProblem", "ProblemSolution", "solve_problem", "problem_cost", "peak_usage"]


# A cost at or above this is a forbidden choice (the IOPDDL contest's convention: its files
# write one as 1e18). Such costs are ``inf`` from the start: sums of several of them would lose
# every other cost to rounding (1e18 + 5 == 1e18), and a plan with one is no plan.
FORBIDDEN_COST = 1e18


def _forbidden_as_inf(costs: np.ndarray) -> np.ndarray:
    return np.where(costs >= FORBIDDEN_COST, np.inf, costs) if (costs >= FORBIDDEN_COST).any() else costs


@dataclasses.dataclass(frozen=True)
class StrategyProblem:
    """Nodes with strategies, edges with strategy-pair costs, a memory limit over time.

    ``node_costs[i]`` / ``node_usages[i]``: per strategy of node i (same length, at least one);
    ``intervals[i]``: ``(start, end)``, node i is live at the time steps ``start <= t < end``;
    ``edges[k]``: ``(i, j)``; ``edge_costs[k]``: a ``len(node_costs[i]) x len(node_costs[j])``
    matrix, the cost when i takes strategy a and j strategy b (``inf``, or any cost of at least
    ``FORBIDDEN_COST`` = 1e18, the IOPDDL files' infinity: forbidden; stored as ``inf``);
    ``usage_limit``: the most the live nodes may use at one time step (``None``: no limit).
    """

    node_costs: tuple[np.ndarray, ...]
    node_usages: tuple[np.ndarray, ...]
    intervals: np.ndarray
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    usage_limit: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        costs = tuple(_forbidden_as_inf(np.asarray(c, dtype=np.float64).reshape(-1)) for c in self.node_costs)
        usages = tuple(np.asarray(u, dtype=np.float64).reshape(-1) for u in self.node_usages)
        n = len(costs)
        if len(usages) != n:
            raise ValueError(f"node_usages has {len(usages)} entries, expected one per node ({n})")
        for i, (c, u) in enumerate(zip(costs, usages)):
            if len(c) == 0:
                raise ValueError(f"node_costs[{i}] is empty: every node needs at least one strategy")
            if len(u) != len(c):
                raise ValueError(f"node_usages[{i}] has {len(u)} entries, expected {len(c)} (one per strategy)")
            if np.isnan(c).any() or np.isnan(u).any() or (u < 0).any() or np.isinf(u).any():
                raise ValueError(f"node {i}: costs must not be NaN and usages must be finite and >= 0")
        intervals = np.asarray(self.intervals, dtype=np.int64).reshape(-1, 2) if n else np.zeros((0, 2), np.int64)
        if len(intervals) != n:
            raise ValueError(f"intervals has {len(intervals)} rows, expected one (start, end) per node ({n})")
        edges = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2) if len(self.edges) else np.zeros((0, 2), np.int64)
        if len(edges) != len(self.edge_costs):
            raise ValueError(f"edges has {len(edges)} rows but edge_costs has {len(self.edge_costs)} matrices")
        if len(edges) and (edges.min() < 0 or edges.max() >= n):
            raise ValueError(f"edges name nodes outside 0..{n - 1}")
        matrices = []
        for k, ((i, j), m) in enumerate(zip(edges.tolist(), self.edge_costs)):
            m = np.asarray(m, dtype=np.float64)
            shape = (len(costs[i]), len(costs[j]))
            if m.size != shape[0] * shape[1]:
                raise ValueError(f"edge_costs[{k}] has {m.size} entries, expected {shape[0]}x{shape[1]} for edge {(i, j)}")
            if np.isnan(m).any():
                raise ValueError(f"edge_costs[{k}] has NaN entries")
            matrices.append(_forbidden_as_inf(m.reshape(shape)))
        if self.usage_limit is not None and not (float(self.usage_limit) >= 0):
            raise ValueError(f"usage_limit must be a number >= 0 or None, got {self.usage_limit!r}")
        object.__setattr__(self, "node_costs", costs)
        object.__setattr__(self, "node_usages", usages)
        object.__setattr__(self, "intervals", intervals)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "edge_costs", tuple(matrices))

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)


@dataclasses.dataclass
class ProblemSolution:
    """``strategies``: one strategy index per node, in the problem's node order; ``cost``: their
    cost; ``lower_bound``: no solution costs less; ``stats``: sizes, timings and the method."""

    strategies: list[int]
    cost: float
    lower_bound: float
    stats: dict

    @property
    def gap(self) -> float:
        """Relative distance from the lower bound (0: proven optimal)."""
        if self.cost == self.lower_bound:
            return 0.0
        return (self.cost - self.lower_bound) / max(abs(self.cost), 1e-300)


def _check_strategies(problem: StrategyProblem, strategies: Sequence[int]) -> np.ndarray:
    s = np.asarray(strategies, dtype=np.int64).reshape(-1)
    if len(s) != problem.num_nodes:
        raise ValueError(f"strategies has {len(s)} entries, expected one per node ({problem.num_nodes})")
    sizes = np.array([len(c) for c in problem.node_costs], dtype=np.int64)
    if ((s < 0) | (s >= sizes)).any():
        bad = int(np.flatnonzero((s < 0) | (s >= sizes))[0])
        raise ValueError(f"strategies[{bad}] = {s[bad]} is not a strategy of node {bad} (it has {sizes[bad]})")
    return s


def problem_cost(problem: StrategyProblem, strategies: Sequence[int]) -> float:
    """The cost of ``strategies`` (one index per node): chosen node costs plus edge costs."""
    s = _check_strategies(problem, strategies)
    total = math.fsum(float(c[a]) for c, a in zip(problem.node_costs, s.tolist()))
    total += math.fsum(float(m[s[i], s[j]]) for (i, j), m in zip(problem.edges.tolist(), problem.edge_costs))
    return total


def peak_usage(problem: StrategyProblem, strategies: Sequence[int]) -> float:
    """The most memory live at one time step under ``strategies``."""
    s = _check_strategies(problem, strategies)
    steps = _TimeSteps(problem)
    return float(steps.loads(s).max()) if steps.any_live else 0.0


class _TimeSteps:
    """The problem's time steps where some node's lifetime starts (memory only changes there),
    and each node's lifetime as indices into them (empty for a node never live)."""

    def __init__(self, problem: StrategyProblem) -> None:
        self.problem = problem
        intervals = problem.intervals
        live = intervals[:, 0] < intervals[:, 1]
        self.any_live = bool(live.any())
        self.points = np.unique(intervals[live, 0]) if self.any_live else np.zeros(1, np.int64)
        self.lo = np.searchsorted(self.points, intervals[:, 0], "left")
        self.hi = np.where(live, np.searchsorted(self.points, intervals[:, 1], "left"), self.lo)

    def loads(self, strategies: Sequence[int]) -> np.ndarray:
        """The memory live at each step under ``strategies``."""
        used = np.array([u[a] for u, a in zip(self.problem.node_usages, np.asarray(strategies).tolist())])
        delta = np.zeros(len(self.points) + 1)
        np.add.at(delta, self.lo, used)
        np.add.at(delta, self.hi, -used)
        return np.cumsum(delta)[:-1]


# =========================================================================== exact reductions

# Entries of a dominance test (strategies^2 x compared values) above which only duplicates go.
_DOMINANCE_BUDGET = 2_000_000
# Entries of a chain link's min-plus product above which the link is kept.
_ELIMINATION_BUDGET = 4_000_000


class _Reduced:
    """The problem after exact reductions; remembers how to expand a solution of what is left."""

    def __init__(self, problem: StrategyProblem) -> None:
        n = problem.num_nodes
        self.problem = problem
        self.cost = [c.copy() for c in problem.node_costs]
        self.usage = [u.copy() for u in problem.node_usages]
        self.keep = [np.arange(len(c)) for c in problem.node_costs]
        self.constant = 0.0
        self.edges: dict[int, list] = {}  # id -> [i, j, matrix (strategies of i x of j)]
        self.adjacent: list[dict[int, int]] = [dict() for _ in range(n)]  # node -> {neighbour: edge id}
        self.removed = np.zeros(n, dtype=bool)
        self.eliminated: list[tuple] = []
        self.memory_node = np.zeros(n, dtype=bool)
        self._next = 0
        self._dirty: set[int] = set()  # edges whose separable part may not be folded yet
        for (i, j), m in zip(problem.edges.tolist(), problem.edge_costs):
            self._add_edge(i, j, m.copy())

    # ------------------------------------------------------------------ edges

    def _add_edge(self, i: int, j: int, m: np.ndarray) -> None:
        if i == j:
            self.cost[i] = self.cost[i] + np.diag(m)
            return
        if j in self.adjacent[i]:
            eid = self.adjacent[i][j]
            a, _, existing = self.edges[eid]
            self.edges[eid][2] = existing + (m if a == i else m.T)
            self._dirty.add(eid)
            return
        eid = self._next
        self._next += 1
        self.edges[eid] = [i, j, m]
        self.adjacent[i][j] = eid
        self.adjacent[j][i] = eid
        self._dirty.add(eid)

    def _drop_edge(self, eid: int) -> None:
        i, j, _ = self.edges.pop(eid)
        del self.adjacent[i][j]
        del self.adjacent[j][i]

    def oriented(self, node: int, neighbour: int) -> np.ndarray:
        """The matrix of the edge node-neighbour, rows indexed by ``node``'s strategies."""
        i, _, m = self.edges[self.adjacent[node][neighbour]]
        return m if i == node else m.T

    def _normalize(self, eid: int) -> bool:
        """Fold the separable part of an edge into its nodes; drop it if nothing is left. Returns
        False if some strategy is forbidden whatever the other side does (the caller prunes)."""
        i, j, m = self.edges[eid]
        with np.errstate(invalid="ignore"):
            u = m.min(axis=1)
            if not np.isfinite(u).all():
                return False
            m = m - u[:, None]
            v = m.min(axis=0)
            if not np.isfinite(v).all():
                return False
            m = m - v[None, :]
        self.cost[i] = self.cost[i] + u
        self.cost[j] = self.cost[j] + v
        if not m.any():
            self._drop_edge(eid)
        else:
            self.edges[eid][2] = m
        return True

    # ------------------------------------------------------------------ strategies

    def _restrict(self, node: int, mask: np.ndarray) -> None:
        if mask.all():
            return
        if not mask.any():
            raise InfeasiblePlacementError(
                f"node {node} has no strategy left that some choice of its neighbours allows (every one has an infinite cost)"
            )
        self.cost[node] = self.cost[node][mask]
        self.usage[node] = self.usage[node][mask]
        self.keep[node] = self.keep[node][mask]
        for eid in self.adjacent[node].values():
            i, _, m = self.edges[eid]
            self.edges[eid][2] = m[mask] if i == node else m[:, mask]
            self._dirty.add(eid)

    def _allowed(self, node: int) -> np.ndarray:
        mask = np.isfinite(self.cost[node])
        for neighbour in self.adjacent[node]:
            mask &= np.isfinite(self.oriented(node, neighbour)).any(axis=1)
        return mask

    def _dominance(self, node: int) -> None:
        """Drop strategies another strategy is at least as good as on every count."""
        columns = [self.cost[node][:, None]]
        if self.memory_node[node]:
            columns.append(self.usage[node][:, None])
        columns += [self.oriented(node, nb) for nb in self.adjacent[node]]
        table = np.concatenate(columns, axis=1)
        k = len(table)
        if k < 2:
            return
        if k * k * table.shape[1] > _DOMINANCE_BUDGET:
            # Only exact duplicates: keep the first of each.
            _, first = np.unique(table, axis=0, return_index=True)
            mask = np.zeros(k, dtype=bool)
            mask[first] = True
            self._restrict(node, mask)
            return
        less_equal = (table[:, None, :] <= table[None, :, :]).all(axis=2)  # [b, a]: b no worse than a
        equal = less_equal & less_equal.T
        order = np.arange(k)
        # a is dominated by b if b is no worse everywhere and (strictly better somewhere or b < a).
        dominated = (less_equal & (~equal | (order[:, None] < order[None, :]))).any(axis=0)
        self._restrict(node, ~dominated)

    # ------------------------------------------------------------------ memory

    def memory_rows(self, limit: float | None) -> None:
        """Find the memory constraints that can bind; mark the nodes they see."""
        n = self.problem.num_nodes
        self.memory_node = np.zeros(n, dtype=bool)
        self.points = np.zeros(0, dtype=np.int64)
        self.rhs = np.zeros(0)
        self.lo = np.zeros(n, dtype=np.int64)
        self.hi = np.zeros(n, dtype=np.int64)
        intervals = self.problem.intervals
        live = intervals[:, 0] < intervals[:, 1]
        if limit is None or not live.any():
            return
        index = np.flatnonzero(live)
        starts = np.unique(intervals[index, 0])
        lo = np.searchsorted(starts, intervals[index, 0], "left")
        hi = np.searchsorted(starts, intervals[index, 1], "left")
        least = np.array([self.usage[i].min() for i in index])
        most = np.array([self.usage[i].max() for i in index])

        def profile(values: np.ndarray) -> np.ndarray:
            delta = np.zeros(len(starts) + 1)
            np.add.at(delta, lo, values)
            np.add.at(delta, hi, -values)
            return np.cumsum(delta)[:-1]

        base = profile(least)
        if (base > limit).any():
            t = int(starts[np.argmax(base)])
            raise InfeasiblePlacementError(
                f"usage_limit={limit:.6g} is below the least memory live at time step {t} "
                f"({base.max():.6g}: every live node on its smallest-usage strategy)"
            )
        binding = base + profile(most - least) > limit
        # A start is implied by the next one if no node ends in between (the next one sees a superset).
        ending = np.zeros(len(starts) + 1, dtype=np.int64)
        np.add.at(ending, hi, 1)
        implied = np.zeros(len(starts), dtype=bool)
        implied[:-1] = ending[1:-1] == 0
        kept = np.flatnonzero(binding & ~implied)
        if not len(kept):
            return
        self.points = starts[kept]
        self.rhs = limit - base[kept]
        klo = np.searchsorted(kept, lo, "left")
        khi = np.searchsorted(kept, hi, "left")
        seen = (khi > klo) & (most > least)
        self.memory_node[index[seen]] = True
        self.lo[index] = klo
        self.hi[index] = khi
        for i in index[seen]:
            self.usage[i] = self.usage[i] - self.usage[i].min()

    # ------------------------------------------------------------------ elimination

    def _eliminate(self, node: int) -> list[int]:
        """Eliminate a memory-free node with at most two neighbours; the neighbours it touched."""
        neighbours = list(self.adjacent[node])
        cost = self.cost[node]
        if not neighbours:
            best = int(np.argmin(cost))
            if not np.isfinite(cost[best]):
                raise InfeasiblePlacementError(f"node {node} has no strategy of finite cost")
            self.constant += float(cost[best])
            self.removed[node] = True
            self.eliminated.append((node, "alone", int(self.keep[node][best])))
            return []
        if len(neighbours) == 1:
            (j,) = neighbours
            total = cost[:, None] + self.oriented(node, j)
            best = np.argmin(total, axis=0)
            self.cost[j] = self.cost[j] + total[best, np.arange(total.shape[1])]
            self._drop_edge(self.adjacent[node][j])
            self.removed[node] = True
            self.eliminated.append((node, "leaf", (j, self.keep[j], self.keep[node][best])))
            self._restrict(j, np.isfinite(self.cost[j]))
            return [j]
        j, k = neighbours
        m1 = self.oriented(node, j)
        m2 = self.oriented(node, k)
        if m1.size * m2.shape[1] > _ELIMINATION_BUDGET:
            return []
        total = cost[:, None, None] + m1[:, :, None] + m2[:, None, :]
        best = np.argmin(total, axis=0)
        combined = np.take_along_axis(total, best[None], axis=0)[0]
        self._drop_edge(self.adjacent[node][j])
        self._drop_edge(self.adjacent[node][k])
        self.removed[node] = True
        self.eliminated.append((node, "link", (j, self.keep[j], k, self.keep[k], self.keep[node][best])))
        self._add_edge(j, k, combined)
        eid = self.adjacent[j][k]
        if not self._normalize(eid):
            for side in (j, k):
                self._restrict(side, self._allowed(side))
            if eid in self.edges:
                self._normalize(eid)
        return [j, k]

    def reduce(self, limit: float | None, deadline: float) -> None:
        n = self.problem.num_nodes
        for i in range(n):
            self._restrict(i, np.isfinite(self.cost[i]))
        self.memory_rows(limit)
        queue = list(range(n))
        rounds = 0
        while queue and time.perf_counter() < deadline:
            rounds += 1
            touched: set[int] = set()
            while self._dirty:
                if len(self._dirty) % 512 == 0 and time.perf_counter() >= deadline:
                    break
                eid = self._dirty.pop()
                if eid not in self.edges:
                    continue
                i, j, _ = self.edges[eid]
                if not self._normalize(eid):
                    # A strategy forbidden whatever the other side does: drop it (the edge is dirty again).
                    for side in (i, j):
                        self._restrict(side, self._allowed(side))
                        touched.add(side)
                        touched.update(self.adjacent[side])
                elif eid not in self.edges:
                    touched.update((i, j))
            for count, node in enumerate(queue):
                if count % 512 == 0 and time.perf_counter() >= deadline:
                    break
                if self.removed[node]:
                    continue
                before = len(self.cost[node])
                self._dominance(node)
                if len(self.cost[node]) < before:
                    touched.update(self.adjacent[node])
                    touched.add(node)
                if not self.memory_node[node] and len(self.adjacent[node]) <= 2:
                    touched.update(self._eliminate(node))
            queue = sorted(t for t in touched if not self.removed[t])
        self.rounds = rounds

    def expand(self, chosen: dict[int, int]) -> list[int]:
        """Original strategy indices of every node from the kept-strategy choices of those left."""
        original = {node: int(self.keep[node][a]) for node, a in chosen.items()}
        # An eliminated node's table is indexed by its neighbours' strategies kept at that time.
        for node, kind, data in reversed(self.eliminated):
            if kind == "alone":
                original[node] = data
            elif kind == "leaf":
                j, keep_j, best = data
                original[node] = int(best[np.searchsorted(keep_j, original[j])])
            else:
                j, keep_j, k, keep_k, best = data
                original[node] = int(best[np.searchsorted(keep_j, original[j]), np.searchsorted(keep_k, original[k])])
        return [original[i] for i in range(self.problem.num_nodes)]


# =========================================================================== search

# Pair variables of a MILP over the whole reduced problem above which only neighbourhoods are solved.
_FULL_MILP_PAIRS = 300_000
# Relative gap at which HiGHS may stop (its default, 1e-4, leaves visible cost on the table).
_MIP_GAP = 1e-7


class _Search:
    """The reduced problem as arrays, with an incumbent and the memory it uses over time."""

    def __init__(self, reduced: _Reduced, seed: int) -> None:
        self.reduced = reduced
        self.nodes = np.flatnonzero(~reduced.removed)
        local = {int(v): k for k, v in enumerate(self.nodes)}
        self.cost = [reduced.cost[v] for v in self.nodes]
        self.memory = reduced.memory_node[self.nodes]
        self.usage = [reduced.usage[v] if m else None for v, m in zip(self.nodes, self.memory)]
        self.lo = reduced.lo[self.nodes]
        self.hi = reduced.hi[self.nodes]
        self.rhs = reduced.rhs
        self.edges = []  # (local i, local j, matrix)
        self.adjacent: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in self.nodes]
        finite_max = sum(float(np.max(c[np.isfinite(c)], initial=0.0)) for c in self.cost)
        for i, j, m in reduced.edges.values():
            li, lj = local[i], local[j]
            self.edges.append((li, lj, m))
            finite_max += float(np.max(m[np.isfinite(m)], initial=0.0))
        self.edge_i = np.array([e[0] for e in self.edges], dtype=np.int64)
        self.edge_j = np.array([e[1] for e in self.edges], dtype=np.int64)
        # A forbidden (infinite) choice costs more than any solution without one.
        self.big = 10.0 * (abs(finite_max) + abs(reduced.constant) + 1.0)
        self.penalized_cost = [np.where(np.isfinite(c), c, self.big) for c in self.cost]
        for li, lj, m in self.edges:
            penalized = np.where(np.isfinite(m), m, self.big)
            self.adjacent[li].append((lj, penalized, m))
            self.adjacent[lj].append((li, penalized.T, m.T))
        self.rng = np.random.default_rng(seed)
        self.s = np.zeros(len(self.nodes), dtype=np.int64)
        self.load = np.zeros(len(self.rhs))

    # ------------------------------------------------------------------ incumbent

    def start(self, least_usage: bool) -> None:
        """Every node on its cheapest strategy, or (``least_usage``) memory nodes on their smallest
        usage, which meets the memory limit whenever anything does."""
        for v in range(len(self.nodes)):
            if self.memory[v] and least_usage:
                u = self.usage[v]
                candidates = np.flatnonzero(u == u.min())
                self.s[v] = candidates[np.argmin(self.penalized_cost[v][candidates])]
            else:
                self.s[v] = int(np.argmin(self.penalized_cost[v]))
        self.load[:] = 0.0
        for v in np.flatnonzero(self.memory):
            self.load[self.lo[v] : self.hi[v]] += self.usage[v][self.s[v]]

    def construct(self, deadline: float, frugal: bool = False, lookahead: bool = True, reverse: bool = False) -> None:
        """Assign nodes one by one in problem order, each to its cheapest strategy that keeps a
        strategy open for every unassigned neighbour (forward checking) and fits the memory left
        (unassigned nodes count at their least usage). ``frugal``: the smallest usage first, then
        the cheapest (memory left for later nodes' compatible strategies). ``lookahead``: a
        strategy is also charged, per unassigned neighbour, that neighbour's best response."""
        self.start(least_usage=True)
        open_ = [np.isfinite(c) for c in self.cost]
        assigned = np.zeros(len(self.nodes), dtype=bool)
        order = range(len(self.nodes) - 1, -1, -1) if reverse else range(len(self.nodes))
        for count, v in enumerate(order):
            if count % 256 == 0 and time.perf_counter() >= deadline:
                return
            total = self.penalized_cost[v].copy()
            total[~open_[v]] += self.big
            for w, penalized, matrix in self.adjacent[v]:
                if assigned[w]:
                    total += penalized[:, self.s[w]]
                elif lookahead:
                    # The neighbour's best open strategy against each of v's (big if none).
                    total += (penalized[:, open_[w]] + self.penalized_cost[w][open_[w]]).min(axis=1)
                else:
                    # Strategies of v that leave w nothing open.
                    total[~(np.isfinite(matrix[:, open_[w]]).any(axis=1))] += self.big
            current = self.s[v]
            if self.memory[v]:
                lo, hi = self.lo[v], self.hi[v]
                room = float((self.rhs[lo:hi] - self.load[lo:hi]).min()) if hi > lo else math.inf
                usage = self.usage[v]
                total = np.where(usage - usage[current] <= room, total, np.inf)
                if frugal:
                    # Forbidden choices first (big), then usage, then cost.
                    blocked = np.floor(total / self.big)
                    order = np.lexsort((total, usage, blocked))
                    self.move(v, int(order[0]))
                    assigned[v] = True
                    self._narrow(v, open_, assigned)
                    continue
            a = int(np.argmin(total))
            self.move(v, a)
            assigned[v] = True
            self._narrow(v, open_, assigned)

    def _narrow(self, v: int, open_: list[np.ndarray], assigned: np.ndarray) -> None:
        a = self.s[v]
        for w, _, matrix in self.adjacent[v]:
            if not assigned[w]:
                narrowed = open_[w] & np.isfinite(matrix[a])
                if narrowed.any():
                    open_[w] = narrowed

    def assign(self, strategies: np.ndarray) -> None:
        self.s = strategies.copy()
        self.load[:] = 0.0
        for v in np.flatnonzero(self.memory):
            self.load[self.lo[v] : self.hi[v]] += self.usage[v][self.s[v]]

    def excess(self) -> np.ndarray:
        """Per node, what it and its edges cost now above their least (where to look for gains)."""
        s = self.s
        excess = np.array([c[a] - c.min() for c, a in zip(self.penalized_cost, s.tolist())])
        for li, lj, m in self.edges:
            value = m[s[li], s[lj]]
            value = value if np.isfinite(value) else self.big
            excess[li] += value
            excess[lj] += value
        return excess

    def values(self, v: int) -> np.ndarray:
        """Penalized cost of each strategy of ``v`` with its neighbours as they are."""
        total = self.penalized_cost[v].copy()
        s = self.s
        for w, penalized, _ in self.adjacent[v]:
            total += penalized[:, s[w]]
        return total

    def objective(self) -> float:
        s = self.s
        total = self.reduced.constant + math.fsum(float(c[a]) for c, a in zip(self.penalized_cost, s.tolist()))
        for li, lj, m in self.edges:
            value = m[s[li], s[lj]]
            total += float(value) if np.isfinite(value) else self.big
        return total

    def violation(self) -> float:
        """Memory above the limit, summed over the constraints."""
        return float(np.maximum(self.load - self.rhs, 0.0).sum()) if len(self.rhs) else 0.0

    def lower_bound(self) -> float:
        """Node minima: every remaining edge is >= 0 after the reductions."""
        return self.reduced.constant + math.fsum(float(c.min()) for c in self.cost)

    def diffusion_bound(self, deadline: float, sweeps: int = 50) -> float:
        """A lower bound by min-sum diffusion (memory ignored, which only relaxes): the costs are
        moved between nodes and edges without changing any solution's total, each node sharing
        its own cost and its edges' row minima equally with them, which never lowers the sum of
        node minima plus edge minima; that sum bounds every solution's cost."""
        node = [c.copy() for c in self.cost]
        edge = [m.copy() for _, _, m in self.edges]
        incident: list[list[tuple[int, bool]]] = [[] for _ in self.nodes]
        for k, (li, lj, _) in enumerate(self.edges):
            incident[li].append((k, True))
            incident[lj].append((k, False))

        def bound() -> float:
            total = math.fsum(float(c.min()) for c in node) + math.fsum(float(m.min()) for m in edge)
            return self.reduced.constant + total

        best = bound()
        for _ in range(sweeps):
            for v in range(len(self.nodes)):
                if not incident[v]:
                    continue
                if v % 512 == 0 and time.perf_counter() >= deadline:
                    return best
                total = node[v]
                for k, rows in incident[v]:
                    m = edge[k]
                    if rows:
                        phi = m.min(axis=1)
                        m -= phi[:, None]
                    else:
                        phi = m.min(axis=0)
                        m -= phi[None, :]
                    total = total + phi
                share = total / (len(incident[v]) + 1)
                node[v] = share
                for k, rows in incident[v]:
                    if rows:
                        edge[k] += share[:, None]
                    else:
                        edge[k] += share[None, :]
            value = bound()
            if not math.isfinite(value):  # pragma: no cover - the reductions leave every cost finite
                return self.lower_bound()
            best = max(best, value)
        return best

    def move(self, v: int, a: int) -> None:
        if self.memory[v]:
            self.load[self.lo[v] : self.hi[v]] += self.usage[v][a] - self.usage[v][self.s[v]]
        self.s[v] = a

    def descend(self, deadline: float, respect_memory: bool = True, order: np.ndarray | None = None) -> int:
        """Coordinate descent until no node improves alone (or the deadline); moves made. With
        ``respect_memory`` a node only takes memory left over its lifetime."""
        moves = 0
        pending = np.ones(len(self.nodes), dtype=bool)
        while pending.any() and time.perf_counter() < deadline:
            todo = np.flatnonzero(pending) if order is None else order[pending[order]]
            pending[:] = False
            for count, v in enumerate(todo.tolist()):
                if count % 256 == 0 and time.perf_counter() >= deadline:
                    break
                vals = self.values(v)
                current = self.s[v]
                if self.memory[v] and respect_memory:
                    lo, hi = self.lo[v], self.hi[v]
                    room = float((self.rhs[lo:hi] - self.load[lo:hi]).min())
                    usage = self.usage[v]
                    fits = usage - usage[current] <= room
                    fits[current] = True
                    vals = np.where(fits, vals, np.inf)
                best = int(np.argmin(vals))
                if vals[best] < vals[current] - 1e-9 * max(1.0, abs(vals[current])):
                    self.move(v, best)
                    moves += 1
                    for w, _, _ in self.adjacent[v]:
                        pending[w] = True
        return moves

    def plan(self) -> list[int]:
        """The incumbent as one original strategy per node of the problem."""
        return self.reduced.expand({int(v): int(a) for v, a in zip(self.nodes, self.s)})

    def live_at(self, step: int) -> np.ndarray:
        """The memory nodes live at memory constraint ``step``."""
        return np.flatnonzero(self.memory & (self.lo <= step) & (self.hi > step))

    def assign_full(self, full: Sequence[int]) -> None:
        """The incumbent from one original strategy per node of the problem (a strategy the
        reductions dropped becomes the cheapest kept one using no more memory)."""
        chosen = np.zeros(len(self.nodes), dtype=np.int64)
        usage = self.reduced.problem.node_usages
        for k, v in enumerate(self.nodes.tolist()):
            keep = self.reduced.keep[v]
            hit = np.flatnonzero(keep == full[v])
            if len(hit):
                chosen[k] = hit[0]
            else:
                fits = usage[v][keep] <= usage[v][full[v]]
                chosen[k] = int(np.argmin(np.where(fits, self.penalized_cost[k], np.inf) if fits.any() else self.penalized_cost[k]))
        self.assign(chosen)

    def repair(self, deadline: float) -> bool:
        """Greedily back within the memory limit: at the time step most above it, the live node
        whose move to a smaller strategy costs least per unit of memory it frees (neighbours
        as they are, no forbidden choice), until no step is above the limit; whether that was
        reached (a single node's move may not be enough)."""
        while time.perf_counter() < deadline:
            over = self.load - self.rhs
            k = int(np.argmax(over))
            if over[k] <= 0:
                return True
            best, move = math.inf, None
            for v in self.live_at(k).tolist():
                u = self.usage[v]
                freed = u[self.s[v]] - u
                values = self.values(v)
                allowed = (freed > 0) & (values < self.big)
                if not allowed.any():
                    continue
                ratio = np.full(len(u), np.inf)
                ratio[allowed] = (values[allowed] - values[self.s[v]]) / freed[allowed]
                a = int(np.argmin(ratio))
                if ratio[a] < best:
                    best, move = ratio[a], (v, a)
            if move is None:
                return False
            self.move(*move)
        return False

    # ------------------------------------------------------------------ MILP

    def pair_count(self) -> int:
        return sum(int(np.isfinite(m).sum()) for _, _, m in self.edges)

    def neighbourhood(self, budget: int, seeds: np.ndarray | None = None, weights: np.ndarray | None = None) -> np.ndarray:
        """Nodes connected to ``seeds`` (default: a random node), up to ``budget`` pair variables.
        The frontier grows from a random node of it, with ``weights`` (>= 0, one per node) in
        proportion to its weight plus the mean weight (uniformly without)."""
        n = len(self.nodes)
        if seeds is None:
            seeds = [int(self.rng.integers(n))]
        free = {int(v) for v in seeds}
        frontier = list(free)
        pairs = 0
        floor = float(weights.mean()) if weights is not None and len(weights) else 0.0
        while frontier and pairs < budget:
            if weights is None or floor <= 0:
                pick = int(self.rng.integers(len(frontier)))
            else:
                # Where the incumbent pays most is likeliest to gain from being re-solved.
                p = weights[frontier] + floor
                pick = int(self.rng.choice(len(frontier), p=p / p.sum()))
            v = frontier.pop(pick)
            for w, _, m in self.adjacent[v]:
                if w in free:
                    continue
                free.add(w)
                frontier.append(w)
                pairs += m.size
                if pairs >= budget:
                    break
        return np.array(sorted(free), dtype=np.int64)

    def solve_milp(
        self,
        free: np.ndarray,
        time_limit: float,
        warm: bool,
        penalty: float | None = None,
        soft_forbidden: bool = False,
        deadline: float = math.inf,
        want_bound: bool = True,
    ) -> tuple[str, np.ndarray | None, float]:
        """Optimize ``free`` with the others fixed: (status, strategies of ``free`` or None, bound;
        without ``want_bound`` the bound leaves out the fixed nodes' and edges' cost).
        With ``penalty`` the memory limit is soft: each unit above it costs ``penalty``; with
        ``soft_forbidden`` a forbidden pair with a fixed neighbour costs the search's ``big``
        instead of being excluded."""
        import scipy.sparse as sparse

        s = self.s
        is_free = np.zeros(len(self.nodes), dtype=bool)
        is_free[free] = True
        col_cost: list[np.ndarray] = []
        col_upper: list[np.ndarray] = []
        integer: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        row_lower: list[float] = []
        row_upper: list[float] = []
        ncols = 0
        x_start = {}
        constant = self.reduced.constant
        if want_bound:
            for v in np.flatnonzero(~is_free).tolist():
                c = self.cost[v][s[v]]
                constant += float(c) if np.isfinite(c) else self.big
            for k in np.flatnonzero(~is_free[self.edge_i] & ~is_free[self.edge_j]).tolist():
                li, lj, m = self.edges[k]
                value = m[s[li], s[lj]]
                constant += float(value) if np.isfinite(value) else self.big
        # The run's own deadline: the caller's, or its time limit from now (whichever is first).
        if math.isfinite(time_limit):
            deadline = min(deadline, time.perf_counter() + float(time_limit))
        out_of_time = ("time limit", None, -math.inf)
        for count, v in enumerate(free.tolist()):
            if count % 1024 == 1023 and time.perf_counter() >= deadline:
                return out_of_time
            cost = self.cost[v].copy()
            for w, _, m in self.adjacent[v]:
                if not is_free[w]:
                    cost += m[:, s[w]]
            if soft_forbidden:
                own = np.isfinite(self.cost[v])
                cost = np.where(own & ~np.isfinite(cost), self.big, cost)
            finite = np.isfinite(cost)
            x_start[v] = ncols
            col_cost.append(np.where(finite, cost, 0.0))
            col_upper.append(finite.astype(np.float64))
            integer.append(np.ones(len(cost), dtype=bool))
            row = len(row_lower)
            rows.append(np.full(len(cost), row))
            cols.append(np.arange(ncols, ncols + len(cost)))
            vals.append(np.ones(len(cost)))
            row_lower.append(1.0)
            row_upper.append(1.0)
            ncols += len(cost)
        pair_start = []
        for count, k in enumerate(np.flatnonzero(is_free[self.edge_i] & is_free[self.edge_j]).tolist()):
            if count % 1024 == 1023 and time.perf_counter() >= deadline:
                return out_of_time
            li, lj, m = self.edges[k]
            a_idx, b_idx = np.nonzero(np.isfinite(m))
            k = len(a_idx)
            pair_cols = np.arange(ncols, ncols + k)
            pair_start.append((li, lj, m, a_idx, b_idx, ncols))
            col_cost.append(m[a_idx, b_idx])
            col_upper.append(np.ones(k))
            integer.append(np.zeros(k, dtype=bool))
            ncols += k
            na, nb = m.shape
            base = len(row_lower)
            # Row a of the edge: its pairs sum to x[li, a]; column b: to x[lj, b].
            rows += [base + a_idx, base + np.arange(na), base + na + b_idx, base + na + np.arange(nb)]
            cols += [pair_cols, x_start[li] + np.arange(na), pair_cols, x_start[lj] + np.arange(nb)]
            vals += [np.ones(k), -np.ones(na), np.ones(k), -np.ones(nb)]
            row_lower += [0.0] * (na + nb)
            row_upper += [0.0] * (na + nb)
        # Memory: the free nodes' usage at each time step where they could exceed what is left.
        # Memory: between two ends or starts of free nodes, the free nodes live are the same, so
        # one row per such segment (at its least memory left) stands for all its time steps.
        if time.perf_counter() >= deadline:
            return out_of_time
        free_memory = [v for v in free.tolist() if self.memory[v]]
        slack_of = None
        if free_memory and len(self.rhs):
            available = self.rhs - self.load
            most = np.zeros(len(self.rhs) + 1)
            for v in free_memory:
                u = self.usage[v]
                available[self.lo[v] : self.hi[v]] += u[s[v]]
                most[self.lo[v]] += u.max()
                most[self.hi[v]] -= u.max()
            ends = np.concatenate([[0], self.lo[free_memory], self.hi[free_memory]])
            bounds = np.unique(ends[ends < len(self.rhs)])
            room = np.minimum.reduceat(available, bounds)
            segment_most = np.cumsum(most)[bounds]
            binding = np.flatnonzero(segment_most > room + 1e-9)
            if len(binding) and penalty is not None:
                # A slack column per row, priced ``penalty`` per unit above the limit.
                slack_cols = np.arange(ncols, ncols + len(binding))
                col_cost.append(np.full(len(binding), float(penalty)))
                col_upper.append(np.full(len(binding), np.inf))
                integer.append(np.zeros(len(binding), dtype=bool))
                ncols += len(binding)
                rows.append(len(row_lower) + np.arange(len(binding)))
                cols.append(slack_cols)
                vals.append(-np.ones(len(binding)))
                slack_of = (binding, slack_cols, room[binding], bounds)
            if len(binding):
                row_of = np.full(len(bounds), -1)
                row_of[binding] = len(row_lower) + np.arange(len(binding))
                for v in free_memory:
                    ks = np.arange(np.searchsorted(bounds, self.lo[v]), np.searchsorted(bounds, self.hi[v]))
                    ks = ks[row_of[ks] >= 0]
                    u = self.usage[v]
                    nz = np.flatnonzero(u)
                    if not len(ks) or not len(nz):
                        continue
                    rows.append(np.repeat(row_of[ks], len(nz)))
                    cols.append(np.tile(x_start[v] + nz, len(ks)))
                    vals.append(np.tile(u[nz], len(ks)))
                row_lower += [-math.inf] * len(binding)
                row_upper += room[binding].tolist()
        if time.perf_counter() >= deadline:
            return out_of_time
        cost = np.concatenate(col_cost)
        scale = max(1.0, float(np.abs(cost).max()) / 1e7)
        matrix = sparse.csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(row_lower), ncols))
        if time.perf_counter() >= deadline:
            return out_of_time
        x0 = None
        if warm:
            x0 = np.zeros(ncols)
            for v in free.tolist():
                x0[x_start[v] + s[v]] = 1.0
            for li, lj, _, a_idx, b_idx, first in pair_start:
                hit = np.flatnonzero((a_idx == s[li]) & (b_idx == s[lj]))
                x0[first + hit] = 1.0
            if slack_of is not None:
                binding, slack_cols, room, bounds = slack_of
                used = np.zeros(len(self.rhs))
                for v in free_memory:
                    used[self.lo[v] : self.hi[v]] += self.usage[v][s[v]]
                x0[slack_cols] = np.maximum(used[bounds[binding]] - room, 0.0)
        model = dict(
            col_cost=cost / scale,
            col_upper=np.concatenate(col_upper),
            row_lower=np.array(row_lower),
            row_upper=np.array(row_upper),
            start=matrix.indptr,
            index=matrix.indices,
            value=matrix.data,
            integer=np.concatenate(integer),
            options=dict(threads=1, mip_rel_gap=_MIP_GAP),
            x0=x0,
        )
        # Building the model took time too: HiGHS gets what is left before the deadline, and
        # ends there (``solve_model_by``: its own time limit is not kept).
        result = solve_model_by(model, deadline)
        if result is None:
            return out_of_time
        if result["status"] == "infeasible":
            return "infeasible", None, math.inf
        bound = constant + result["dual_bound"] * scale
        x = result["x"]
        if x is None:
            return result["status"], None, bound
        chosen = np.array([int(np.argmax(x[x_start[v] : x_start[v] + len(self.cost[v])])) for v in free.tolist()])
        return result["status"], chosen, bound


# =========================================================================== the solver


def solve_problem(problem: StrategyProblem, *, time_limit: float | None = None, seed: int = 0) -> ProblemSolution:
    """The cheapest strategies found within ``time_limit`` seconds (``None``: solve to optimality,
    within a relative gap of 1e-7), with a lower bound no solution beats. ``seed``: the random
    choice of neighbourhoods. Returns within ``time_limit`` plus the larger of 1 s and 2% of it
    (every engine call is given only the time left, and cut at the deadline).

    Raises ``InfeasiblePlacementError`` (a ``ValueError``) only with a proof that no choice fits
    the memory limit with finite cost (the reductions' or the MILP's), and ``NoPlanFoundError``
    when the time limit ran out before a plan was found."""
    if not isinstance(problem, StrategyProblem):
        raise TypeError(f"problem must be a StrategyProblem, got {type(problem).__name__}")
    if time_limit is not None:
        if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
            raise ValueError(f"time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
    begin = time.perf_counter()
    # The search (every engine call in it) ends by ``deadline``; the time after it, up to the
    # time limit, is kept for expanding and checking the plan (``_answer_reserve``).
    deadline = math.inf if time_limit is None else begin + float(time_limit) - _answer_reserve(problem, float(time_limit))
    if time_limit is not None:
        start_workers(_LNS_WORKERS)  # (HiGHS's runs end at the deadline in worker processes)
    limit = None if problem.usage_limit is None else float(problem.usage_limit)
    integral = _integral(problem)
    reduced = _Reduced(problem)
    reduced.reduce(limit, begin + 0.25 * (deadline - begin))
    reduce_seconds = time.perf_counter() - begin
    search = _Search(reduced, seed)
    stats = dict(
        nodes=problem.num_nodes,
        edges=len(problem.edges),
        nodes_left=len(search.nodes),
        edges_left=len(search.edges),
        memory_nodes=int(search.memory.sum()),
        memory_constraints=len(search.rhs),
        pairs_left=search.pair_count(),
        reduce_seconds=reduce_seconds,
    )
    lower = search.lower_bound()
    method = "reductions"
    if len(search.nodes):
        # The cheapest strategies, improved ignoring memory, then repaired; if memory is broken,
        # the smallest-usage start (feasible whenever anything is) when that has finite cost.
        search.start(least_usage=False)
        search.descend(deadline, respect_memory=False)
        cheapest = search.s.copy() if search.violation() == 0 else None
        cheapest_cost = search.objective() if cheapest is not None else math.inf
        # Greedy constructions, the best kept: the cheapest first; the smallest usage first (memory
        # taken early may leave later nodes no compatible strategy), with and without charging
        # each choice its unassigned neighbours' best responses. Each needs a few seconds on
        # large problems, so the later ones only run while they leave most of the time limit.
        candidates = [] if cheapest is None else [(cheapest_cost, cheapest)]
        variants = [dict(lookahead=False), dict(frugal=True, lookahead=False), dict(frugal=True, lookahead=True)]
        for number, variant in enumerate(variants):
            if number and time_limit is not None and time.perf_counter() - begin > 0.3 * time_limit:
                break
            search.construct(deadline, **variant)
            search.descend(deadline)
            candidates.append((search.objective(), search.s.copy()))
        search.assign(min(candidates, key=lambda candidate: candidate[0])[1])
        stats["start_violation"] = search.violation()
        best = search.objective()
        stats["heuristic_cost"] = best
        if time_limit is not None:
            wait_for_workers(deadline)  # (started above; a run timed below does not count their start)
        if time_limit is None or stats["pairs_left"] <= _FULL_MILP_PAIRS:
            method = "milp"
            left = math.inf if time_limit is None else deadline - time.perf_counter()
            status, chosen, bound = search.solve_milp(
                np.arange(len(search.nodes)),
                left,
                warm=best < search.big,
                deadline=deadline,
            )
            stats["milp_status"] = status
            if status == "infeasible":
                raise InfeasiblePlacementError(
                    f"no strategies meet usage_limit={limit} with finite cost (the MILP over the reduced problem is infeasible)"
                )
            if chosen is not None:
                for v, a in enumerate(chosen.tolist()):
                    search.move(v, a)
            lower = max(lower, bound)
            stats["milp_optimal"] = status == "optimal"
        if not stats.get("milp_optimal") and time.perf_counter() < deadline:
            method = "milp-lns" if method == "milp" else "lns"
            # A bound of the LP relaxation's kind, for a tenth of the time left.
            began = time.perf_counter()
            lower = max(lower, search.diffusion_bound(began + 0.1 * (deadline - began)))
            stats["bound_seconds"] = time.perf_counter() - began
            began = time.perf_counter()
            priced = _LAGRANGIAN_SHARE * (deadline - began)
            if limit is not None and len(search.rhs) and priced >= _LAGRANGIAN_MIN_ROUNDS * _ROUND_SECONDS:
                stats["lagrangian_rounds"], stats["lagrangian_repairs"] = _lagrangian_search(problem, search, limit, began + priced, seed)
                stats["lagrangian_cost"] = search.objective()
                stats["lagrangian_seconds"] = time.perf_counter() - began
            stats["lns_rounds"], stats["lns_improvements"], _ = _large_neighbourhood_search(search, deadline)
    stats["search_seconds"] = time.perf_counter() - begin
    # (Without a time limit the MILP over the whole reduced problem ran to its end: a plan, or
    # a proof that there is none, raised above.)
    if search.violation() > 0:
        raise NoPlanFoundError(
            f"found no strategies within usage_limit={limit} in time_limit={time_limit} s (the best still uses "
            f"{search.violation():.6g} above it); the problem is not proven infeasible"
        )
    if search.objective() >= search.big:
        raise NoPlanFoundError(
            f"found no strategies of finite cost in time_limit={time_limit} s (some choice is forbidden on every "
            "plan tried); the problem is not proven infeasible"
        )
    strategies = search.plan()
    cost = problem_cost(problem, strategies)
    if limit is not None and peak_usage(problem, strategies) > limit:  # pragma: no cover - a bug if reached
        raise AssertionError("the solver returned strategies above the usage limit")
    stats.update(method=method, seconds=time.perf_counter() - begin)
    if integral:
        # Integer costs: no solution costs less than the bound rounded up.
        lower = math.ceil(lower - 1e-9 * max(1.0, abs(lower)))
    return ProblemSolution(strategies, cost, min(lower, cost), stats)


def _answer_reserve(problem: StrategyProblem, time_limit: float) -> float:
    """Seconds of a time limit kept after the search: for a cancelled engine call to stop, and
    for expanding and checking the plan (measured: 0.3 s for 20k nodes and 27k edges)."""
    return min(0.2 * time_limit, CANCEL_GRACE + 0.1 + 1e-5 * (problem.num_nodes + len(problem.edges)))


def _integral(problem: StrategyProblem) -> bool:
    """Whether every finite cost is a whole number (then a bound rounds up)."""
    values = np.concatenate([np.zeros(0), *problem.node_costs, *(m.ravel() for m in problem.edge_costs)])
    finite = values[np.isfinite(values)]
    return bool(np.all(finite == np.round(finite)))


_LNS_MIN_PAIRS = 2_000  # the smallest neighbourhood, in pair variables
_LNS_FIRST_PAIRS = 20_000  # the first rounds' neighbourhoods


# Neighbourhoods solved at once per round: one per core (HiGHS runs single-threaded).
_LNS_WORKERS = max(1, min(2, os.cpu_count() or 1))


def _lns_seeds(search: _Search, rounds: int, penalty: float | None, forbidden: bool) -> tuple:
    """Where a neighbourhood starts and grows (``neighbourhood``'s seeds and weights): at a
    forbidden choice while the incumbent makes one; where the limit is broken while it is;
    else two rounds in three where the incumbent pays most above the node minima, the
    third uniformly (gains the excess does not point at)."""
    if forbidden and penalty is None:
        s = search.s
        bad = [v for li, lj, m in search.edges if not np.isfinite(m[s[li], s[lj]]) for v in (li, lj)]
        bad += [v for v in range(len(search.nodes)) if not np.isfinite(search.cost[v][s[v]])]
        return search.rng.choice(np.array(bad), size=min(len(bad), 4), replace=False), None
    if penalty is not None:
        over = np.maximum(search.load - search.rhs, 0.0)
        k = int(search.rng.choice(len(over), p=over / over.sum()))
        live = search.live_at(k)
        return search.rng.choice(live, size=min(len(live), 16), replace=False), None
    if rounds % 3:
        excess = search.excess()
        if excess.sum() > 0:
            return [int(search.rng.choice(len(excess), p=excess / excess.sum()))], excess
    return None, None


def _large_neighbourhood_search(search: _Search, deadline: float, budget: int | None = None) -> tuple[int, int, int]:
    """Re-solve neighbourhoods of the incumbent as MILPs until the deadline, the first of
    ``budget`` pair variables; rounds, improvements, and the size for a next call.

    While the incumbent breaks the memory limit, the limit is soft (priced per unit above it, the
    price rising while it stays broken) and neighbourhoods grow from nodes live where it is broken.
    """
    budget = budget or _LNS_FIRST_PAIRS
    rounds = improvements = 0
    penalty = None
    stuck = 0
    if search.violation() > 0:
        penalty = max(search.objective(), 1.0) / search.violation()

    def score() -> float:
        return search.objective() + (penalty * search.violation() if penalty is not None else 0.0)

    current = score()
    took = 0.0
    seconds_per_pair = None  # the slowest round's seconds per pair variable of its budget
    while True:
        left = deadline - time.perf_counter()
        # A round runs over by its model's building and HiGHS past its own time limit (measured
        # on instance A: a 470k-column round given 8.9 s took 12.6 s, 6 s of it building): a
        # round's neighbourhood is no larger than the slowest round's seconds per pair variable
        # say half of what is left allows, and HiGHS gets at most half of what is left.
        if left < 0.2 + (0.0 if seconds_per_pair is None else 2 * _LNS_MIN_PAIRS * seconds_per_pair):
            break
        if penalty is not None and search.violation() == 0:
            penalty = None
            current = score()
        forbidden = current >= search.big
        size = budget if seconds_per_pair is None else max(_LNS_MIN_PAIRS, min(budget, int(0.5 * left / seconds_per_pair)))
        # One neighbourhood per core, disjoint, solved at once (HiGHS runs without the GIL):
        # each against the incumbent, then applied one after the other while each gains.
        frees = []
        for _ in range(_LNS_WORKERS):
            free = search.neighbourhood(size, *_lns_seeds(search, rounds, penalty, forbidden))
            for other in frees:
                free = np.setdiff1d(free, other, assume_unique=True)
            if len(free):
                frees.append(free)
            rounds += 1
        began = time.perf_counter()

        solve = functools.partial(
            search.solve_milp, time_limit=min(10.0, 0.5 * left), warm=True, penalty=penalty, soft_forbidden=forbidden,
            deadline=deadline, want_bound=False,
        )
        if len(frees) == 1:
            results = [solve(frees[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(frees)) as pool:
                results = list(pool.map(solve, frees))
        took = time.perf_counter() - began
        seconds_per_pair = max(seconds_per_pair or 0.0, took / max(size, 1))
        statuses = [status for status, _, _ in results]
        if all(status == "optimal" for status in statuses) and took < 2.0:
            budget = min(int(budget * 1.3), 400_000)
        elif any(status != "optimal" for status in statuses):
            budget = max(int(budget / 1.5), _LNS_MIN_PAIRS)
        for free, (_, chosen, _) in zip(frees, results):
            if chosen is None:
                continue
            previous = search.s[free].copy()
            for v, a in zip(free.tolist(), chosen.tolist()):
                search.move(v, a)
            new = score()
            # (A neighbourhood solved against the incumbent may not fit beside another's moves.)
            fits = penalty is not None or search.violation() == 0
            if fits and new < current - 1e-9 * max(1.0, abs(current)):
                current = new
                improvements += 1
                stuck = 0
            else:
                for v, a in zip(free.tolist(), previous.tolist()):
                    search.move(v, a)
                stuck += 1
                if penalty is not None and stuck >= 5:
                    penalty *= 4.0
                    current = score()
                    stuck = 0
        if len(frees[0]) >= len(search.nodes) and statuses[0] == "optimal" and penalty is None:
            break
    return rounds, improvements, budget


# The memory limit priced instead of constrained, for this share of the search's time when it
# allows this many rounds of this many seconds (each reduces the priced problem anew).
_LAGRANGIAN_SHARE = 0.6
_LAGRANGIAN_MIN_ROUNDS = 10
_ROUND_SECONDS = 8.0
# Each round, prices where the limit is broken grow by this factor; elsewhere they decay by that.
_PRICE_GROWTH = 2.0
_PRICE_DECAY = 0.8
# Prices stay below this (a node's price summed over its lifetime times its usage stays finite).
_PRICE_CAP = 1e100
# A round's plan above the limit at no more than this share of the time steps is repaired,
# each part of the repair for at most this many seconds.
_REPAIR_STEPS = 0.05
_REPAIR_SECONDS = 4.0


def _lagrangian_search(problem: StrategyProblem, main: _Search, limit: float, deadline: float, seed: int) -> tuple[int, int]:
    """Memory priced instead of constrained (a Lagrangian relaxation): each round puts a price
    on every time step, a node paying their sum over its lifetime per unit of its usage;
    reduces the priced problem without a limit, which eliminates what memory kept (on
    contest instance M, 18.7k nodes left become 1.9k), and searches it from the last round's
    plan; then raises the prices where the limit is broken and lowers them where it is not.
    ``main`` (the constrained search) ends on the best plan within the limit, its own
    incumbent if none beats it. Returns the rounds, and how many of them a repair made count."""
    steps = _TimeSteps(problem)
    points, lo, hi, loads = steps.points, steps.lo, steps.hi, steps.loads

    current = main.plan()
    best_cost = problem_cost(problem, current)
    prices = np.zeros(len(points))
    unit = None
    rounds = repairs = 0
    budget = None
    while deadline - time.perf_counter() > 0.5 * _ROUND_SECONDS:
        rounds += 1
        began = time.perf_counter()
        stop = min(deadline, began + _ROUND_SECONDS)
        cumulative = np.concatenate([[0.0], np.cumsum(prices)])
        paid = cumulative[hi] - cumulative[lo]
        reduced = _Reduced(problem)
        for v in np.flatnonzero(paid > 0).tolist():
            reduced.cost[v] = reduced.cost[v] + paid[v] * reduced.usage[v]
        try:
            reduced.reduce(None, began + 0.3 * (stop - began))
        except InfeasiblePlacementError:  # pragma: no cover - the constrained reductions said so first
            # The priced problem has every plan of the problem (finite prices keep finite costs
            # finite): nothing is proven here that the constrained reductions did not prove.
            break
        search = _Search(reduced, seed + rounds)
        if len(search.nodes):
            search.assign_full(current)
            search.descend(stop, respect_memory=False)
            _, _, budget = _large_neighbourhood_search(search, stop, budget)
        plan = search.plan()
        load = loads(plan)
        over = load > limit
        cost = problem_cost(problem, plan)
        if cost < best_cost and over.sum() <= max(1.0, _REPAIR_STEPS * len(points)):
            # Cheaper, and within the limit or just above it: in the constrained search, back
            # within it greedily and each node improved alone.
            previous = main.s.copy()
            main.assign_full(plan)
            if over.any() and main.repair(min(deadline, time.perf_counter() + _REPAIR_SECONDS)):
                main.descend(min(deadline, time.perf_counter() + _REPAIR_SECONDS))
            found = main.objective()
            # (A strategy the constrained reductions dropped may also map to a worse one there.)
            if main.violation() == 0 and found < best_cost:
                best_cost = found
                repairs += bool(over.any())
            else:
                main.assign(previous)
        if over.any():
            if unit is None:
                # The first price: what the plan saved per unit of memory above the limit.
                above = float(np.maximum(load - limit, 0.0).sum())
                # (The incumbent may still make a forbidden choice: its cost is infinite, and
                # an infinite price would make every strategy of the priced problem infinite.)
                finite = [c for c in (best_cost, cost) if math.isfinite(c)]
                saved = best_cost - cost if len(finite) == 2 and best_cost > cost else 1e-9 * max(map(abs, finite), default=0.0)
                unit = (saved or 1.0) / above
            prices[over] = np.minimum(np.maximum(prices[over] * _PRICE_GROWTH, unit), _PRICE_CAP)
        prices[~over] *= _PRICE_DECAY
        current = plan
    return rounds, repairs
