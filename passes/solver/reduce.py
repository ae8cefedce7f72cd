"""Exact reductions of a ``StrategyProblem``: each keeps every optimum's cost, and remembers how
to expand a solution of what is left into one of the problem.

In order: strategies of infinite cost dropped; the memory constraints that can bind found (only
the last start before some node ends; a constraint no choice can break dropped), each node's
usage taken relative to its least (``memory_rows``); then, until nothing changes: parallel
edges merged; an edge's separable part (``u[a] + v[b]``) folded into its nodes' costs, an edge
left all-zero dropped; strategies forbidden whatever a neighbour does dropped; dominated
strategies (no cheaper, no larger where memory is seen, no worse on any edge than another)
dropped (with ``dominance="equal"`` only those equal to another on every count but cost and no
cheaper, and no separable part folded: the reduced problem's size then depends on the
problem's structure, not on its costs or their rounding, so a scan's trip count does not
change it); a memory-free node with at most two neighbours eliminated (a leaf's minimum, a chain
link's min-plus product), unless the product table is large and has more distinct entries
than the two it replaces (a link of few strategies between two of many, as a view between two
values on a 3-D mesh: the integer program would grow). A node whose usage a binding memory
constraint sees is never eliminated. ``InfeasiblePlacementError`` only with a proof (a node
left with no strategy of finite cost, or a time step where the least usages break the limit).
"""

from __future__ import annotations

import math
import time

import numpy as np

from passes.solver.deadline import check
from passes.solver.problem import InfeasiblePlacementError, StrategyProblem

__all__ = ["Reduced"]

# Entries of a dominance test (strategies^2 x compared values) above which only duplicates go.
_DOMINANCE_BUDGET = 2_000_000
# Entries of a chain link's min-plus product above which the link is kept.
_ELIMINATION_BUDGET = 4_000_000
# Entries of a chain link's product above which it is kept when it has more distinct rows times
# columns than the two edges it replaces (their integer program is smaller than the product's).
_LINK_GROWTH_ENTRIES = 16_384
# Nodes or edges between two looks at a deadline in the steps that copy the problem (a few ms).
_CHECK_EVERY = 256


