"""The integer program of a neighbourhood of a search's plan, solved by HiGHS.

``solve_neighbourhood(search, free, ...)`` optimizes the nodes ``free`` (each over all its
strategies, or those ``masks`` allow) with every other node fixed at the search's plan: one
binary per strategy, one per node; per edge between two free nodes a continuous variable per
finite entry of its table compressed to classes (strategies whose rows, or columns, are equal
share a class), whose row and column sums equal the binaries of each class (exact for binary
strategies; the LP relaxation is that of the uncompressed table); an edge to a fixed node is a
cost of the free node's strategies; memory: between two ends or starts of free nodes the free
nodes live are the same, so one row per such stretch of time (at its least memory left) stands
for all of its time steps. Costs and memory rows are scaled for HiGHS (bytes per device and
seconds are far from its tolerances). With ``penalty`` the memory limit is soft (a slack per
row, priced per unit); with ``soft_forbidden`` a forbidden pair with a fixed node costs the
search's ``big`` instead of being excluded, so a neighbourhood of a plan that breaks either
is feasible and repairs what it can. HiGHS runs through ``deadline.solve_model_by``: with a
deadline in a worker process killed there, HiGHS's own time limit not being kept.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

from passes.solver.deadline import solve_model_by

if TYPE_CHECKING:  # pragma: no cover
    from passes.solver.search import Search

__all__ = ["solve_neighbourhood", "MIP_GAP"]

# Relative gap at which HiGHS may stop (its default, 1e-4, leaves visible cost on the table).
MIP_GAP = 1e-7
# The largest cost in the program after scaling: HiGHS's absolute gap (1e-6) is then below the
# relative one, and its tolerances see the differences between plans.
_COST_TOP = 1e7


def solve_neighbourhood(
    search: Search,
    free: np.ndarray,
    time_limit: float,
    warm: bool,
    penalty: float | None = None,
    soft_forbidden: bool = False,
    deadline: float = math.inf,
    want_bound: bool = True,
    masks: dict[int, np.ndarray] | None = None,
    gap: float = MIP_GAP,
) -> tuple[str, np.ndarray | None, float, dict]:
    """Optimize ``free`` with the others fixed: (status, strategies of ``free`` or None, bound,
    sizes). Without ``want_bound`` the bound leaves out the fixed nodes' and edges' cost.
    ``masks``: per free node (local index), the strategies it may take (the plan's must be one
    of them when ``warm``); ``gap``: the relative gap HiGHS stops at."""
    is_free = np.zeros(len(search.nodes), dtype=bool)
    is_free[free] = True
    constant = search.reduced.constant + (_fixed_cost(search, is_free) if want_bound else 0.0)
    # The run's own deadline: the caller's, or its time limit from now (whichever is first).
    if math.isfinite(time_limit):
        deadline = min(deadline, time.perf_counter() + float(time_limit))
    out_of_time = ("time limit", None, -math.inf, {})
    program = _Program()
    built = program.add_strategies(search, free, is_free, masks, soft_forbidden, deadline)
    if built != "built":
        return out_of_time if built == "time limit" else ("infeasible", None, math.inf, {})
    if not program.add_pairs(search, is_free, deadline) or time.perf_counter() >= deadline:
        return out_of_time
    program.add_memory_rows(search, free, penalty)
    if time.perf_counter() >= deadline:
        return out_of_time
    cost = np.concatenate(program.col_cost)
    top = float(np.abs(cost).max()) if len(cost) else 0.0
    scale = top / _COST_TOP if top > _COST_TOP or 0.0 < top < 1.0 else 1.0
    start, index, value = _column_wise(
        np.concatenate(program.vals), np.concatenate(program.rows), np.concatenate(program.cols), len(program.row_lower), program.ncols
    )
    if time.perf_counter() >= deadline:
        return out_of_time
    model = dict(
        col_cost=cost / scale,
        col_upper=np.concatenate(program.col_upper),
        row_lower=np.array(program.row_lower),
        row_upper=np.array(program.row_upper),
        start=start,
        index=index,
        value=value,
        integer=np.concatenate(program.integer),
        options=dict(threads=1, mip_rel_gap=gap, presolve="choose" if search.presolve else "off"),
        x0=program.warm_start(search, free) if warm else None,
    )
    sizes = dict(variables=int(program.ncols), constraints=len(program.row_lower), milp_nodes=len(free))
    # Building the model took time too: HiGHS gets what is left before the deadline, and
    # ends there (``solve_model_by``: its own time limit is not kept).
    result = solve_model_by(model, deadline, stop=search.stop)
    if result is None:
        return out_of_time
    if result["status"] == "infeasible":
        return "infeasible", None, math.inf, sizes
    bound = constant + result["dual_bound"] * scale
    if result["x"] is None:
        return result["status"], None, bound, sizes
    return result["status"], program.chosen(free, result["x"]), bound, sizes


def _fixed_cost(search: Search, is_free: np.ndarray) -> float:
    """What the plan's fixed nodes and the edges between them cost (a forbidden choice: ``big``)."""
    s = search.s
    constant = 0.0
    for v in np.flatnonzero(~is_free).tolist():
        c = search.cost[v][s[v]]
        constant += float(c) if np.isfinite(c) else search.big
    for k in np.flatnonzero(~is_free[search.edge_i] & ~is_free[search.edge_j]).tolist():
        li, lj, m = search.edges[k]
        value = m[s[li], s[lj]]
        constant += float(value) if np.isfinite(value) else search.big
    return constant


