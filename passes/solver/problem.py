"""The solver's one problem type: strategies per node, pair costs per edge, memory over time.

A ``StrategyProblem`` has nodes, each with strategies (a cost, a memory usage, and the interval
of time steps ``[start, end)`` during which the node is live), edges with a cost per pair of
strategies of their two nodes, and a memory limit per device: at every time step the usages of
the live nodes' chosen strategies sum to at most ``usage_limit``. A solution picks one strategy
per node; its cost is the sum of the chosen node costs, the edge costs and a ``constant``
(``inf`` costs are forbidden choices). This is the problem of XLA's auto-sharding and of the
IOPDDL contest (``passes.solver.read_iopddl`` reads its files), and the one both fronts solve:
``passes.solver.solve`` builds one from a ``placement_graph`` (an edge's table compressed to
classes of equal rows and columns, ``edge_classes``; each strategy's per-mesh-axis codes,
``axes``, for the mesh-axis neighbourhoods of ``passes.solver.search``; a value whose storage
a node's strategy sets, beyond the node's own, as a node of its own tied to it by an edge).

The solver: ``passes.solver.reduce`` (exact reductions), ``passes.solver.milp`` (the integer
program of a neighbourhood), ``passes.solver.wcsp`` (toulbar2 on the reduced problem),
``passes.solver.feasible`` (a plan with no forbidden choice within the memory limit),
``passes.solver.search`` (``solve_problem``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = [
    "StrategyProblem",
    "ProblemSolution",
    "problem_cost",
    "peak_usage",
    "FORBIDDEN_COST",
    "InfeasiblePlacementError",
    "NoPlanFoundError",
]


class InfeasiblePlacementError(ValueError):
    """No choice of strategies meets the forbidden pairs and the memory limit (proven)."""


class NoPlanFoundError(TimeoutError):
    """The time limit ran out before any plan was found; the problem is not proven infeasible."""


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

    Optional: ``edge_classes[k]`` = ``(rows, cols)`` (integer arrays, a class per strategy of i
    and of j) makes ``edge_costs[k]`` a table over classes, the cost ``table[rows[a], cols[b]]``
    (``edge_matrix(k)`` expands it); ``None`` entries (or no ``edge_classes``) are plain
    matrices. ``axes[i]``: per strategy of node i, a code per mesh axis (strategies with equal
    codes on an axis place alike there), for the mesh-axis neighbourhoods. ``constant``: a cost
    every solution pays.
    """

    node_costs: tuple[np.ndarray, ...]
    node_usages: tuple[np.ndarray, ...]
    intervals: np.ndarray
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    usage_limit: float | None = None
    name: str = ""
    edge_classes: tuple | None = None
    axes: tuple | None = None
    constant: float = 0.0

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
        classes = self.edge_classes
        if classes is not None and len(classes) != len(edges):
            raise ValueError(f"edge_classes has {len(classes)} entries, expected one per edge ({len(edges)})")
        matrices, kept_classes = [], []
        for k, ((i, j), m) in enumerate(zip(edges.tolist(), self.edge_costs)):
            m = np.asarray(m, dtype=np.float64)
            shape = (len(costs[i]), len(costs[j]))
            pair = None if classes is None else classes[k]
            if pair is not None:
                rows, cols = (np.asarray(x, dtype=np.int64).reshape(-1) for x in pair)
                if len(rows) != shape[0] or len(cols) != shape[1]:
                    raise ValueError(f"edge_classes[{k}] must give a class per strategy of nodes {i} and {j} {shape}")
                if m.ndim != 2 or rows.min() < 0 or cols.min() < 0 or rows.max() >= m.shape[0] or cols.max() >= m.shape[1]:
                    raise ValueError(f"edge_classes[{k}] names classes outside edge_costs[{k}]'s table")
                pair = (rows, cols)
            elif m.size != shape[0] * shape[1]:
                raise ValueError(f"edge_costs[{k}] has {m.size} entries, expected {shape[0]}x{shape[1]} for edge {(i, j)}")
            else:
                m = m.reshape(shape)
            if np.isnan(m).any():
                raise ValueError(f"edge_costs[{k}] has NaN entries")
            matrices.append(_forbidden_as_inf(m))
            kept_classes.append(pair)
        if self.axes is not None:
            if len(self.axes) != n:
                raise ValueError(f"axes has {len(self.axes)} entries, expected one per node ({n})")
            axes = []
            for i, codes in enumerate(self.axes):
                if codes is not None:
                    codes = np.asarray(codes, dtype=np.int64)
                    if codes.ndim != 2 or len(codes) != len(costs[i]):
                        raise ValueError(f"axes[{i}] must be a strategies x mesh axes array of codes for node {i}")
                axes.append(codes)
            object.__setattr__(self, "axes", tuple(axes))
        if self.usage_limit is not None and not (float(self.usage_limit) >= 0):
            raise ValueError(f"usage_limit must be a number >= 0 or None, got {self.usage_limit!r}")
        if not math.isfinite(float(self.constant)):
            raise ValueError(f"constant must be a finite number, got {self.constant!r}")
        object.__setattr__(self, "node_costs", costs)
        object.__setattr__(self, "node_usages", usages)
        object.__setattr__(self, "intervals", intervals)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "edge_costs", tuple(matrices))
        object.__setattr__(self, "edge_classes", None if all(c is None for c in kept_classes) else tuple(kept_classes))
        object.__setattr__(self, "constant", float(self.constant))

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def edge_matrix(self, k: int) -> np.ndarray:
        """Edge k's cost per strategy pair (its class table expanded)."""
        m = self.edge_costs[k]
        pair = None if self.edge_classes is None else self.edge_classes[k]
        return m if pair is None else m[np.ix_(pair[0], pair[1])]

    def edge_cost(self, k: int, a: int, b: int) -> float:
        """Edge k's cost when its first node takes strategy a and its second b."""
        pair = None if self.edge_classes is None else self.edge_classes[k]
        m = self.edge_costs[k]
        return float(m[a, b] if pair is None else m[pair[0][a], pair[1][b]])

    def with_usage_limit(self, usage_limit: float | None) -> StrategyProblem:
        """The same problem under another memory limit."""
        return dataclasses.replace(self, usage_limit=usage_limit)
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
    nodes = math.fsum(float(c[a]) for c, a in zip(problem.node_costs, s.tolist()))
    if len(problem.edges) < _GATHER_FROM_EDGES:
        edges = [problem.edge_cost(k, s[i], s[j]) for k, (i, j) in enumerate(problem.edges.tolist())]
    else:
        edges = _FlatEdges(problem).costs(s).tolist()
    return nodes + math.fsum(edges) + problem.constant


