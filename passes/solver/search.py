"""The search: a plan for a ``StrategyProblem``, improved by exact integer programs over
neighbourhoods of it, with pluggable neighbourhood policies; ``solve_problem``.

``solve_problem`` reduces the problem exactly (``passes.solver.reduce``), then:

1. a primal heuristic: the cheapest strategies improved by coordinate descent (each node
   moves to its cheapest strategy given its neighbours), kept if within the memory limit; and
   greedy constructions (nodes assigned in order, each to the cheapest, or the smallest-usage,
   strategy that leaves every unassigned neighbour a strategy of finite cost and fits the
   memory left, the unassigned counted at their smallest usage, which fits whenever anything
   does), each improved by coordinate descent that keeps to the memory left over a node's
   lifetime; the first construction is repaired before any descent, and each later one
   that still makes a forbidden choice too, into a plan that makes none (the feasibility
   phase, ``passes.solver.feasible``: with all the time left while there is no plan yet);
   the best is the incumbent;
2. HiGHS (``passes.solver.milp``) on the whole reduced problem when it is small (or without a
   time limit), and otherwise on neighbourhoods of the incumbent, each started from it, which
   is never made worse. Policies: large neighbourhoods (a connected set of nodes around a
   random node, or, two rounds in three, one started where the incumbent pays most above the
   node minima and grown towards such nodes, freed with the rest fixed; one per core, solved
   at once); memory priced instead of constrained (a Lagrangian relaxation: a price per time
   step, the priced problem reduced without a limit, which eliminates what memory kept,
   searched by toulbar2 where it is small enough, then by neighbourhoods, plans just above the
   limit greedily repaired); mesh axes (``_axis_search``: every node's
   strategies restricted by its per-axis codes, for the FX front's problems on 3-D meshes,
   too large for one program). While the incumbent still has a forbidden pair, or breaks the
   memory limit, those are priced instead of excluded, so each neighbourhood is feasible and
   repairs what it can.

With a time limit and pytoulbar2 installed, ``search="auto"`` runs toulbar2
(``passes.solver.wcsp``, the weighted-CSP engine of the IOPDDL contest's winning team) beside 2,
at the same time, each until the deadline: toulbar2 in its worker process, waited on by a
thread of this one (``_WcspRunner``, ``_wcsp_phase``: memory rows added lazily, its plans
repaired back within the limit), 2 in this thread and its HiGHS workers. They share the best
plan (``_Incumbent``): 2 adopts a cheaper plan of toulbar2's at its next round, and each
toulbar2 run is told the cheapest plan so far as its upper bound; the answer is the best plan
of either, and a proof of optimality by either ends both. Without pytoulbar2, ``"auto"`` is
the search above alone.

The result carries the best solution found, its cost, and a certified lower bound: the MILP's
dual bound on the whole reduced problem (HiGHS stops at a relative gap of 1e-7; with integer
costs, rounded up), or else the largest of the reduced problem's sum of node minima, a
min-sum diffusion bound and toulbar2's dual bound (of the problem without the memory rows it
did not see, which only relaxes).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import itertools
import math
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np

from passes.solver import wcsp
from passes.solver.deadline import OutOfTime, check, collector_paused, start_workers, wait_for_workers
from passes.solver.feasible import repair_forbidden
from passes.solver.milp import MIP_GAP, solve_neighbourhood
from passes.solver.problem import (
    InfeasiblePlacementError,
    NoPlanFoundError,
    ProblemSolution,
    StrategyProblem,
    _check_strategies,
    _FlatEdges,
    _TimeSteps,
    peak_usage,
    problem_cost,
)
from passes.solver.reduce import Reduced

__all__ = ["solve_problem", "Search"]

# Pair variables of a MILP over the whole reduced problem above which only neighbourhoods are solved.
_FULL_MILP_PAIRS = 300_000
# Nodes or edges between two looks at the deadline while the search's arrays are built (a few ms).
_CHECK_EVERY = 256


class Search:
    """The reduced problem as arrays, with an incumbent and the memory it uses over time."""

    diffused: list[np.ndarray] | None = None  # (``diffusion_bound``'s reparametrized node costs)

    def __init__(self, reduced: Reduced, seed: int, deadline: float = math.inf) -> None:
        """``deadline``: ``OutOfTime`` is raised past it (the arrays of a 20k-node problem
        take half a second)."""
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
        self.edge_class_ids = []
        check(deadline)
        for count, (eid, (i, j, m)) in enumerate(reduced.edges.items()):
            if count % _CHECK_EVERY == 0:
                check(deadline)
            self.edges.append((local[i], local[j], m))
            self.edge_class_ids.append(eid)
        self.edge_i = np.array([e[0] for e in self.edges], dtype=np.int64)
        self.edge_j = np.array([e[1] for e in self.edges], dtype=np.int64)
        # Every node's costs (and usages), and every edge's table, flat, one after the other (the
        # sums over a plan as one gather: a Python loop per node or edge took most of a second of
        # a 2 s time limit on a 4000-node problem with the machine busy).
        sizes = np.array([len(c) for c in self.cost], dtype=np.int64)
        self.cost_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        flat_cost = np.concatenate([np.zeros(0), *self.cost])
        self.least_cost = np.minimum.reduceat(flat_cost, self.cost_start[:-1]) if len(sizes) else np.zeros(0)
        self.edge_cols = np.array([m.shape[1] for _, _, m in self.edges], dtype=np.int64)
        edge_sizes = np.array([m.size for _, _, m in self.edges], dtype=np.int64)
        self.edge_start = np.concatenate([[0], np.cumsum(edge_sizes)]).astype(np.int64)
        flat_edges = np.concatenate([np.zeros(0), *(m.ravel() for _, _, m in self.edges)])
        finite_max = _finite_max_sum(flat_cost, self.cost_start) + _finite_max_sum(flat_edges, self.edge_start)
        # A forbidden (infinite) choice costs more than any solution without one.
        self.big = 10.0 * (abs(finite_max) + abs(reduced.constant) + 1.0)
        self.flat_penalized = np.where(np.isfinite(flat_cost), flat_cost, self.big)
        self.flat_edges = np.where(np.isfinite(flat_edges), flat_edges, self.big)
        check(deadline)
        self.penalized_cost = np.split(self.flat_penalized, self.cost_start[1:-1]) if len(sizes) else []
        penalized_tables = np.split(self.flat_edges, self.edge_start[1:-1]) if len(self.edges) else []
        check(deadline)
        for count, ((li, lj, m), penalized) in enumerate(zip(self.edges, penalized_tables)):
            if count % _CHECK_EVERY == 0:
                check(deadline)
            penalized = penalized.reshape(m.shape)
            self.adjacent[li].append((lj, penalized, m))
            self.adjacent[lj].append((li, penalized.T, m.T))
        # Per node, its strategies' costs and usages padded with inf to the most strategies (for
        # the cheapest, and smallest-usage, strategy of every node at once).
        width = int(sizes.max(initial=1))
        self.padded_cost = np.full((len(sizes), width), np.inf)
        self.padded_usage = np.full((len(sizes), width), np.inf)
        column = np.arange(int(self.cost_start[-1])) - np.repeat(self.cost_start[:-1], sizes)
        row = np.repeat(np.arange(len(sizes)), sizes)
        self.padded_cost[row, column] = self.flat_penalized
        memory_nodes = np.flatnonzero(self.memory)
        self.whole_usages = True
        if len(memory_nodes):
            flat_usage = np.concatenate([np.zeros(0), *(self.usage[v] for v in memory_nodes.tolist())])
            usage_sizes = sizes[memory_nodes]
            self.whole_usages = bool(np.all(flat_usage == np.round(flat_usage))) and float(np.abs(flat_usage).sum()) < 2.0**52
            first = np.concatenate([[0], np.cumsum(usage_sizes)[:-1]])
            column = np.arange(len(flat_usage)) - np.repeat(first, usage_sizes)
            self.padded_usage[np.repeat(memory_nodes, usage_sizes), column] = flat_usage
        check(deadline)
        self.rng = np.random.default_rng(seed)
        self.s = np.zeros(len(self.nodes), dtype=np.int64)
        self.load = np.zeros(len(self.rhs))
        self._classes: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # The largest integer program solved so far (its variables, constraints and nodes), and how many.
        self.milp_sizes = dict(variables=0, constraints=0, milp_nodes=0)
        self.milps = 0
        # HiGHS's presolve, unless ``solve_problem(presolve=False)`` (the FX front's programs:
        # one-hot options, pair variables tied to them by row and column sums, relaxations
        # integral at the root or nearly; it took half of each solve and removed little).
        self.presolve = True
        # Set when another engine of the portfolio proved the optimum: HiGHS's runs end then.
        self.stop: threading.Event | None = None

    def fork(self, seed: int) -> "Search":
        """A search of the same reduced problem (its arrays shared, read only) with an incumbent
        of its own (a copy of this one's) and its own random choices: for an engine running
        beside this search in another thread."""
        other = copy.copy(self)
        other.s = self.s.copy()
        other.load = self.load.copy()
        other.rng = np.random.default_rng(seed)
        other._classes = {}
        other.milp_sizes = dict(self.milp_sizes)
        return other

    def edge_classes(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Edge k's table compressed: (class of each row, class of each column, table over classes),
        the classes the reductions kept (``Reduced.classes``)."""
        found = self._classes.get(k)
        if found is None:
            m = self.edges[k][2]
            rows, cols = self.reduced.edge_classes(self.edge_class_ids[k])
            rows, first_rows = _renumbered(rows)
            cols, first_cols = _renumbered(cols)
            found = self._classes[k] = (rows, cols, m[np.ix_(first_rows, first_cols)])
        return found

    # ------------------------------------------------------------------ incumbent

    def start(self, least_usage: bool) -> None:
        """Every node on its cheapest strategy, or (``least_usage``) memory nodes on their smallest
        usage, which meets the memory limit whenever anything does."""
        cheapest = np.argmin(self.padded_cost, axis=1) if len(self.nodes) else np.zeros(0, dtype=np.int64)
        if least_usage and self.memory.any():
            least = self.padded_usage == self.padded_usage.min(axis=1, keepdims=True)
            frugal = np.argmin(np.where(least, self.padded_cost, np.inf), axis=1)
            cheapest = np.where(self.memory, frugal, cheapest)
        self.assign(cheapest.astype(np.int64))

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
            if count % 64 == 0 and time.perf_counter() >= deadline:
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
        self.s = np.array(strategies, dtype=np.int64)
        self.load[:] = 0.0
        memory = np.flatnonzero(self.memory)
        if len(memory) and len(self.load) and not self.whole_usages:
            for v in memory.tolist():
                self.load[self.lo[v] : self.hi[v]] += self.usage[v][self.s[v]]
        elif len(memory) and len(self.load):
            # Each memory node's usage from its first constraint to its last (a difference array:
            # exact for whole numbers, as the loop above is).
            used = self.padded_usage[memory, self.s[memory]]
            change = np.zeros(len(self.load) + 1)
            np.add.at(change, self.lo[memory], used)
            np.add.at(change, self.hi[memory], -used)
            self.load[:] = np.cumsum(change)[:-1]

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
        nodes = self.flat_penalized[self.cost_start[:-1] + self.s]
        edges = self.flat_edges[self.edge_start[:-1] + self.s[self.edge_i] * self.edge_cols + self.s[self.edge_j]]
        return self.reduced.constant + math.fsum(nodes.tolist()) + math.fsum(edges.tolist())

    def violation(self) -> float:
        """Memory above the limit, summed over the constraints."""
        return float(np.maximum(self.load - self.rhs, 0.0).sum()) if len(self.rhs) else 0.0

    def has_plan(self) -> bool:
        """Whether the plan is one: within the memory limit, no forbidden choice."""
        return self.violation() == 0 and self.objective() < self.big

    def lower_bound(self) -> float:
        """Node minima: every remaining edge is >= 0 after the reductions."""
        return self.reduced.constant + math.fsum(self.least_cost.tolist())

    def diffusion_bound(self, deadline: float, sweeps: int = 50) -> float:
        """A lower bound by min-sum diffusion (memory ignored, which only relaxes): the costs are
        moved between nodes and edges without changing any solution's total, each node sharing
        its own cost and its edges' row minima equally with them, which never lowers the sum of
        node minima plus edge minima; that sum bounds every solution's cost. Keeps the node costs
        of the last full sweep in ``self.diffused`` (each strategy's cost with its share of the
        edges': how the dual ranks a node's strategies), or ``None``."""
        self.diffused = None
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
                if v % 64 == 0 and time.perf_counter() >= deadline:
                    return best
                total = node[v]
                for k, rows in incident[v]:
                    m = edge[k]
                    phi = m.min(axis=1 if rows else 0)
                    with np.errstate(invalid="ignore"):
                        m -= phi[:, None] if rows else phi[None, :]
                    # A strategy forbidden with every one of a neighbour's (a row of inf, which
                    # the reductions need not remove) stays forbidden: inf - inf is inf here.
                    np.nan_to_num(m, copy=False, nan=math.inf, posinf=math.inf, neginf=-math.inf)
                    total = total + phi
                share = total / (len(incident[v]) + 1)
                node[v] = share
                for k, rows in incident[v]:
                    if rows:
                        edge[k] += share[:, None]
                    else:
                        edge[k] += share[None, :]
            value = bound()
            if not math.isfinite(value):  # every strategy of a node forbidden: the plain bound stands
                return self.lower_bound()
            best = max(best, value)
            self.diffused = node
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
                if count % 64 == 0 and time.perf_counter() >= deadline:
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
            move = self.cheapest_freeing_move(k, lambda v, values: values < self.big)
            if move is None:
                return False
            self.move(*move)
        return False

    def cheapest_freeing_move(
        self, step: int, admissible: Callable[[int, np.ndarray], np.ndarray], *, skip: int = -1, deadline: float = math.inf
    ) -> tuple[int, int] | None:
        """The move, among the nodes live at ``step`` (but ``skip``), to a smaller strategy that
        costs least per unit of memory it frees: ``(node, strategy)``, or None. ``admissible(v,
        values)``: which of ``v``'s strategies may be taken, given their values with the
        neighbours as they are. None too when ``deadline`` passes (checked every 64 nodes)."""
        best, move = math.inf, None
        for count, v in enumerate(self.live_at(step).tolist()):
            if count % 64 == 63 and time.perf_counter() >= deadline:
                return None
            if v == skip:
                continue
            u = self.usage[v]
            current = int(self.s[v])
            freed = u[current] - u
            values = self.values(v)
            allowed = (freed > 0) & admissible(v, values)
            if not allowed.any():
                continue
            ratio = np.full(len(u), np.inf)
            ratio[allowed] = (values[allowed] - values[current]) / freed[allowed]
            a = int(np.argmin(ratio))
            if ratio[a] < best:
                best, move = ratio[a], (v, a)
        return move

    # ------------------------------------------------------------------ MILP

    def pair_count(self, deadline: float = math.inf) -> int:
        """Pair variables of the integer program over every node (tables compressed to classes).
        Past ``deadline``, the edges not yet counted count uncompressed (an upper bound, with no
        classes found: on a 4000-node ``contest_like`` problem the classes took 1-2 s, all
        of a 2 s time limit on a busy machine)."""
        total = 0
        for k in range(len(self.edges)):
            if k % 64 == 0 and time.perf_counter() >= deadline:
                return total + sum(int(np.isfinite(m).sum()) for _, _, m in self.edges[k:])
            total += int(np.isfinite(self.edge_classes(k)[2]).sum())
        return total

    def solve_milp(self, free: np.ndarray, time_limit: float, warm: bool, **options) -> tuple[str, np.ndarray | None, float]:
        """``milp.solve_neighbourhood`` of this search: (status, strategies of ``free``, bound)."""
        status, chosen, bound, sizes = solve_neighbourhood(self, free, time_limit, warm, **options)
        if sizes:
            self.milps += 1
            if sizes["variables"] > self.milp_sizes["variables"]:
                self.milp_sizes = sizes
        return status, chosen, bound

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


# =========================================================================== the solver

# Above this many pair variables after the exact reductions, a problem whose strategies carry
# per-axis codes on a mesh of 3 or more axes is searched by mesh axes (``search="auto"``).
_EXACT_PAIRS = 400_000
_SEARCHES = ("auto", "exact", "axes", "toulbar2")


def solve_problem(
    problem: StrategyProblem,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    search: str = "auto",
    reduce: bool = True,
    dominance: str = "full",
    start: Sequence[int] | None = None,
    presolve: bool = True,
) -> ProblemSolution:
    """The cheapest strategies found within ``time_limit`` seconds (``None``: solve to optimality,
    within a relative gap of 1e-7), with a lower bound no solution beats. ``seed``: the random
    choice of neighbourhoods. Returns within ``time_limit`` plus the larger of 1 s and 2% of it
    (every engine call is given only the time left, and cut at the deadline). With a time
    limit the plan depends on the machine's speed and load, not on ``seed`` alone (the engines
    are cut at a deadline; ``"auto"`` also runs two engines at once, sharing plans as they
    find them).

    ``search``: ``"exact"``: the integer program over the whole reduced problem when it is small
    or there is no time limit, else large neighbourhoods of the plan until the time limit;
    ``"axes"``: neighbourhoods by mesh axes (``_axis_search``; the problem's ``axes`` codes on 3
    or more axes; each step exact, the plan not proven optimal, ``stats["status"]`` says so);
    ``"toulbar2"``: toulbar2 (``passes.solver.wcsp``) for the whole time (``_wcsp_phase``);
    ``"auto"``: ``"axes"`` when the whole program would have more than 400k pair variables,
    else, with a time limit, pytoulbar2 installed and at most ``_WCSP_MAX_NODES`` (10k) nodes
    left after the reductions, a portfolio: toulbar2 (its plans repaired back within the memory
    limit) and ``"exact"``'s search at the same time, each with all the time left after the
    heuristics, sharing their best plans; the answer is the cheaper plan of the two, so it
    has a plan whenever either engine finds one in the time (toulbar2 finds plans 1-40% cheaper
    than the neighbourhood search on ``families.contest_like`` problems where it finds one,
    ``benchmarks/solver_engines.py``, but on a loaded machine or a large problem it may find
    none); without pytoulbar2 (or without a time limit: the integer program proves the
    optimum) ``"exact"``. ``reduce=False`` eliminates no node (for tests of the reductions);
    ``dominance="equal"`` drops only strategies equal to another but for a higher cost (the
    reduced size then follows the problem's structure, not its costs; ``reduce.Reduced``).
    ``start``: a plan (a strategy per node) the search also starts from, repaired back within
    the memory limit if it breaks it (by default, where memory binds, the problem's optimum
    without the limit).

    When the time limit comes before the search's arrays are built, the answer is read off the
    problem alone (``stats["method"] == "quick"``; ``_prepared``).

    Raises ``InfeasiblePlacementError`` (a ``ValueError``) only with a proof that no choice fits
    the memory limit with finite cost (the reductions' or the MILP's), and ``NoPlanFoundError``
    (a ``TimeoutError``) when the time limit ran out before a plan was found."""
    start = _checked_arguments(problem, time_limit, search, start)
    with collector_paused(time_limit is not None):  # (the caller's heap is not the solver's time)
        begin = time.perf_counter()
        prepared = _prepared(problem, time_limit, begin, seed, reduce, dominance)
        if isinstance(prepared, ProblemSolution):
            return prepared
        searched, deadline, reduce_seconds = prepared
        searched.presolve = presolve
        by_axes = search in ("auto", "axes") and _axis_count(searched) >= 3
        pairs_left = searched.pair_count(begin + 0.3 * (deadline - begin))
        if by_axes and search == "auto":
            by_axes = pairs_left > _EXACT_PAIRS
        stats = dict(
            nodes=problem.num_nodes, edges=len(problem.edges), nodes_left=len(searched.nodes), edges_left=len(searched.edges),
            memory_nodes=int(searched.memory.sum()),
            memory_constraints=len(searched.rhs),
            pairs_left=pairs_left,
            reduce_seconds=reduce_seconds,
            search_seconds_allowed=deadline - begin,
        )
        # (``"axes"`` on a problem without codes on 3 or more mesh axes: the exact route.)
        mode = "axes" if by_axes else "exact" if search == "axes" else search
        run = _Run(problem, searched, mode, time_limit, begin, deadline, seed, dominance, start, stats)
        if len(searched.nodes):
            candidates = run.heuristic_plans()
            run.start_portfolio(candidates)
            run.unconstrained_plan(candidates)
            run.adopt_best(candidates)
            run.search_to_the_deadline()
        if run.runner is not None:
            run.portfolio_answer()
        return run.answer()


def _prepared(
    problem: StrategyProblem, time_limit: float | None, begin: float, seed: int, reduce: bool, dominance: str
) -> ProblemSolution | tuple[Search, float, float]:
    """The steps before the search: the reductions and the search's arrays, the search's
    deadline and the seconds the reductions took. Each step (the problem's copy, the memory
    rows, the search's arrays) looks at the deadline: when it comes first (a 20k-node problem
    and a limit under a second or two), the quick answer (``_quick_answer``): the cheaper of
    two plans read off the problem alone, every node on its cheapest or its smallest strategy."""
    cpu_begin = time.process_time()
    # The search (every engine call in it) ends by ``deadline``; the time after it, up to the
    # time limit, is kept for expanding and checking the plan (``_answer_reserve``).
    deadline = math.inf if time_limit is None else begin + float(time_limit) - _answer_reserve(problem, float(time_limit))
    # Where the steps before the search may not finish in time, the answer of last resort is
    # read off the problem first (a few percent of the limit): read after the deadline, it took
    # 0.3-0.7 s of an 8000-node problem's 0.5 s limit on a loaded machine.
    fallback = None
    if time_limit is not None and time_limit < _FALLBACK_SECONDS_PER_ENTRY * (problem.num_nodes + len(problem.edges)):
        fallback = _fallback(problem, begin, time_limit)
    try:
        # (Each step looks at the deadline: a 20k-node problem's copy, memory rows and arrays
        # take 1-2 s before any plan exists.)
        reduced = Reduced(problem, dominance, deadline)
        limit = None if problem.usage_limit is None else float(problem.usage_limit)
        reduced.reduce(limit, begin + 0.25 * (deadline - begin), eliminate=reduce, stop_by=deadline)
        reduce_seconds = time.perf_counter() - begin
        searched = Search(reduced, seed, deadline)
    except OutOfTime:
        fallback = fallback or _fallback(problem, begin, time_limit)
        if isinstance(fallback, NoPlanFoundError):
            raise fallback from None
        fallback.stats["seconds"] = time.perf_counter() - begin
        return fallback
    if time_limit is not None:
        deadline = _deadline_for_this_machine(problem, float(time_limit), begin, cpu_begin, deadline)
        # HiGHS's runs end at the deadline in worker processes, started now: they import HiGHS
        # while the heuristics run (started before the reductions, their imports took the CPU
        # a quick answer needed: 0.2 s of it became 0.5 s on a loaded machine).
        start_workers(_LNS_WORKERS)
    return searched, deadline, reduce_seconds


def _checked_arguments(problem: StrategyProblem, time_limit, search: str, start) -> list[int] | None:
    """``solve_problem``'s arguments checked (a clear error naming the bad one); ``start`` as a list."""
    if not isinstance(problem, StrategyProblem):
        raise TypeError(f"problem must be a StrategyProblem, got {type(problem).__name__}")
    if time_limit is not None:
        if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
            raise ValueError(f"time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
    if search not in _SEARCHES:
        raise ValueError(f"search must be one of {list(_SEARCHES)}, got {search!r}")
    if search == "toulbar2" and not wcsp.available():
        raise ImportError("search='toulbar2' needs pytoulbar2 (pip install pytoulbar2); search='auto' runs without it")
    return None if start is None else _check_strategies(problem, start).tolist()


class _Run:
    """One ``solve_problem`` call after the reductions, as its steps: heuristic plans, the
    portfolio's toulbar2 started, the unconstrained optimum repaired, the best adopted, the
    search until the deadline (toulbar2 alone, the whole program, the neighbourhoods), the
    portfolio's answer, and the answer checked. ``lower``: the best bound so far."""

    def __init__(
        self, problem: StrategyProblem, search: Search, mode: str, time_limit: float | None, begin: float,
        deadline: float, seed: int, dominance: str, start: list[int] | None, stats: dict,
    ) -> None:
        self.problem, self.search, self.mode, self.time_limit = problem, search, mode, time_limit
        self.begin, self.deadline, self.seed, self.dominance, self.start, self.stats = begin, deadline, seed, dominance, start, stats
        self.limit = None if problem.usage_limit is None else float(problem.usage_limit)
        self.lower = search.lower_bound()
        self.method = "reductions"
        self.by_wcsp = mode == "toulbar2" or (
            mode == "auto" and time_limit is not None and wcsp.available() and len(search.nodes) <= _WCSP_MAX_NODES
        )
        self.proven = False
        self.runner: _WcspRunner | None = None
        self.repairs = 0  # feasibility repairs run (each its own seed)
        self.bounded = False  # whether ``bound_and_dual`` ran

    def heuristic_plans(self) -> list[tuple[float, np.ndarray]]:
        """(cost, plan) of the heuristics: the greedy constructions, each repaired to make no
        forbidden choice (the feasibility phase) and improved node by node, and the cheapest
        strategies improved ignoring memory (if within the limit). The first construction
        comes first: where many pairs are forbidden, it and its repair are the first plan
        (on an 8000-node ``contest_like`` problem with the machine busy, the cheapest
        strategies' descent took 1.5 s of a 10 s limit, the construction's before its repair 1 s
        more, and the repair had no time left)."""
        search, deadline = self.search, self.deadline
        # Greedy constructions, the best kept: the cheapest first; the smallest usage first (memory
        # taken early may leave later nodes no compatible strategy), with and without charging
        # each choice its unassigned neighbours' best responses. Each needs a few seconds on
        # large problems, so the later ones only run while they leave most of the time limit.
        candidates: list[tuple[float, np.ndarray]] = []
        variants = [dict(lookahead=False), dict(frugal=True, lookahead=False), dict(frugal=True, lookahead=True)]
        for number, variant in enumerate(variants):
            if number and self.time_limit is not None and time.perf_counter() - self.begin > 0.3 * self.time_limit:
                break
            search.construct(deadline, **variant)
            self.feasible(search, any(cost < search.big for cost, _ in candidates))
            search.descend(deadline)
            candidates.append((search.objective(), search.s.copy()))
            if number == 0:
                candidates += self.cheapest_plan()
        return candidates

    def cheapest_plan(self) -> list[tuple[float, np.ndarray]]:
        """The cheapest strategies improved ignoring memory, if that is within the limit."""
        search = self.search
        search.start(least_usage=False)
        search.descend(self.deadline, respect_memory=False)
        return [(search.objective(), search.s.copy())] if search.violation() == 0 else []

    def feasible(self, search: Search, have_plan: bool) -> None:
        """The feasibility phase (``passes.solver.feasible``): a plan within the memory limit
        that still makes a forbidden choice (the constructions leave a few where many pairs
        are forbidden) repaired into one that makes none: with all the time left while there
        is no plan yet, else a fifth of it at most (measured: 0.01-0.3 s on 1-8k nodes)."""
        if search.violation() > 0 or search.objective() < search.big:
            return
        began = time.perf_counter()
        until = self.deadline if not have_plan else began + 0.2 * (self.deadline - began)
        repaired = repair_forbidden(search, until, self.seed + self.repairs)
        self.repairs += 1
        self.stats["feasibility_seconds"] = self.stats.get("feasibility_seconds", 0.0) + time.perf_counter() - began
        self.stats["feasibility_repaired"] = self.stats.get("feasibility_repaired", 0) + int(repaired)

    def start_portfolio(self, candidates: list) -> None:
        """``search="auto"`` with toulbar2: its thread started from the best plan so far, beside
        everything after this."""
        if self.by_wcsp and self.mode == "auto":
            self.search.assign(min(candidates, key=lambda candidate: candidate[0])[1])
            self.runner = _WcspRunner(self.search, self.deadline, self.seed)
            self.search.stop = self.runner.incumbent.stop

    def unconstrained_plan(self, candidates: list) -> None:
        """Where memory binds: the problem's optimum without the limit (reduced without it,
        which eliminates what memory kept; where the whole program is small), or the caller's
        ``start``, greedily repaired back within the limit, added to ``candidates``."""
        search, stats = self.search, self.stats
        if not len(search.rhs) or not (
            self.start is not None or (stats["pairs_left"] <= _FULL_MILP_PAIRS and self.mode != "toulbar2")
        ):
            return
        share = math.inf if self.time_limit is None else time.perf_counter() + 0.3 * (self.deadline - time.perf_counter())
        plan = (
            _unconstrained_plan(self.problem, self.dominance, self.seed, min(self.deadline, share)) if self.start is None else self.start
        )
        if plan is not None:
            search.assign_full(plan)
            if _repaired(search, self.deadline, min(self.deadline, time.perf_counter() + _REPAIR_SECONDS)):
                stats["unconstrained_start"] = search.objective()
                candidates.append((search.objective(), search.s.copy()))

    def adopt_best(self, candidates: list) -> None:
        """The cheapest candidate as the search's plan (offered to toulbar2 if within the limit)."""
        search = self.search
        search.assign(min(candidates, key=lambda candidate: candidate[0])[1])
        self.stats["start_violation"] = search.violation()
        best = search.objective()
        self.stats["heuristic_cost"] = best
        self.share_plan()

    def share_plan(self) -> None:
        """The search's plan offered to toulbar2's thread (the portfolio), if it is one."""
        if self.runner is not None and self.search.has_plan():
            self.runner.incumbent.offer(self.search.objective(), self.search.s)

    def search_to_the_deadline(self) -> None:
        """toulbar2 alone (``search="toulbar2"``); else the program over the whole reduced
        problem where it is small (or without a time limit), then, unless it or toulbar2 proved
        the optimum, a bound and the neighbourhood searches until the deadline."""
        if self.mode == "axes":
            self.mesh_axes()
            return
        if self.mode == "toulbar2":
            found, self.proven = _wcsp_phase(self.search, self.deadline, self.seed, self.stats)
            self.lower = max(self.lower, found)
            self.method = "toulbar2"
        if self.time_limit is not None and self.mode != "toulbar2":
            wait_for_workers(self.deadline)  # (started above; a run timed below does not count their start)
        runner = self.runner
        if self.mode == "toulbar2" or (runner is not None and runner.incumbent.proven.is_set()):
            pass
        elif self.time_limit is None or self.stats["pairs_left"] <= _FULL_MILP_PAIRS:
            if self.time_limit is not None and len(self.search.rhs):
                # With memory rows the whole program seldom improves the plan within a short
                # limit (it spent half of it for nothing); the dual-restricted programs do in a
                # fraction of it, and the program then starts from their plan. On 18 budgeted FX
                # problems (the example's decoder through the contest's format, HF Llama; 2x2,
                # 2x4, 2x2x2; budgets 0.2-0.8), against the better of the two orders: at 3 s
                # geometric mean 1.080 -> 1.002 (worst 1.27 -> 1.03), at 10 s 1.041 -> 1.001.
                self.bound_and_dual()
            self.whole_program()
        done = self.stats.get("milp_optimal") or self.mode == "toulbar2" or (runner is not None and runner.incumbent.proven.is_set())
        if not done and time.perf_counter() < self.deadline < math.inf:
            self.neighbourhoods()

    def mesh_axes(self) -> None:
        """The mesh-axis neighbourhoods (``_axis_search``) from the best plan so far; the
        program over the whole reduced problem where they found none."""
        search, stats = self.search, self.stats
        stats["exact_pair_variables"] = stats["pairs_left"]
        incumbent = (search.s.copy(), search.objective()) if search.has_plan() else None
        found = _axis_search(search, self.deadline, incumbent)
        if found is None:
            self.whole_program(last=True)
            return
        stats.update(found)
        self.method = "axes"

    def whole_program(self, *, last: bool = False) -> None:
        """HiGHS on the whole reduced problem, from the plan (half the time left where memory
        binds, unless ``last``: nothing searches after it)."""
        search, runner, stats = self.search, self.runner, self.stats
        self.method = "milp"
        left = math.inf if self.time_limit is None else self.deadline - time.perf_counter()
        if len(search.rhs) and not last:
            # (Memory rows make the whole program far slower to prove: leave the searches time.)
            left *= _MEMORY_MILP_SHARE
        status, chosen, bound = search.solve_milp(
            np.arange(len(search.nodes)),
            left,
            warm=search.objective() < search.big,
            deadline=self.deadline,
        )
        stats["milp_status"] = status
        if status == "infeasible" and runner is not None:
            runner.finish()  # (toulbar2 is told to stop: the program proved there is no plan)
        if status == "infeasible":
            raise InfeasiblePlacementError(
                f"no strategies meet usage_limit={self.limit} with finite cost (the MILP over the reduced problem is infeasible)"
            )
        if chosen is not None:
            for v, a in enumerate(chosen.tolist()):
                search.move(v, a)
        self.lower = max(self.lower, bound)
        stats["milp_optimal"] = status == "optimal"
        if runner is not None and stats["milp_optimal"]:
            runner.incumbent.proven.set()
            runner.incumbent.stop.set()
        else:
            self.share_plan()

    def bound_and_dual(self) -> None:
        """A min-sum diffusion bound (a tenth of the time left) and the dual-restricted programs
        (``_restricted_by_the_dual``, where they are small); once per call."""
        search, stats, deadline = self.search, self.stats, self.deadline
        if self.bounded:
            return
        self.bounded = True
        began = time.perf_counter()
        # (Where the dual-restricted programs will run, the diffusion also ranks their strategies:
        # twice the time, which on the 2x2x2 decoder took them from 1.11x to 1.01x; both capped,
        # as the priced rounds need the time on the contest's instances: S at 240 s went from
        # 1.04-1.08x to 1.12x the best team's cost with them uncapped.)
        dual = _dual_pairs(search, _DUAL_FIRST_WIDTH) <= _DUAL_PAIRS
        share = _BOUND_SHARE * (deadline - began)
        ranking = min(share, _DUAL_MOST_SECONDS / 3) if dual else 0.0
        self.lower = max(self.lower, search.diffusion_bound(began + share + ranking))
        stats["bound_seconds"] = time.perf_counter() - began
        if dual and search.diffused is not None:
            until = min(began + _DUAL_SHARE * (deadline - began), time.perf_counter() + _DUAL_MOST_SECONDS)
            stats["dual_restricted"] = _restricted_by_the_dual(search, until)
            self.share_plan()

    def neighbourhoods(self) -> None:
        """The bound and the dual-restricted programs (``bound_and_dual``), memory priced (where
        there is time for its rounds), then large neighbourhoods until the deadline."""
        search, stats, deadline = self.search, self.stats, self.deadline
        self.method = "milp-lns" if self.method == "milp" else "lns"
        self.bound_and_dual()
        began = time.perf_counter()
        priced = _LAGRANGIAN_SHARE * (deadline - began)
        # Rounds shortened (to a floor) so that the least number of them fits.
        round_seconds = min(_ROUND_SECONDS, priced / _LAGRANGIAN_MIN_ROUNDS)
        if self.limit is not None and len(search.rhs) and round_seconds >= _ROUND_LEAST_SHARE * _ROUND_SECONDS:
            stats["lagrangian_rounds"], stats["lagrangian_repairs"], dual, nearest = _lagrangian_search(
                self.problem, search, self.limit, began + priced, self.seed, round_seconds
            )
            stats["lagrangian_bound"] = dual
            self.lower = max(self.lower, dual)
            if nearest is not None:
                stats["nearest_repaired"] = self.repair_nearest(nearest)
            stats["lagrangian_cost"] = search.objective()
            stats["lagrangian_seconds"] = time.perf_counter() - began
        stats["lns_rounds"], stats["lns_improvements"], _ = _large_neighbourhood_search(
            search, deadline, incumbent=None if self.runner is None else self.runner.incumbent
        )

    def repair_nearest(self, plan: list[int]) -> bool:
        """The priced rounds' cheaper plan still above the limit (their 4-second repairs ran
        out), repaired for ``_NEAREST_REPAIR_SHARE`` of the time left; kept if it fits and is
        cheaper (or the search's plan does not fit), else the search's plan stays. Whether it
        was kept."""
        search = self.search
        previous, best = search.s.copy(), search.objective() if search.violation() == 0 else math.inf
        search.assign_full(plan)
        until = time.perf_counter() + _NEAREST_REPAIR_SHARE * (self.deadline - time.perf_counter())
        if _repaired(search, until, until) and search.objective() < best:
            return True
        search.assign(previous)
        return False

    def portfolio_answer(self) -> None:
        """The cheaper plan of the two engines (toulbar2's thread ends by the deadline: its
        worker is killed there), its bound and proof."""
        search, runner = self.search, self.runner
        found, proven_by_wcsp = runner.finish()
        self.lower = max(self.lower, found)
        self.stats.update(runner.stats)
        ours = search.objective() if search.violation() == 0 else math.inf
        if runner.best is not None and runner.best_cost < ours:
            search.assign(runner.best)
            self.method = "toulbar2"
        self.proven = proven_by_wcsp and search.objective() <= runner.best_cost
        self.stats["lns_cost"] = ours

    def answer(self) -> ProblemSolution:
        """The plan as the problem's strategies, checked, with its cost, bound and stats;
        ``NoPlanFoundError`` if it breaks the limit or makes a forbidden choice."""
        search, stats, limit, time_limit = self.search, self.stats, self.limit, self.time_limit
        stats["search_seconds"] = time.perf_counter() - self.begin
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
        cost = problem_cost(self.problem, strategies)
        if limit is not None and peak_usage(self.problem, strategies) > limit:  # pragma: no cover - a bug if reached
            raise AssertionError("the solver returned strategies above the usage limit")
        method = self.method
        stats.update(
            method=method, seconds=time.perf_counter() - self.begin,
            search="portfolio" if self.runner is not None else "toulbar2" if self.by_wcsp else "axes" if self.mode == "axes" else "exact",
            milps=search.milps, **search.milp_sizes,
            status="optimal" if stats.get("milp_optimal") or self.proven or not len(search.nodes) else f"{method} (not proven optimal)",
        )
        lower = _rounded_up(self.problem, self.lower, math.inf if time_limit is None else self.begin + float(time_limit))
        return ProblemSolution(strategies, cost, min(lower, cost), stats)


def _rounded_up(problem: StrategyProblem, lower: float, until: float) -> float:
    """``lower`` rounded up when every cost is a whole number (no solution costs less), if
    that is known by ``until`` (else as it is, which is still a bound)."""
    if not math.isfinite(lower) or lower == math.floor(lower) or not _integral(problem, until):
        return lower
    return math.ceil(lower - 1e-9 * max(1.0, abs(lower)))


# Below this many seconds per node and edge of time limit, ``solve_problem`` reads its quick
# answer before its reductions. Measured: the steps before the search take 2e-5 s per node and
# edge (8e-5 with the machine busy); the quick answer 1.3e-6 (so at most 0.7% of the limit).
_FALLBACK_SECONDS_PER_ENTRY = 2e-4


def _fallback(problem: StrategyProblem, begin: float, time_limit: float) -> ProblemSolution | NoPlanFoundError:
    """``_quick_answer``, or the error it raises (to raise only if it is needed)."""
    try:
        return _quick_answer(problem, begin, time_limit)
    except NoPlanFoundError as error:
        return error


def _quick_answer(problem: StrategyProblem, begin: float, time_limit: float | None) -> ProblemSolution:
    """The answer when the time limit came before the search's arrays were built (a large
    problem and a small limit): the cheaper of two plans read off the problem alone, every
    node on its cheapest strategy, or on its smallest usage (the cheapest such, which fits
    the memory limit whenever anything does), if one has finite cost and fits the limit;
    the lower bound, every node's and every edge's least cost. Else ``NoPlanFoundError``:
    nothing was proven, so never ``InfeasiblePlacementError``."""
    # Every node's strategies laid end to end (a loop of numpy calls per node took 1.3 s on a
    # 20k-node problem; sorting them, or padding them to rows, 0.5-0.7 s on a loaded machine).
    sizes = np.array([len(c) for c in problem.node_costs], dtype=np.int64)
    first = np.cumsum(sizes) - sizes
    costs = np.concatenate([np.zeros(0), *problem.node_costs])
    usages = np.concatenate([np.zeros(0), *problem.node_usages])
    if len(sizes):
        least = usages == np.repeat(np.minimum.reduceat(usages, first), sizes)
        plans = [_first_least(costs, first, sizes), _first_least(np.where(least, costs, np.inf), first, sizes)]
    else:
        plans = [np.zeros(0, np.int64)]
    edges = _FlatEdges(problem)
    steps = _TimeSteps(problem) if problem.usage_limit is not None else None
    found = []
    for plan in plans:
        cost = _plan_cost(problem, edges, plan, costs[first + plan])
        if math.isfinite(cost) and (steps is None or steps.peak_of(usages[first + plan]) <= problem.usage_limit):
            found.append((cost, plan.tolist()))
    if not found:
        raise NoPlanFoundError(
            f"the time limit ({time_limit} s) ran out before the search could start on this problem of "
            f"{problem.num_nodes} nodes, and neither its cheapest nor its smallest strategies make a plan "
            "(a forbidden choice, or above the usage limit); the problem is not proven infeasible"
        )
    cost, strategies = min(found, key=lambda f: f[0])
    least_nodes = np.minimum.reduceat(costs, first) if len(sizes) else np.zeros(0)
    lower = problem.constant + math.fsum(least_nodes.tolist()) + math.fsum(edges.least().tolist())
    seconds = time.perf_counter() - begin
    stats = dict(
        nodes=problem.num_nodes, edges=len(problem.edges), nodes_left=problem.num_nodes, edges_left=len(problem.edges),
        reduce_seconds=seconds, seconds=seconds, search_seconds=seconds, method="quick", search="quick", milps=0,
        status="quick (the time limit came before the search started; not proven optimal)",
    )
    return ProblemSolution(strategies, cost, min(lower, cost), stats)


# ``search="auto"`` runs toulbar2 beside the neighbourhood search on problems of at most this
# many nodes left after the reductions (above it, the neighbourhood search has both cores).
# Measured: on ``contest_like`` problems of up to 8000 nodes (up to ~7k left) toulbar2 found
# plans 1-60% cheaper than the neighbourhood search at 10 s; on the contest's instances A, M
# and S (18-23k nodes left, memory binding, 60-240 s) it found none of A in 9.7 s, and a
# portfolio that gave it most of the time cost 2.15 / 1.07 / 1.56x the best team against
# 1.74 / 1.05 / 1.11x for the neighbourhood search alone.
_WCSP_MAX_NODES = 10_000
# Where memory binds: toulbar2's first run (the problem without the memory rows) gets at most
# this share of its time, each later run (with the rows its plans broke) this share of what is
# left, and each run adds the rows its plan breaks most, this share of them (at least 5, at
# most ``_WCSP_MOST_ROWS``).
_WCSP_FIRST_SHARE = 0.7
_WCSP_ROUND_SHARE = 0.5
_WCSP_ROWS_ADDED = 0.5
# At most this many rows added per run (measured: with 451 rows toulbar2 found no plan in 1 s of
# a 2000-node problem, with 50 the optimum in 3 s).
_WCSP_MOST_ROWS = 64
# A run that has reported no plan after this share of its time stops (contest instance A,
# 23k nodes left: none in 9.7 s; the generated problems of up to 8000 nodes: the first within
# a few seconds), and toulbar2 ends: the neighbourhood search beside it gets its core.
_WCSP_FIRST_PLAN_SHARE = 0.4
_WCSP_FIRST_PLAN_SECONDS = 1.0  # (but never sooner than this: starting the worker takes ~0.2 s)


def _wcsp_phase(
    search: Search, deadline: float, seed: int, stats: dict, incumbent: _Incumbent | None = None
) -> tuple[float, bool]:
    """toulbar2 (``passes.solver.wcsp``) on the reduced problem until ``deadline``; leaves the
    best plan within the memory limit in ``search`` (its incumbent if none is better).
    Returns a lower bound and whether the plan left is proven optimal. ``incumbent``: the
    plan shared with the neighbourhood search running beside it (each run starts from the
    cheaper of the two and reports its plans to it; its ``stop`` ends the phase).

    Without memory rows: one run, the incumbent's cost its upper bound. With them (toulbar2's
    knapsack constraints over hundreds of rows make its search slow: on a 2000-node
    ``contest_like`` problem at tightness 1.1, no plan in 10 s with all 996 rows, the optimum
    in 3 s with 50): rows are added lazily. The first run has none (a relaxation: its bound
    bounds the problem, its optimum is the problem's if it fits); each plan that breaks the
    limit is repaired greedily (``Search.repair``) and improved node by node, and the next
    run adds the rows it broke most. Every run is told the best cost so far, so a run that
    ends without a plan proves that cost optimal; one that proves its rows infeasible proves
    the problem infeasible (if the model is exact, ``wcsp.WcspResult``)."""
    began = time.perf_counter()
    best_s = search.s.copy()
    best = search.objective() if search.has_plan() else math.inf
    # Without a plan within the limit: toulbar2's plan that breaks it least (it makes no
    # forbidden choice), left for the neighbourhood search to repair with memory priced.
    nearest: tuple[float, np.ndarray] | None = None
    lower = -math.inf
    rows: set[int] | None = set() if len(search.rhs) else None
    runs = []
    proven = False
    while True:
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        if incumbent is not None:
            if incumbent.stop.is_set():
                break
            shared_cost, shared_s = incumbent.get()
            if shared_s is not None and shared_cost < best:
                best, best_s = shared_cost, shared_s  # (toulbar2 must beat it)
        if rows is not None:
            left *= _WCSP_FIRST_SHARE if not runs else _WCSP_ROUND_SHARE
        now = time.perf_counter()
        result = wcsp.solve_wcsp(
            search, now + left if math.isfinite(left) else math.inf,
            upper=best, hint=best_s, seed=seed + len(runs), rows=rows,
            first_by=now + max(_WCSP_FIRST_PLAN_SHARE * left, _WCSP_FIRST_PLAN_SECONDS),
            stop=None if incumbent is None else incumbent.stop,
        )
        runs.append(dict(status=result.status, solutions=result.solutions, seconds=round(result.seconds, 3), rows=len(rows or ())))
        lower = max(lower, result.lower)
        if result.status == "infeasible":
            raise InfeasiblePlacementError("no strategies meet the usage limit with finite cost (toulbar2 proved it)")
        if result.chosen is None:
            proven = result.status == "optimal" and math.isfinite(best)
            break
        search.assign(result.chosen)
        fits = search.violation() == 0
        over = np.flatnonzero(search.load > search.rhs) if not fits else np.zeros(0, np.int64)
        runs[-1]["cost"] = search.objective()
        if not fits and search.objective() < search.big and (nearest is None or search.violation() < nearest[0]):
            nearest = (search.violation(), search.s.copy())
        if not fits:
            # (Greedily only: neighbourhoods would run HiGHS in this thread, on the core the
            # neighbourhood search beside it has.)
            _repaired(search, deadline, neighbourhoods_until=0.0)
        if search.violation() == 0 and search.objective() < best:
            best, best_s = search.objective(), search.s.copy()
            if incumbent is not None:
                incumbent.offer(best, best_s)
        exhaustive = result.status in ("optimal", "complete")
        if fits or (not exhaustive and rows is None) or result.status == "error":
            proven = fits and result.status == "optimal"
            break
        worst = over[np.argsort(-(search.load[over] - search.rhs[over]), kind="stable")] if len(over) else over
        rows |= set(worst[: min(_WCSP_MOST_ROWS, max(5, int(_WCSP_ROWS_ADDED * len(worst))))].tolist())
    if math.isinf(best) and nearest is not None:
        best_s = nearest[1]
    search.assign(best_s)
    stats.update(wcsp_runs=runs, wcsp_seconds=time.perf_counter() - began, wcsp_lower=lower, wcsp_cost=best)
    return lower, proven


class _Incumbent:
    """The cheapest plan within the memory limit found so far by either engine of the portfolio
    (a strategy per node of the search), shared between threads; ``proven``: set when an
    engine proved it optimal; ``stop``: set to end both engines (a proof of optimality or of
    infeasibility, or the answer is being taken); ``done``: set when toulbar2 has ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cost = math.inf
        self.s: np.ndarray | None = None
        self.proven = threading.Event()
        self.stop = threading.Event()
        self.done = threading.Event()

    def offer(self, cost: float, s: np.ndarray) -> bool:
        """Keep ``s`` (a plan within the limit, of cost ``cost``) if it is the cheapest so far."""
        with self._lock:
            if cost < self.cost - 1e-9 * max(1.0, abs(self.cost) if math.isfinite(self.cost) else 0.0):
                self.cost, self.s = float(cost), np.array(s, dtype=np.int64)
                return True
            return False

    def get(self) -> tuple[float, np.ndarray | None]:
        with self._lock:
            return self.cost, None if self.s is None else self.s.copy()


class _WcspRunner:
    """toulbar2 (``_wcsp_phase``) in a thread of its own until ``deadline``, on a fork of the
    search (its own incumbent, the reduced problem shared), started from the search's plan.
    The thread mostly waits on toulbar2's worker process (a core of its own); the plans it
    finds go to ``incumbent``. ``finish()`` ends it and gives its bound and proof."""

    def __init__(self, search: Search, deadline: float, seed: int) -> None:
        self.incumbent = _Incumbent()
        self.stats: dict = {}
        self.best: np.ndarray | None = None
        self.best_cost = math.inf
        self._lower = -math.inf
        self._proven = False
        self._error: BaseException | None = None
        self._fork = search.fork(seed + 1)
        self._deadline = deadline
        self._seed = seed
        self._thread = threading.Thread(target=self._run, name="toulbar2", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fork = self._fork
        try:
            self._lower, self._proven = _wcsp_phase(fork, self._deadline, self._seed, self.stats, self.incumbent)
            if fork.has_plan():
                self.best, self.best_cost = fork.s.copy(), fork.objective()
            if self._proven:
                self.incumbent.proven.set()
                self.incumbent.stop.set()
        except InfeasiblePlacementError as error:  # (a proof: both engines end; ``finish`` raises it)
            self._error = error
            self.incumbent.stop.set()
        except BaseException as error:  # noqa: BLE001 (re-raised by ``finish``; the other engine goes on)
            self._error = error
        finally:
            self.incumbent.done.set()

    def finish(self) -> tuple[float, bool]:
        """Stop toulbar2 (if still running), wait for its thread; its lower bound and whether
        its plan (``best``) is proven optimal. Re-raises what it raised (a proof of
        infeasibility: ``InfeasiblePlacementError``)."""
        self.incumbent.stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._lower, self._proven


# The share of the time left the program over the whole problem gets when memory binds.
_MEMORY_MILP_SHARE = 0.5


def _unconstrained_plan(problem: StrategyProblem, dominance: str, seed: int, deadline: float) -> list[int] | None:
    """The problem's optimum without its memory limit (``None`` if its program is too large
    or not solved by ``deadline``)."""
    if time.perf_counter() >= deadline:
        return None
    try:
        reduced = Reduced(problem, dominance, deadline)
        reduced.reduce(None, deadline, stop_by=deadline)
        free = Search(reduced, seed, deadline)
    except InfeasiblePlacementError:  # pragma: no cover - the constrained reductions said so first
        return None
    except OutOfTime:
        return None
    if not len(free.nodes):
        return free.plan()
    if free.pair_count(deadline) > _FULL_MILP_PAIRS or time.perf_counter() >= deadline:
        return None
    free.start(least_usage=False)
    free.descend(deadline, respect_memory=False)
    _, chosen, _ = free.solve_milp(np.arange(len(free.nodes)), math.inf, warm=free.objective() < free.big, deadline=deadline)
    if chosen is None:
        return None
    free.assign(chosen)
    return free.plan()


def _answer_reserve(problem: StrategyProblem, time_limit: float) -> float:
    """Seconds of a time limit kept after the search: for a cancelled engine call to stop, and
    for expanding and checking the plan (measured: 0.3 s for 20k nodes and 27k edges)."""
    return min(0.2 * time_limit, _KILL_SECONDS + 0.1 + 1e-5 * (problem.num_nodes + len(problem.edges)))


def _deadline_for_this_machine(problem: StrategyProblem, time_limit: float, begin: float, cpu_begin: float, deadline: float) -> float:
    """``deadline`` moved earlier by as much as the steps so far ran slower than their CPU time
    (the steps before the search run on one thread): on a machine whose cores are shared, the
    steps after the deadline (stopping the engines, expanding and checking the plan) stretch as
    much. Measured in CI with the next environment unpacking: 1.35 s past a 3 s limit."""
    wall, cpu = time.perf_counter() - begin, time.process_time() - cpu_begin
    if cpu < _LEAST_CPU_TO_MEASURE or wall <= cpu:
        return deadline
    reserve = _answer_reserve(problem, time_limit) * min(wall / cpu, _MOST_SLOWDOWN)
    return min(deadline, begin + time_limit - min(reserve, _MOST_RESERVED * time_limit))


# Below this much CPU time the ratio of wall to CPU time is mostly the clocks' resolution.
_LEAST_CPU_TO_MEASURE = 0.02
# The slowdown trusted, and the share of the time limit kept for the answer, at most.
_MOST_SLOWDOWN = 5.0
_MOST_RESERVED = 0.4


# Seconds for killing a worker at the deadline and reaping it.
_KILL_SECONDS = 0.1


def _first_least(values: np.ndarray, first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per segment ``values[first[k]:first[k] + sizes[k]]`` (none empty, no NaN), the index in
    it of its first least value (every segment holds its least: ``inf == inf`` too)."""
    hits = np.flatnonzero(values == np.repeat(np.minimum.reduceat(values, first), sizes))
    return hits[np.searchsorted(hits, first)] - first


def _plan_cost(problem: StrategyProblem, edges: _FlatEdges, plan: np.ndarray, node_costs: np.ndarray) -> float:
    """``problem_cost`` of ``plan`` (its nodes' costs given; ``inf`` if a choice is forbidden)."""
    values = edges.costs(plan)
    if not (np.isfinite(node_costs).all() and np.isfinite(values).all()):
        return math.inf
    return math.fsum(node_costs.tolist()) + math.fsum(values.tolist()) + problem.constant


def _integral(problem: StrategyProblem, until: float = math.inf) -> bool:
    """Whether every finite cost is a whole number (then a bound rounds up); False if not
    known by ``until`` (a 20k-node problem's tables take 0.4 s)."""
    tables = [*problem.node_costs, *problem.edge_costs]
    for first in range(0, len(tables), 1024):
        if time.perf_counter() >= until:
            return False
        values = np.concatenate([np.zeros(0), *(m.ravel() for m in tables[first : first + 1024])])
        finite = values[np.isfinite(values)]
        if not np.all(finite == np.round(finite)):
            return False
    return True


_LNS_MIN_PAIRS = 2_000  # the smallest neighbourhood, in pair variables
_LNS_FIRST_PAIRS = 20_000  # the first rounds' neighbourhoods


# Neighbourhoods solved at once per round: one per core (HiGHS runs single-threaded).
_LNS_WORKERS = max(1, min(2, os.cpu_count() or 1))


def _lns_seeds(search: Search, rounds: int, penalty: float | None, forbidden: bool) -> tuple:
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


# The dual-restricted programs (``_restricted_by_the_dual``): programs of at most this many pair
# variables, each node's strategies doubled from this many, until this share of the time left
# when the bound began, and for at most this many seconds (the diffusion's extra time for
# their ranking: a third of it). Measured on the FX front's decoder on a 2x2x2 mesh through
# the contest's format (243 nodes left, 105 strategies each): the neighbourhoods ended at 1.42x
# in 10 s and 1.06x in 60 s; restricted to 2 / 4 / 8 strategies the whole program gave 1.28 /
# 1.05 / 1.00x, each in under 0.5 s.
_DUAL_PAIRS = 200_000
_DUAL_FIRST_WIDTH = 2
_DUAL_SHARE = 0.4
_DUAL_MOST_SECONDS = 6.0
# The share of the time left the min-sum diffusion (the bound) gets.
_BOUND_SHARE = 0.1


def _dual_pairs(search: Search, width: int) -> int:
    """At most the pair variables of the dual-restricted program of ``width`` (each node's
    ``width`` strategies and its plan's)."""
    counts = np.minimum(width + 1, np.diff(search.cost_start))
    return int((counts[search.edge_i] * counts[search.edge_j]).sum())


def _restricted_by_the_dual(search: Search, deadline: float) -> int:
    """The program over every node, each restricted to its plan's strategy and the ``width``
    strategies the diffusion's reparametrized costs (``search.diffused``) rank cheapest,
    solved (to ``_NEIGHBOURHOOD_GAP``) for ``width`` 2, 4, 8, ... while the program has at
    most ``_DUAL_PAIRS`` pair variables, each solve ends optimal, and the time allows. A
    neighbourhood of values, not of nodes: where many strategies make a few edges fill a
    node neighbourhood, it moves every node's layout at once, as the mesh-axis coarse level
    does with the codes the contest's format drops. The plan only improves (it is in every
    program). Returns the widest width solved (0: none)."""
    ranks = [np.argsort(costs, kind="stable") for costs in search.diffused]
    widest = int(np.diff(search.cost_start).max())
    solved, width = 0, _DUAL_FIRST_WIDTH
    while time.perf_counter() < deadline and _dual_pairs(search, width) <= _DUAL_PAIRS:
        masks = {}
        for v, order in enumerate(ranks):
            mask = np.zeros(len(order), dtype=bool)
            mask[order[:width]] = True
            mask[search.s[v]] = True
            masks[v] = mask
        valid = search.has_plan()
        status, chosen, _ = search.solve_milp(
            np.arange(len(search.nodes)), deadline - time.perf_counter(), valid, deadline=deadline, masks=masks, gap=_NEIGHBOURHOOD_GAP
        )
        if chosen is not None and _plan_cost_within(search, chosen) < (search.objective() if valid else math.inf):
            search.assign(chosen)
        if status != "optimal":
            break
        solved = width
        if width >= widest:
            break
        width *= 2
    return solved


def _large_neighbourhood_search(
    search: Search, deadline: float, budget: int | None = None, incumbent: _Incumbent | None = None, until_fits: bool = False
) -> tuple[int, int, int]:
    """Re-solve neighbourhoods of the incumbent as MILPs until the deadline, the first of
    ``budget`` pair variables; rounds, improvements, and the size for a next call.

    ``incumbent``: the plan shared with toulbar2 running beside this search (the portfolio):
    each round first adopts it if it is cheaper (or the search has no plan within the limit
    yet), every improvement is offered to it, and a proof of its optimality ends the search.
    While toulbar2 runs, one neighbourhood fewer is solved per round (it has a core).

    While the incumbent breaks the memory limit, the limit is soft (priced per unit above it, the
    price rising while it stays broken) and neighbourhoods grow from nodes live where it is broken;
    ``until_fits``: the search ends once the plan is within the limit (a repair).
    """
    lns = _Lns(search, budget or _LNS_FIRST_PAIRS, incumbent)
    while True:
        workers = lns.adopt_shared()
        if workers == 0:
            break  # (a proof: of this plan's optimality, or that there is none)
        left = deadline - time.perf_counter()
        # A round runs over by its model's building and HiGHS past its own time limit (measured
        # on instance A: a 470k-column round given 8.9 s took 12.6 s, 6 s of it building): a
        # round's neighbourhood is no larger than the slowest round's seconds per pair variable
        # say half of what is left allows, and HiGHS gets at most half of what is left.
        if left < 0.2 + (0.0 if lns.seconds_per_pair is None else 2 * _LNS_MIN_PAIRS * lns.seconds_per_pair):
            break
        lns.drop_penalty_if_fits()
        size = lns.size(left)
        frees = lns.neighbourhoods(size, workers)
        results = lns.solve(frees, size, left, deadline)
        lns.apply(frees, results)
        if until_fits and search.violation() == 0:
            break
        if len(frees[0]) >= len(search.nodes) and results[0][0] == "optimal" and lns.penalty is None:
            break
    return lns.rounds, lns.improvements, lns.budget


def _repaired(search: Search, deadline: float, neighbourhoods_until: float) -> bool:
    """``search``'s plan brought back within the memory limit: greedily (``Search.repair``, one
    node's move at a time) until ``deadline``; where that stops short (every move that frees
    memory at a broken step would make a forbidden pair with a neighbour as it is), by
    neighbourhoods grown from the broken steps with the limit priced, which move neighbours
    together, until ``neighbourhoods_until``. Then each node improved alone. Whether it fits.
    (Contest instance S at 0.95 of its limit: the priced rounds' plans, 14-37 steps above the
    limit, were never repaired greedily, and the search ended at 1.3x their cost.)"""
    if not search.repair(deadline) and time.perf_counter() < neighbourhoods_until:
        _large_neighbourhood_search(search, neighbourhoods_until, until_fits=True)
    if search.violation() > 0:
        return False
    search.descend(deadline)
    return True


class _Lns:
    """The state of ``_large_neighbourhood_search``: the plan's score (its cost, plus the price
    of the memory above the limit while it breaks it), the next neighbourhood's size, and the
    counts of rounds and improvements."""

    def __init__(self, search: Search, budget: int, incumbent: _Incumbent | None) -> None:
        self.search = search
        self.budget = budget
        self.incumbent = incumbent
        self.rounds = self.improvements = 0
        self.penalty = None
        self.stuck = 0
        if search.violation() > 0:
            self.penalty = max(search.objective(), 1.0) / search.violation()
        self.current = self.score()
        self.seconds_per_pair = None  # the slowest round's seconds per pair variable of its budget

    def score(self) -> float:
        search = self.search
        return search.objective() + (self.penalty * search.violation() if self.penalty is not None else 0.0)

    def adopt_shared(self) -> int:
        """The plan toulbar2 shared, if cheaper (or this one breaks the limit); the
        neighbourhoods to solve this round (0: a proof was found, the search ends)."""
        incumbent, search = self.incumbent, self.search
        if incumbent is None:
            return _LNS_WORKERS
        if incumbent.stop.is_set():
            return 0
        shared_cost, shared_s = incumbent.get()
        fits = self.penalty is None and search.violation() == 0
        if shared_s is not None and (not fits or shared_cost < search.objective() - 1e-9 * max(1.0, abs(self.current))):
            search.assign(shared_s)
            self.penalty = None
            self.current = self.score()
        return _LNS_WORKERS if incumbent.done.is_set() else max(1, _LNS_WORKERS - 1)

    def drop_penalty_if_fits(self) -> None:
        if self.penalty is not None and self.search.violation() == 0:
            self.penalty = None
            self.current = self.score()

    def size(self, left: float) -> int:
        """Pair variables of this round's neighbourhoods: the budget, or what half of the time
        left allows at the slowest round's pace."""
        if self.seconds_per_pair is None:
            return self.budget
        return max(_LNS_MIN_PAIRS, min(self.budget, int(0.5 * left / self.seconds_per_pair)))

    def neighbourhoods(self, size: int, workers: int) -> list[np.ndarray]:
        """One neighbourhood per core, disjoint (each solved against the incumbent, then applied
        one after the other while each gains)."""
        search = self.search
        forbidden = self.current >= search.big
        frees: list[np.ndarray] = []
        for _ in range(workers):
            free = search.neighbourhood(size, *_lns_seeds(search, self.rounds, self.penalty, forbidden))
            for other in frees:
                free = np.setdiff1d(free, other, assume_unique=True)
            if len(free):
                frees.append(free)
            self.rounds += 1
        return frees

    def solve(self, frees: list[np.ndarray], size: int, left: float, deadline: float) -> list[tuple]:
        """Each neighbourhood's program, solved at once (HiGHS runs without the GIL); the next
        budget from how it went."""
        search = self.search
        began = time.perf_counter()
        solve = functools.partial(
            search.solve_milp, time_limit=min(10.0, 0.5 * left), warm=True, penalty=self.penalty,
            soft_forbidden=self.current >= search.big, deadline=deadline, want_bound=False,
        )
        if len(frees) == 1:
            results = [solve(frees[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(frees)) as pool:
                results = list(pool.map(solve, frees))
        took = time.perf_counter() - began
        self.seconds_per_pair = max(self.seconds_per_pair or 0.0, took / max(size, 1))
        statuses = [status for status, _, _ in results]
        if all(status == "optimal" for status in statuses) and took < 2.0:
            self.budget = min(int(self.budget * 1.3), 400_000)
        elif any(status != "optimal" for status in statuses):
            self.budget = max(int(self.budget / 1.5), _LNS_MIN_PAIRS)
        return results

    def apply(self, frees: list[np.ndarray], results: list[tuple]) -> None:
        """Each neighbourhood's strategies, kept if the score drops (a neighbourhood solved
        against the incumbent may not fit beside another's moves), else undone; the price of
        memory raised while the plan stays above the limit."""
        search, incumbent = self.search, self.incumbent
        for free, (_, chosen, _) in zip(frees, results):
            if chosen is None:
                continue
            previous = search.s[free].copy()
            for v, a in zip(free.tolist(), chosen.tolist()):
                search.move(v, a)
            new = self.score()
            fits = self.penalty is not None or search.violation() == 0
            if fits and new < self.current - 1e-9 * max(1.0, abs(self.current)):
                self.current = new
                self.improvements += 1
                self.stuck = 0
                if incumbent is not None and search.has_plan():  # (its score is then its cost)
                    incumbent.offer(new, search.s)
            else:
                for v, a in zip(free.tolist(), previous.tolist()):
                    search.move(v, a)
                self.stuck += 1
                if self.penalty is not None and self.stuck >= 5:
                    self.penalty *= 4.0
                    self.current = self.score()
                    self.stuck = 0


# The memory limit priced instead of constrained, for this share of the search's time when it
# allows this many rounds of this many seconds (each reduces the priced problem anew). Three
# rounds already pay: on generated contest-like problems of 15k nodes at 60 s (tightness 1.3 to
# 3, four seeds), which ten rounds left unpriced, plans 8-15% cheaper; on contest instance A,
# 1.86x -> 1.39x the best team's cost.
_LAGRANGIAN_SHARE = 0.6
_LAGRANGIAN_MIN_ROUNDS = 3
_ROUND_SECONDS = 8.0
# Rounds are shortened for the least number to fit, down to this share of their length (the
# priced problem of a 35k-node instance takes 1.3-2.4 s to reduce).
_ROUND_LEAST_SHARE = 0.6
# Each round, prices where the limit is broken grow by this factor; elsewhere they decay by that.
_PRICE_GROWTH = 2.0
_PRICE_DECAY = 0.8
# Prices stay below this (a node's price summed over its lifetime times its usage stays finite).
_PRICE_CAP = 1e100
# A round's plan above the limit at no more than this share of the time steps is repaired,
# each part of the repair for at most this many seconds.
_REPAIR_STEPS = 0.05
_REPAIR_SECONDS = 4.0
# After the rounds, the plan a round's repair left nearest the limit (still cheaper than the
# best within it) is repaired again for this share of the time left. Contest instance S at 0.95
# of its limit: greedy moves took the rounds' plans 90% of the way back, the neighbourhoods
# most of the rest in their 2-3 s, and no round's plan was ever kept.
_NEAREST_REPAIR_SHARE = 0.25


def _lagrangian_search(
    problem: StrategyProblem, main: Search, limit: float, deadline: float, seed: int, round_seconds: float | None = None
) -> tuple[int, int, float, list[int] | None]:
    """Memory priced instead of constrained (a Lagrangian relaxation): each round puts a price
    on every time step, a node paying their sum over its lifetime per unit of its usage;
    reduces the priced problem without a limit, which eliminates what memory kept (on
    contest instance M, 18.7k nodes left become 1.9k), and searches it from the last round's
    plan (``_search_priced``); then raises the prices where the limit is broken and lowers them
    where it is not. Each round lasts ``round_seconds`` (``_ROUND_SECONDS``). ``main`` (the
    constrained search) ends on the best plan within the limit, its own incumbent if none
    beats it. Returns the rounds, how many of them a repair made count, the best lower bound
    the rounds proved (the Lagrangian dual at each round's prices; ``-inf`` if none), and the
    plan (one strategy per node of the problem) a failed repair left nearest the limit while
    cheaper than ``main``'s, or None."""
    round_seconds = _ROUND_SECONDS if round_seconds is None else round_seconds
    steps = _TimeSteps(problem)
    points, lo, hi, loads = steps.points, steps.lo, steps.hi, steps.loads

    current = main.plan()
    best_cost = problem_cost(problem, current)
    prices = np.zeros(len(points))
    unit = None
    rounds = repairs = 0
    budget = None
    bound = -math.inf
    nearest = None  # (memory above the limit, plan): the round's plan whose repair came closest
    while deadline - time.perf_counter() > 0.5 * round_seconds:
        rounds += 1
        began = time.perf_counter()
        stop = min(deadline, began + round_seconds)
        search = _priced_problem(problem, prices, lo, hi, began, stop, seed + rounds)
        if search is None:
            break
        if len(search.nodes):
            search.assign_full(current)
            search.descend(stop, respect_memory=False)
            budget, priced_bound = _search_priced(search, stop, seed + rounds, budget)
        else:
            priced_bound = search.lower_bound()
        # The Lagrangian dual: every plan within the limit pays at most ``limit`` at each step, so
        # costs at least the priced problem's bound less the prices times the limit (less a
        # margin for the rounding of the two large terms).
        charged = float(prices.sum()) * limit
        dual = priced_bound - charged
        if math.isfinite(dual):
            bound = max(bound, dual - 1e-9 * (abs(priced_bound) + charged))
        plan = search.plan()
        load = loads(plan)
        over = load > limit
        cost = problem_cost(problem, plan)
        if cost < best_cost and over.sum() <= max(1.0, _REPAIR_STEPS * len(points)):
            # Cheaper, and within the limit or just above it: in the constrained search, back
            # within it (``_repaired``) and each node improved alone.
            previous = main.s.copy()
            main.assign_full(plan)
            if over.any():
                until = min(deadline, time.perf_counter() + _REPAIR_SECONDS)
                _repaired(main, until, until)
            found = main.objective()
            # (A strategy the constrained reductions dropped may also map to a worse one there.)
            if main.violation() == 0 and found < best_cost:
                best_cost = found
                repairs += bool(over.any())
            else:
                if main.violation() > 0 and found < best_cost and (nearest is None or main.violation() < nearest[0]):
                    nearest = (main.violation(), main.plan())
                main.assign(previous)
        if over.any():
            if unit is None:
                unit = _first_price(best_cost, cost, float(np.maximum(load - limit, 0.0).sum()))
            prices[over] = np.minimum(np.maximum(prices[over] * _PRICE_GROWTH, unit), _PRICE_CAP)
        prices[~over] *= _PRICE_DECAY
        current = plan
    if nearest is not None and main.objective() <= problem_cost(problem, nearest[1]):
        nearest = None  # (a later round found a plan within the limit cheaper than it)
    return rounds, repairs, bound, None if nearest is None else nearest[1]


def _priced_problem(
    problem: StrategyProblem, prices: np.ndarray, lo: np.ndarray, hi: np.ndarray, began: float, stop: float, seed: int
) -> Search | None:
    """The problem with each node paying the ``prices`` of the time steps it lives over per unit
    of its usage, reduced without a limit (a third of the round at most), as a search; None if
    the round's time ran out first."""
    cumulative = np.concatenate([[0.0], np.cumsum(prices)])
    paid = cumulative[hi] - cumulative[lo]
    try:
        reduced = Reduced(problem, deadline=stop)
        for v in np.flatnonzero(paid > 0).tolist():
            reduced.cost[v] = reduced.cost[v] + paid[v] * reduced.usage[v]
        reduced.reduce(None, began + 0.3 * (stop - began), stop_by=stop)
        return Search(reduced, seed, stop)
    except InfeasiblePlacementError:  # pragma: no cover - the constrained reductions said so first
        # The priced problem has every plan of the problem (finite prices keep finite costs
        # finite): nothing is proven here that the constrained reductions did not prove.
        return None
    except OutOfTime:
        return None


def _first_price(best_cost: float, cost: float, above: float) -> float:
    """The first price of a unit of memory: what the round's plan saved (``best_cost - cost``)
    per unit of memory it has ``above`` the limit."""
    # (The incumbent may still make a forbidden choice: its cost is infinite, and an infinite
    # price would make every strategy of the priced problem infinite.)
    finite = [c for c in (best_cost, cost) if math.isfinite(c)]
    saved = best_cost - cost if len(finite) == 2 and best_cost > cost else 1e-9 * max(map(abs, finite), default=0.0)
    return (saved or 1.0) / above


def _search_priced(search: Search, stop: float, seed: int, budget: dict | None) -> tuple[dict | None, float]:
    """A round's priced problem (no memory rows) searched until ``stop``: by toulbar2 first when
    it is small enough (``_PRICED_WCSP_SHARE`` of the round, from the round's plan), then by
    large neighbourhoods. Returns the neighbourhood search's budget and a lower bound of the
    priced problem: toulbar2's (soft arc consistency, a dual bound) where it ran, else the
    node minima."""
    bound = search.lower_bound()
    if _PRICED_WCSP_SHARE and wcsp.available() and len(search.nodes) <= _WCSP_MAX_NODES:
        now = time.perf_counter()
        upper = search.objective()
        result = wcsp.solve_wcsp(search, now + _PRICED_WCSP_SHARE * (stop - now), upper=upper, hint=search.s.copy(), seed=seed)
        if result.chosen is not None:
            search.assign(result.chosen)
        # (Given ``upper``, toulbar2 bounds the plans cheaper than it: the round's plan is one.)
        bound = max(bound, min(result.lower, upper))
    return _large_neighbourhood_search(search, stop, budget)[2], bound


# The share of a priced round toulbar2 searches first (0: neighbourhoods only).
_PRICED_WCSP_SHARE = 0.7


# A neighbourhood of the axis search stops within 0.1% of its optimum: a plane of 70k variables
# took 3-6 s to prove that no plan 0.03% cheaper was left (LLaMA-3 70B on 8x8x8), 1-2 s to get
# within 0.1%.
_NEIGHBOURHOOD_GAP = 1e-3
# The share of the time left the coarse level of the mesh-axis policy gets when a plan exists.
_COARSE_SHARE = 0.5


def _axis_count(search: Search) -> int:
    """The mesh axes of the search's nodes' codes (0: no node has codes)."""
    counts = [codes.shape[1] for v in search.nodes.tolist() if (codes := search.reduced.axes(v)) is not None]
    return max(counts, default=0)


def _axis_search(search: Search, deadline: float, incumbent: tuple[np.ndarray, float] | None = None) -> dict | None:
    """The mesh-axis neighbourhood policy, on a problem too large for one integer program.

    1. Coarse: every node with codes keeps only the strategies that place alike on the first two
       mesh axes (the mesh with those two axes merged; the next pair if that is infeasible),
       solved exactly.
    2. Refine: every node may change its layout on any one axis (each node its own axis) from
       the plan so far; then (3 or more axes) every plane of two axes at once, each a program of
       its own, solved at once (HiGHS runs outside the GIL, or in worker processes), the largest
       first; repeated while the plan gets cheaper.

    Nodes without codes are free in every neighbourhood. Each step is an integer program over a
    subset of the strategies that holds the plan so far (the coarse level exact, a
    neighbourhood to within ``_NEIGHBOURHOOD_GAP``), so the plan only improves, but it is the
    best found in these neighbourhoods, not a proven optimum. ``incumbent``: (plan, cost) of a
    plan within the limit, refined if it is cheaper than the coarse level's. Leaves the plan in
    ``search``; its stats, or ``None`` when there is neither an incumbent nor a coarse level
    (infeasible, or out of time).
    """
    coded = {v: codes for v in range(len(search.nodes)) if (codes := search.reduced.axes(int(search.nodes[v]))) is not None}
    ndim = max(codes.shape[1] for codes in coded.values())
    stats = dict(coarse_costs=[], refine_costs=[])
    # With a plan already (``incumbent``: the heuristics', within the limit), the coarse level
    # gets half the time left, the neighbourhoods refine whichever plan is cheaper: on a
    # 478-node decoder on a 2x2x2 mesh, its program alone took 9 s, and a 3 s limit ended with
    # no plan.
    now = time.perf_counter()
    coarse_until = deadline if incumbent is None else now + _COARSE_SHARE * (deadline - now)
    best = _coarse_plan(search, coded, ndim, coarse_until, stats)
    if incumbent is not None and (best is None or incumbent[1] < best[1]):
        best = incumbent
    if best is None:
        return None
    best = _refine_by_axes(search, coded, ndim, best, deadline, stats)
    search.assign(best[0])
    return stats


def _axis_program(search: Search, masks: dict[int, np.ndarray], warm: bool, gap: float, deadline: float) -> tuple[str, np.ndarray | None]:
    """The program over every node, each restricted to the strategies ``masks`` allow: (status, plan)."""
    status, chosen, _ = search.solve_milp(np.arange(len(search.nodes)), math.inf, warm, deadline=deadline, masks=masks, gap=gap)
    return status, chosen


def _plan_cost_within(search: Search, chosen: np.ndarray) -> float:
    """The cost of the plan ``chosen`` (``inf`` above the memory limit); the search's plan unchanged."""
    previous = search.s.copy()
    search.assign(chosen)
    found = search.objective() if search.violation() == 0 else math.inf
    search.assign(previous)
    return found


def _coarse_plan(search: Search, coded: dict, ndim: int, deadline: float, stats: dict) -> tuple[np.ndarray, float] | None:
    """Step 1 of ``_axis_search``: every coded node keeps the strategies that place alike on two
    mesh axes (the first pair whose program is feasible), solved exactly; (plan, cost), or
    ``None`` (no pair feasible, or the deadline came first)."""
    for a, b in itertools.combinations(range(ndim), 2):
        masks = {v: codes[:, a] == codes[:, b] for v, codes in coded.items()}
        if any(not mask.any() for mask in masks.values()):
            continue
        status, chosen = _axis_program(search, masks, False, MIP_GAP, deadline)
        if chosen is None:
            if status == "infeasible":
                continue
            return None  # the deadline came first
        cost = _plan_cost_within(search, chosen)
        stats["coarse_costs"].append(cost)
        if math.isfinite(cost):
            return chosen, cost  # one coarse level is a start; the neighbourhoods below untie it
    return None


def _one_axis(coded: dict, plan: np.ndarray) -> dict[int, np.ndarray]:
    """Masks: every coded node may change its layout on any one mesh axis from ``plan``."""
    return {v: (codes != codes[plan[v]]).sum(axis=1) <= 1 for v, codes in coded.items()}


def _plane(coded: dict, ndim: int, plan: np.ndarray, pair: tuple[int, int]) -> dict[int, np.ndarray]:
    """Masks: every coded node may change its layout on the two mesh axes ``pair`` from ``plan``."""
    fixed = [axis for axis in range(ndim) if axis not in pair]
    return {v: (codes[:, fixed] == codes[plan[v], fixed]).all(axis=1) for v, codes in coded.items()}


def _refine_by_axes(
    search: Search, coded: dict, ndim: int, best: tuple[np.ndarray, float], deadline: float, stats: dict
) -> tuple[np.ndarray, float]:
    """Step 2 of ``_axis_search``: the one-axis neighbourhood of the plan so far, then (3 or
    more axes) every plane of two axes, solved at once, the largest first; repeated while
    the plan gets cheaper, until the deadline. The best (plan, cost)."""
    planes = list(itertools.combinations(range(ndim), 2)) if ndim >= 3 else []
    one_axis_from = planes_from = None  # the plans those neighbourhoods were last solved from
    first_round = True
    search.assign(best[0])
    while time.perf_counter() < deadline:
        plan = best[0]
        tasks = []
        if one_axis_from is not plan:
            tasks.append(_one_axis(coded, plan))
            one_axis_from = plan
        if planes and planes_from is not plan and not first_round:
            tasks += [_plane(coded, ndim, plan, pair) for pair in planes]
            planes_from = plan
        first_round = False
        if not tasks:
            break
        tasks.sort(key=lambda masks: -sum(int(m.sum()) for m in masks.values()))
        search.assign(plan)  # every neighbourhood from the plan so far
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(tasks), os.cpu_count() or 1)) as pool:
            results = list(pool.map(lambda masks: _axis_program(search, masks, True, _NEIGHBOURHOOD_GAP, deadline), tasks))
        found = [(chosen, _plan_cost_within(search, chosen)) for _, chosen in results if chosen is not None]
        stats["refine_costs"].extend(cost for _, cost in found)
        improved = [f for f in found if f[1] < best[1] - 1e-12 * abs(best[1])]
        if improved:
            best = min(improved, key=lambda f: f[1])
    return best


def _finite_max_sum(flat: np.ndarray, start: np.ndarray) -> float:
    """The sum over the segments ``flat[start[k]:start[k + 1]]`` (none empty) of each one's
    largest finite value (0 for a segment with none)."""
    if len(start) < 2:
        return 0.0
    finite = np.where(np.isfinite(flat), flat, -np.inf)
    most = np.maximum.reduceat(finite, start[:-1])
    return float(np.where(np.isfinite(most), np.maximum(most, 0.0), 0.0).sum())


def _renumbered(classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``classes`` renumbered 0.. (in the order of their ids), and the first member of each."""
    _, first, inverse = np.unique(classes, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first