class _Program:
    """The integer program of a neighbourhood as it is built: its columns (cost, upper bound,
    integrality), its entries (row, column, value) and its rows' bounds."""

    def __init__(self) -> None:
        self.col_cost: list[np.ndarray] = []
        self.col_upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.ncols = 0
        self.x_start: dict[int, int] = {}  # free node -> its first binary
        self.allowed: dict[int, np.ndarray] = {}  # free node -> the strategies it may take
        self.pair_start: list[tuple] = []  # per edge between free nodes, where its pairs are
        self.free_memory: list[int] = []
        self.slack_of: tuple | None = None

    def add_strategies(
        self, search: Search, free: np.ndarray, is_free: np.ndarray, masks: dict | None, soft_forbidden: bool, deadline: float
    ) -> str:
        """A binary per allowed strategy of each free node (its cost plus its edges to fixed
        nodes), one row per node: they sum to 1. ``"built"``, ``"infeasible"`` (a node with no
        strategy allowed) or ``"time limit"``."""
        s = search.s
        for count, v in enumerate(free.tolist()):
            if count % 64 == 0 and time.perf_counter() >= deadline:
                return "time limit"
            mask = None if masks is None else masks.get(v)
            options = np.arange(len(search.cost[v])) if mask is None else np.flatnonzero(mask)
            if not len(options):
                return "infeasible"
            self.allowed[v] = options
            cost = search.cost[v][options].copy()
            for w, _, m in search.adjacent[v]:
                if not is_free[w]:
                    cost += m[options, s[w]]
            if soft_forbidden:
                own = np.isfinite(search.cost[v][options])
                cost = np.where(own & ~np.isfinite(cost), search.big, cost)
            finite = np.isfinite(cost)
            self.x_start[v] = self.ncols
            self.col_cost.append(np.where(finite, cost, 0.0))
            self.col_upper.append(finite.astype(np.float64))
            self.integer.append(np.ones(len(cost), dtype=bool))
            self.rows.append(np.full(len(cost), len(self.row_lower)))
            self.cols.append(np.arange(self.ncols, self.ncols + len(cost)))
            self.vals.append(np.ones(len(cost)))
            self.row_lower.append(1.0)
            self.row_upper.append(1.0)
            self.ncols += len(cost)
        return "built"

    def add_pairs(self, search: Search, is_free: np.ndarray, deadline: float) -> bool:
        """Per edge between free nodes, a continuous column per finite entry of its class table,
        tied to the binaries by row and column sums; False if the deadline came first."""
        allowed, x_start = self.allowed, self.x_start
        for count, k in enumerate(np.flatnonzero(is_free[search.edge_i] & is_free[search.edge_j]).tolist()):
            if count % 64 == 0 and time.perf_counter() >= deadline:
                return False
            li, lj, _ = search.edges[k]
            row_class, col_class, table = search.edge_classes(k)
            # The classes of the strategies the two nodes may take, renumbered over those used.
            used_rows, a_class = np.unique(row_class[allowed[li]], return_inverse=True)
            used_cols, b_class = np.unique(col_class[allowed[lj]], return_inverse=True)
            sub = table[np.ix_(used_rows, used_cols)]
            r_idx, c_idx = np.nonzero(np.isfinite(sub))
            n_pairs = len(r_idx)
            pair_cols = np.arange(self.ncols, self.ncols + n_pairs)
            self.pair_start.append((li, lj, a_class.reshape(-1), b_class.reshape(-1), r_idx, c_idx, self.ncols, sub.shape))
            self.col_cost.append(sub[r_idx, c_idx])
            self.col_upper.append(np.ones(n_pairs))
            self.integer.append(np.zeros(n_pairs, dtype=bool))
            self.ncols += n_pairs
            na, nb = sub.shape
            base = len(self.row_lower)
            a_options = x_start[li] + np.arange(len(allowed[li]))
            b_options = x_start[lj] + np.arange(len(allowed[lj]))
            # Row class r of the edge: its pairs sum to the binaries of li's strategies in r; columns alike.
            self.rows += [base + r_idx, base + a_class.reshape(-1), base + na + c_idx, base + na + b_class.reshape(-1)]
            self.cols += [pair_cols, a_options, pair_cols, b_options]
            self.vals += [np.ones(n_pairs), -np.ones(len(a_options)), np.ones(n_pairs), -np.ones(len(b_options))]
            self.row_lower += [0.0] * (na + nb)
            self.row_upper += [0.0] * (na + nb)
        return True

    def add_memory_rows(self, search: Search, free: np.ndarray, penalty: float | None) -> None:
        """One row per stretch of time between the free nodes' ends and starts that can bind (at
        its least memory left), in units of the largest usage in them; with ``penalty`` a
        slack column per row, priced per unit above the limit."""
        s, allowed, x_start = search.s, self.allowed, self.x_start
        free_memory = self.free_memory = [v for v in free.tolist() if search.memory[v]]
        if not free_memory or not len(search.rhs):
            return
        available = search.rhs - search.load
        most = np.zeros(len(search.rhs) + 1)
        for v in free_memory:
            u = search.usage[v]
            available[search.lo[v] : search.hi[v]] += u[s[v]]
            top = u[allowed[v]].max()
            most[search.lo[v]] += top
            most[search.hi[v]] -= top
        ends = np.concatenate([[0], search.lo[free_memory], search.hi[free_memory]])
        bounds = np.unique(ends[ends < len(search.rhs)])
        room = np.minimum.reduceat(available, bounds)
        segment_most = np.cumsum(most)[bounds]
        binding = np.flatnonzero(segment_most > room + 1e-9)
        # Memory rows in units of the largest usage in them (bytes are far from HiGHS's tolerances).
        unit = max(1.0, max(float(search.usage[v].max()) for v in free_memory))
        self.unit = unit
        if len(binding) and penalty is not None:
            # A slack column per row, priced ``penalty`` per unit above the limit.
            slack_cols = np.arange(self.ncols, self.ncols + len(binding))
            self.col_cost.append(np.full(len(binding), float(penalty) * unit))
            self.col_upper.append(np.full(len(binding), np.inf))
            self.integer.append(np.zeros(len(binding), dtype=bool))
            self.ncols += len(binding)
            self.rows.append(len(self.row_lower) + np.arange(len(binding)))
            self.cols.append(slack_cols)
            self.vals.append(-np.ones(len(binding)))
            self.slack_of = (binding, slack_cols, room[binding], bounds)
        if not len(binding):
            return
        row_of = np.full(len(bounds), -1)
        row_of[binding] = len(self.row_lower) + np.arange(len(binding))
        for v in free_memory:
            ks = np.arange(np.searchsorted(bounds, search.lo[v]), np.searchsorted(bounds, search.hi[v]))
            ks = ks[row_of[ks] >= 0]
            u = search.usage[v][allowed[v]]
            nz = np.flatnonzero(u)
            if not len(ks) or not len(nz):
                continue
            self.rows.append(np.repeat(row_of[ks], len(nz)))
            self.cols.append(np.tile(x_start[v] + nz, len(ks)))
            self.vals.append(np.tile(u[nz] / unit, len(ks)))
        self.row_lower += [-math.inf] * len(binding)
        self.row_upper += (room[binding] / unit).tolist()

    def warm_start(self, search: Search, free: np.ndarray) -> np.ndarray | None:
        """The search's plan as a solution of the program (``None`` if a free node's strategy
        is not allowed)."""
        s, allowed, x_start = search.s, self.allowed, self.x_start
        x0 = np.zeros(self.ncols)
        for v in free.tolist():
            hit = np.flatnonzero(allowed[v] == s[v])
            if not len(hit):
                return None
            x0[x_start[v] + hit[0]] = 1.0
        for li, lj, a_class, b_class, r_idx, c_idx, first, _ in self.pair_start:
            ra = a_class[np.flatnonzero(allowed[li] == s[li])[0]]
            cb = b_class[np.flatnonzero(allowed[lj] == s[lj])[0]]
            x0[first + np.flatnonzero((r_idx == ra) & (c_idx == cb))] = 1.0
        if self.slack_of is not None:
            binding, slack_cols, room, bounds = self.slack_of
            used = np.zeros(len(search.rhs))
            for v in self.free_memory:
                used[search.lo[v] : search.hi[v]] += search.usage[v][s[v]]
            x0[slack_cols] = np.maximum(used[bounds[binding]] - room, 0.0) / self.unit
        return x0

    def chosen(self, free: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Each free node's strategy in the solution ``x``."""
        allowed, x_start = self.allowed, self.x_start
        return np.array([int(allowed[v][np.argmax(x[x_start[v] : x_start[v] + len(allowed[v])])]) for v in free.tolist()])


def _column_wise(values: np.ndarray, rows: np.ndarray, cols: np.ndarray, nrows: int, ncols: int) -> tuple:
    """The matrix of these entries (repeated ones summed) column-wise: (column starts, row
    indices, values), the rows of each column in order. (numpy's own: importing scipy's
    sparse matrices in a solve took 0.2-0.5 s of its time limit.)"""
    key = cols.astype(np.int64) * max(nrows, 1) + rows.astype(np.int64)
    unique, inverse = np.unique(key, return_inverse=True)
    summed = np.bincount(inverse.reshape(-1), weights=values, minlength=len(unique)).astype(np.float64)
    column = unique // max(nrows, 1)
    start = np.concatenate([[0], np.cumsum(np.bincount(column, minlength=ncols))]).astype(np.int32)
    return start, (unique % max(nrows, 1)).astype(np.int32), summed