# From this many edges a plan's edge costs are one gather (``_FlatEdges``; below it, laying the
# tables out costs more than the loop: 87 against 13 us on 6 edges).
_GATHER_FROM_EDGES = 64


class _FlatEdges:
    """Every edge's table laid end to end (with its class maps), so a plan's edge costs are
    one gather: plans are priced after the solver's deadline, and a loop of numpy calls per
    edge (its least cost, a plan's cost) took 0.1-0.2 s on an 8000-node problem, 3-4 times that
    on a loaded machine."""

    def __init__(self, problem: StrategyProblem) -> None:
        tables = problem.edge_costs
        self.count = len(tables)
        shapes = np.array([m.shape for m in tables], dtype=np.int64).reshape(-1, 2)
        self.columns = shapes[:, 1]
        self.offsets = np.cumsum(shapes[:, 0] * shapes[:, 1]) - shapes[:, 0] * shapes[:, 1]
        self.values = np.concatenate([np.zeros(0), *(m.ravel() for m in tables)])
        self.maps = None
        if problem.edge_classes is not None and self.count:
            # Per edge end, its node's strategy -> the table's row (column): the class map, or
            # the strategy itself.
            ends = problem.edges
            sizes = np.array([len(c) for c in problem.node_costs], dtype=np.int64)
            self.maps = []
            for side in (0, 1):
                lengths = sizes[ends[:, side]]
                parts = [
                    np.arange(n, dtype=np.int64) if pair is None else np.asarray(pair[side], dtype=np.int64)
                    for pair, n in zip(problem.edge_classes, lengths.tolist())
                ]
                self.maps.append((np.cumsum(lengths) - lengths, np.concatenate(parts)))
        self.edges = problem.edges

    def costs(self, plan: np.ndarray) -> np.ndarray:
        """Each edge's cost under ``plan`` (a strategy per node)."""
        if not self.count:
            return np.zeros(0)
        rows, columns = plan[self.edges[:, 0]], plan[self.edges[:, 1]]
        if self.maps is not None:
            rows = self.maps[0][1][self.maps[0][0] + rows]
            columns = self.maps[1][1][self.maps[1][0] + columns]
        return self.values[self.offsets + rows * self.columns + columns]

    def least(self) -> np.ndarray:
        """Each edge's least cost."""
        return np.minimum.reduceat(self.values, self.offsets) if self.count else np.zeros(0)


def peak_usage(problem: StrategyProblem, strategies: Sequence[int]) -> float:
    """The most memory live at one time step under ``strategies``."""
    s = _check_strategies(problem, strategies)
    return _TimeSteps(problem).peak_of(np.array([u[a] for u, a in zip(problem.node_usages, s.tolist())]))


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
        return self.loads_of(np.array([u[a] for u, a in zip(self.problem.node_usages, np.asarray(strategies).tolist())]))

    def peak_of(self, used: np.ndarray) -> float:
        """The most memory live at one step when node i uses ``used[i]``."""
        return float(self.loads_of(used).max()) if self.any_live else 0.0

    def loads_of(self, used: np.ndarray) -> np.ndarray:
        """The memory live at each step when node i uses ``used[i]``."""
        delta = np.zeros(len(self.points) + 1)
        np.add.at(delta, self.lo, used)
        np.add.at(delta, self.hi, -used)
        return np.cumsum(delta)[:-1]