class Reduced:
    """The problem after exact reductions; remembers how to expand a solution of what is left."""

    def __init__(self, problem: StrategyProblem, dominance: str = "full", deadline: float = math.inf) -> None:
        """``deadline``: ``OutOfTime`` is raised past it (copying a 20k-node problem's tables
        takes most of a second)."""
        if dominance not in ("full", "equal"):
            raise ValueError(f"dominance must be 'full' or 'equal', got {dominance!r}")
        n = problem.num_nodes
        self.problem = problem
        self.dominance = dominance
        self.cost, self.usage, self.keep = [], [], []
        for i, (c, u) in enumerate(zip(problem.node_costs, problem.node_usages)):
            if i % _CHECK_EVERY == 0:
                check(deadline)
            self.cost.append(c.copy())
            self.usage.append(u.copy())
            self.keep.append(np.arange(len(c)))
        self.constant = problem.constant
        self.edges: dict[int, list] = {}  # id -> [i, j, matrix (strategies of i x of j)]
        self.adjacent: list[dict[int, int]] = [dict() for _ in range(n)]  # node -> {neighbour: edge id}
        self.removed = np.zeros(n, dtype=bool)
        self.eliminated: list[tuple] = []
        self.memory_node = np.zeros(n, dtype=bool)
        self._next = 0
        self._dirty: set[int] = set()  # edges whose separable part may not be folded yet
        # Per edge, a class per strategy of each side (oriented as the edge): strategies of one
        # class have equal rows (columns) in the table. From the problem's class tables, else
        # the table's equal rows and columns (found when first needed: ``None`` until then);
        # merges and eliminations combine them, so they follow the problem's structure (the
        # integer program's pair variables are per class).
        self.classes: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        given = problem.edge_classes
        check(deadline)
        for k, (i, j) in enumerate(problem.edges.tolist()):
            if k % _CHECK_EVERY == 0:
                check(deadline)
            m = np.array(problem.edge_matrix(k), dtype=np.float64)
            self._add_edge(i, j, m, None if given is None else given[k])

    def axes(self, node: int) -> np.ndarray | None:
        """The per-mesh-axis codes of ``node``'s kept strategies (``None``: none given)."""
        codes = None if self.problem.axes is None else self.problem.axes[node]
        return None if codes is None else codes[self.keep[node]]

    # ------------------------------------------------------------------ edges

    def _add_edge(self, i: int, j: int, m: np.ndarray, classes: tuple[np.ndarray, np.ndarray] | None) -> None:
        if i == j:
            self.cost[i] = self.cost[i] + np.diag(m)
            return
        if j in self.adjacent[i]:
            eid = self.adjacent[i][j]
            a, _, existing = self.edges[eid]
            self.edges[eid][2] = existing + (m if a == i else m.T)
            if classes is None or self.classes[eid] is None:
                self.classes[eid] = None
            else:
                rows, cols = classes if a == i else classes[::-1]
                old_rows, old_cols = self.classes[eid]
                self.classes[eid] = (_paired(old_rows, rows), _paired(old_cols, cols))
            self._dirty.add(eid)
            return
        eid = self._next
        self._next += 1
        self.edges[eid] = [i, j, m]
        self.classes[eid] = classes
        self.adjacent[i][j] = eid
        self.adjacent[j][i] = eid
        self._dirty.add(eid)

    def _drop_edge(self, eid: int) -> None:
        i, j, _ = self.edges.pop(eid)
        del self.classes[eid]
        del self.adjacent[i][j]
        del self.adjacent[j][i]

    def oriented_classes(self, node: int, neighbour: int) -> tuple[np.ndarray, np.ndarray]:
        """The classes of the edge node-neighbour: (of ``node``'s strategies, of the neighbour's)."""
        eid = self.adjacent[node][neighbour]
        rows, cols = self.edge_classes(eid)
        return (rows, cols) if self.edges[eid][0] == node else (cols, rows)

    def edge_classes(self, eid: int) -> tuple[np.ndarray, np.ndarray]:
        """The classes of edge ``eid`` (of its first node's strategies, of its second's)."""
        found = self.classes[eid]
        if found is None:
            m = self.edges[eid][2]
            found = self.classes[eid] = (_equal(m, 0), _equal(m, 1))
        return found

    def oriented(self, node: int, neighbour: int) -> np.ndarray:
        """The matrix of the edge node-neighbour, rows indexed by ``node``'s strategies."""
        i, _, m = self.edges[self.adjacent[node][neighbour]]
        return m if i == node else m.T

    def _normalize(self, eid: int) -> bool:
        """Fold the separable part of an edge into its nodes; drop it if nothing is left. Returns
        False if some strategy is forbidden whatever the other side does (the caller prunes)."""
        i, j, m = self.edges[eid]
        if self.dominance == "equal":
            # Tables kept as they are, all-zero ones too: the reduced problem is the problem's
            # structure (folding would make it depend on rounding; a scan of one step prices its
            # carry between steps at zero).
            return bool(np.isfinite(m).any(axis=1).all() and np.isfinite(m).any(axis=0).all())
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
            if self.classes[eid] is not None:
                rows, cols = self.classes[eid]
                self.classes[eid] = (rows[mask], cols) if i == node else (rows, cols[mask])
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
        if self.dominance == "equal" or k * k * table.shape[1] > _DOMINANCE_BUDGET:
            # Only strategies equal on every count but cost: keep the cheapest of each (the first
            # on ties). Equal by their classes on every edge (the problem's structure), by value
            # for memory.
            keys = [self.oriented_classes(node, nb)[0][:, None] for nb in self.adjacent[node]]
            if self.memory_node[node]:
                keys.append(self.usage[node][:, None])
            if not keys:
                keys = [np.zeros((k, 1))]
            _, group = np.unique(np.concatenate(keys, axis=1).astype(np.float64), axis=0, return_inverse=True)
            group = group.reshape(-1)
            order = np.lexsort((np.arange(k), table[:, 0], group))
            first = order[np.r_[True, group[order][1:] != group[order][:-1]]]
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

    def memory_rows(self, limit: float | None, deadline: float = math.inf) -> None:
        """Find the memory constraints that can bind; mark the nodes they see (``OutOfTime``
        past ``deadline``: the rows are then incomplete)."""
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
        # Each live node's least and largest usage, over its strategies laid end to end.
        usages = [self.usage[i] for i in index.tolist()]
        first = np.concatenate([[0], np.cumsum([len(u) for u in usages])[:-1]]).astype(np.int64)
        flat = np.concatenate(usages)
        least = np.minimum.reduceat(flat, first)
        most = np.maximum.reduceat(flat, first)
        check(deadline)

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
        for count, (i, smallest) in enumerate(zip(index[seen].tolist(), least[seen].tolist())):
            if count % _CHECK_EVERY == 0:
                check(deadline)
            self.usage[i] = self.usage[i] - smallest

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
        product = m1.shape[1] * m2.shape[1]
        if m1.size * m2.shape[1] > _ELIMINATION_BUDGET or (product > _LINK_GROWTH_ENTRIES and self._link_grows(node, j, k)):
            return []
        total = cost[:, None, None] + m1[:, :, None] + m2[:, None, :]
        best = np.argmin(total, axis=0)
        combined = np.take_along_axis(total, best[None], axis=0)[0]
        side_j = self.oriented_classes(node, j)[1]
        side_k = self.oriented_classes(node, k)[1]
        self._drop_edge(self.adjacent[node][j])
        self._drop_edge(self.adjacent[node][k])
        self.removed[node] = True
        self.eliminated.append((node, "link", (j, self.keep[j], k, self.keep[k], self.keep[node][best])))
        self._add_edge(j, k, combined, (side_j, side_k))
        eid = self.adjacent[j][k]
        if not self._normalize(eid):
            for side in (j, k):
                self._restrict(side, self._allowed(side))
            if eid in self.edges:
                self._normalize(eid)
        return [j, k]

    def _link_grows(self, node: int, j: int, k: int) -> bool:
        """Whether eliminating the link ``node`` between ``j`` and ``k`` would leave an edge with
        more (row, column) classes than the two edges it replaces have."""
        own = len(self.cost[node])
        c1 = len(np.unique(self.oriented_classes(node, j)[1]))
        c2 = len(np.unique(self.oriented_classes(node, k)[1]))
        return c1 * c2 > own * (c1 + c2)

    def reduce(self, limit: float | None, deadline: float, eliminate: bool = True, stop_by: float = math.inf) -> None:
        """The reductions (see the module docstring) until nothing changes or ``deadline``;
        ``eliminate=False`` keeps every node (strategies are still dropped). The first steps
        (infinite costs dropped, the memory rows) must finish for the result to be a reduced
        problem: past ``stop_by`` they raise ``OutOfTime``."""
        n = self.problem.num_nodes
        for i in range(n):
            if i % _CHECK_EVERY == 0:
                check(stop_by)
            self._restrict(i, np.isfinite(self.cost[i]))
        self.memory_rows(limit, stop_by)
        queue = list(range(n))
        rounds = 0
        while queue and time.perf_counter() < deadline:
            rounds += 1
            touched: set[int] = set()
            while self._dirty:
                if len(self._dirty) % 64 == 0 and time.perf_counter() >= deadline:
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
                if count % 64 == 0 and time.perf_counter() >= deadline:
                    break
                if self.removed[node]:
                    continue
                before = len(self.cost[node])
                self._dominance(node)
                if len(self.cost[node]) < before:
                    touched.update(self.adjacent[node])
                    touched.add(node)
                if eliminate and not self.memory_node[node] and len(self.adjacent[node]) <= 2:
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



def _equal(m: np.ndarray, axis: int) -> np.ndarray:
    """A class per row (``axis=0``) or column of ``m``: equal ones share it."""
    if not m.size:
        return np.zeros(m.shape[axis], np.int64)
    lines = np.ascontiguousarray(m if axis == 0 else m.T) + 0.0  # (+ 0.0: -0.0 and 0.0 alike)
    keys = lines.view(np.dtype((np.void, lines.dtype.itemsize * lines.shape[1]))).reshape(-1)
    return np.unique(keys, return_inverse=True)[1].reshape(-1)


def _paired(one: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Classes of the pairs ``(one[i], other[i])``."""
    return np.unique(np.stack([one, other], axis=1), axis=0, return_inverse=True)[1].reshape(-1)
