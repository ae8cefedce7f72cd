"""A plan that makes no forbidden choice and fits the memory limit: the feasibility phase.

On problems where a large share of each edge's pairs is forbidden (``families.contest_like``
at ``forbidden=0.35``, the share the contest's files have; 0.5), the greedy constructions of
``passes.solver.search`` end with a few forbidden pairs (1-80 of 3-9k edges, measured), and
neither the integer programs (a neighbourhood of 20k pair variables with memory rows: two
rounds in the time of a 5 s limit, none repairing) nor toulbar2 (no plan at all in 10 s on
a 3000-node problem, even without the memory rows: it optimizes costs, it does not look for
a plan) repaired them in time: ``solve_problem`` raised ``NoPlanFoundError``.

``repair_forbidden`` repairs a plan that fits the memory limit into one that also makes no
forbidden choice, by a min-conflicts search with tabu moves (each move keeps the memory
limit: a node only takes memory left over its lifetime): a forbidden edge is picked at random,
and one of its two nodes moves to the strategy that leaves the fewest forbidden pairs around
it (then the cheapest), a move back to a strategy left recently being taboo unless it leaves
fewer forbidden pairs than ever; now and then a random walk (a random allowed strategy of a
random endpoint). Where that stalls: first a move that would leave fewer forbidden pairs but
needs memory is made to fit, other nodes live where memory is short moving to smaller
strategies that add no forbidden pair (on an 8000-node problem at the contest's tightness the
last forbidden pair sat between two nodes with no memory left for any other strategy); else
a small exact search: the nodes around a forbidden edge are freed (their neighbours outside
fixed; on a small problem, every node) and a depth-first search with forward checking (each
free node's strategies narrowed by the fixed neighbours and the memory left, the node with
the fewest left first, the cheapest first) looks for strategies that make no forbidden choice
among them; the neighbourhood grows when it has none. It never proves anything (a problem
where it fails is not called infeasible: ``NoPlanFoundError``).
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["repair_forbidden", "forbidden_edges"]

# Moves between two looks at the deadline.
_CHECK_EVERY = 32
# A node's move back to a strategy it left is taboo for this many moves (plus a random share).
_TABU_TENURE = 10
# The share of moves that are a random walk.
_WALK = 0.05
# Moves without a new least count of forbidden edges before the exact neighbourhood search.
_STALL = 200
# The exact neighbourhood search: nodes freed at first (they grow by this factor, up to the most),
# and the search's steps per neighbourhood.
_FIRST_FREE = 12
_GROWTH = 2
_MOST_FREE = 200
_DFS_STEPS = 20_000
# Moves of other nodes that may make room for one move (``_Repair.with_room``).
_ROOM_MOVES = 64


def forbidden_edges(search) -> np.ndarray:
    """The indices of the search's edges whose pair the plan forbids."""
    if not len(search.edges):
        return np.zeros(0, dtype=np.int64)
    values = search.flat_edges[search.edge_start[:-1] + search.s[search.edge_i] * search.edge_cols + search.s[search.edge_j]]
    return np.flatnonzero(values >= search.big)


class _Repair:
    """The min-conflicts state: per node its incident edges, the set of forbidden edges."""

    def __init__(self, search, seed: int) -> None:
        self.search = search
        self.rng = np.random.default_rng(seed)
        n = len(search.nodes)
        self.incident: list[list[int]] = [[] for _ in range(n)]
        for k, (li, lj, _) in enumerate(search.edges):
            self.incident[li].append(k)
            self.incident[lj].append(k)
        self.bad = set(forbidden_edges(search).tolist())
        self.tabu: dict[tuple[int, int], int] = {}
        self.weight = np.ones(len(search.edges))  # per edge (the breakout method's weights)
        self.moves = 0

    def _fits(self, v: int) -> np.ndarray:
        """The strategies of ``v`` that fit the memory left over its lifetime (its own always)."""
        search = self.search
        current = search.s[v]
        fits = np.ones(len(search.cost[v]), dtype=bool)
        if search.memory[v]:
            lo, hi = search.lo[v], search.hi[v]
            if hi > lo:
                room = float((search.rhs[lo:hi] - search.load[lo:hi]).min())
                usage = search.usage[v]
                fits = usage - usage[current] <= room
                fits[current] = True
        return fits

    def _move(self, v: int, a: int) -> None:
        search = self.search
        old = int(search.s[v])
        if a == old:
            return
        self.tabu[(v, old)] = self.moves + _TABU_TENURE + int(self.rng.integers(_TABU_TENURE))
        search.move(v, a)
        self.moves += 1
        for k in self.incident[v]:
            li, lj, m = search.edges[k]
            if np.isfinite(m[search.s[li], search.s[lj]]):
                self.bad.discard(k)
            else:
                self.bad.add(k)

    def step(self, least: int) -> None:
        """One min-conflicts move at a random forbidden edge (``least``: the fewest forbidden
        edges seen, which a taboo move may still reach)."""
        search = self.search
        k = list(self.bad)[int(self.rng.integers(len(self.bad)))] if len(self.bad) < 64 else self._any_bad()
        li, lj, _ = search.edges[k]
        if self.rng.uniform() < _WALK:
            v = (li, lj)[int(self.rng.integers(2))]
            fits = np.flatnonzero(self._fits(v))
            self._move(v, int(fits[int(self.rng.integers(len(fits)))]))
            return
        best = None
        for v in (li, lj):
            values = search.values(v)
            current = int(search.s[v])
            weighted = self._weighted(v)
            cost = values - np.floor(values / search.big) * search.big  # (the finite part)
            fits = self._fits(v)
            fits[current] = False
            for a in np.lexsort((cost, weighted)).tolist():
                if not fits[a]:
                    continue
                # A taboo move only if it leaves fewer forbidden edges than ever (aspiration).
                after = len(self.bad) + int(values[a] // search.big) - int(values[current] // search.big)
                if self.tabu.get((v, a), -1) > self.moves and after >= least:
                    continue
                gain = (float(weighted[a] - weighted[current]), float(cost[a] - cost[current]))
                if best is None or gain < best[0]:
                    best = (gain, v, a)
                break
        if best is not None and best[0][0] <= 0:
            self._move(best[1], best[2])
            if best[0][0] == 0:
                self.weight[k] += 1.0  # (a sideways move: the edge it left forbidden weighs more)
        else:
            # A local minimum of the weighted count: every forbidden edge weighs more (breakout).
            for edge in self.bad:
                self.weight[edge] += 1.0
            self.moves += 1

    def _weighted(self, v: int) -> np.ndarray:
        """Per strategy of ``v``, the weights of the edges it would make forbidden (its
        neighbours as they are)."""
        search = self.search
        total = np.zeros(len(search.cost[v]))
        for k in self.incident[v]:
            li, lj, m = search.edges[k]
            line = m[:, search.s[lj]] if li == v else m[search.s[li], :]
            total += self.weight[k] * ~np.isfinite(line)
        return total

    def _any_bad(self) -> int:
        # (A set's elements in a random order without listing them all each move.)
        for k in self.bad:
            if self.rng.uniform() < 0.5:
                return k
        return next(iter(self.bad))

    # ------------------------------------------------------------------ memory

    def with_room(self, k: int, deadline: float) -> bool:
        """A move at forbidden edge ``k`` that leaves fewer forbidden pairs but does not fit the
        memory left, made to fit: other nodes live where memory is short move to strategies of
        smaller usage that leave no more forbidden pairs around them (the cheapest per unit
        of memory freed first). Whether the move was made (moves that made room are kept)."""
        search = self.search
        li, lj, _ = search.edges[k]
        for v in (li, lj)[:: 1 if self.rng.uniform() < 0.5 else -1]:
            if not search.memory[v] or search.hi[v] <= search.lo[v]:
                continue
            values = search.values(v)
            current = int(search.s[v])
            fewer = np.flatnonzero(values // search.big < values[current] // search.big)
            for a in fewer[np.argsort(values[fewer], kind="stable")].tolist()[:3]:
                if self._make_room(v, float(search.usage[v][a] - search.usage[v][current]), deadline):
                    self._move(v, a)
                    return True
        return False

    def _make_room(self, v: int, extra: float, deadline: float) -> bool:
        """Free memory over ``v``'s lifetime until ``extra`` more fits (see ``with_room``)."""
        search = self.search
        lo, hi = search.lo[v], search.hi[v]
        for _ in range(_ROOM_MOVES):
            if time.perf_counter() >= deadline:
                return False
            short = extra - (search.rhs[lo:hi] - search.load[lo:hi])
            t = int(np.argmax(short))
            if short[t] <= 0:
                return True
            # No move adds a forbidden pair (values count them in units of ``big``).
            move = search.cheapest_freeing_move(
                lo + t,
                lambda w, values: (values // search.big <= values[search.s[w]] // search.big) & self._fits(w),
                skip=v,
                deadline=deadline,
            )
            if move is None:
                return False
            self._move(*move)
        return False

    # ------------------------------------------------------------------ exact neighbourhoods

    def exact(self, k: int, size: int, deadline: float) -> tuple[bool, bool]:
        """Free about ``size`` nodes around edge ``k`` (breadth first) and search their strategies
        for a choice with no forbidden pair among them or with the fixed nodes, within the memory
        left; applied if found. (Whether it was, whether the search freed every node and
        was exhaustive: then no plan exists, though the caller claims nothing.)"""
        search = self.search
        li, lj, _ = search.edges[k]
        free = [li, lj]
        seen = {li, lj}
        head = 0
        while len(free) < size:
            if head == len(free):
                # (The component is free: other nodes next, a random one first, for the memory
                # they hold. On a small problem every node is freed: the search is complete.)
                taken = np.zeros(len(search.nodes), dtype=bool)
                taken[free] = True
                rest = np.flatnonzero(~taken)
                if not len(rest):
                    break
                w = int(rest[int(self.rng.integers(len(rest)))])
                seen.add(w)
                free.append(w)
            for w, _, _ in search.adjacent[free[head]]:
                if w not in seen:
                    seen.add(w)
                    free.append(w)
            head += 1
        free = free[:size]
        inside = set(free)
        previous = {v: int(search.s[v]) for v in free}
        # While the search runs, every free node sits on its smallest usage (the memory left for
        # the others), and its strategies are those its fixed neighbours allow.
        base = {v: int(np.argmin(search.usage[v])) if search.memory[v] else previous[v] for v in free}
        for v in free:
            search.move(v, base[v])
        domains = {}
        for v in free:
            allowed = np.isfinite(search.cost[v])
            for w, _, m in search.adjacent[v]:
                if w not in inside:
                    allowed &= np.isfinite(m[:, search.s[w]])
            domains[v] = allowed
        found, exhausted = self._dfs(free, inside, domains, base, deadline)
        for v in free:
            search.move(v, previous[v])
        if found is None:
            return False, exhausted and len(free) == len(search.nodes)
        for v, a in found.items():
            self._move(v, a)
        return True, False

    def _dfs(self, free: list[int], inside: set[int], domains: dict, base: dict[int, int], deadline: float) -> tuple[dict[int, int] | None, bool]:
        """Depth-first search with forward checking over the free nodes (memory kept as they are
        assigned: the unassigned sit on their smallest usage): their strategies, or None, and
        whether the search was exhaustive (not cut by its steps or the deadline)."""
        search = self.search
        adjacency = {v: [(w, m) for w, _, m in search.adjacent[v] if w in inside] for v in free}
        assigned: dict[int, int] = {}
        steps = 0
        # The trail: (node, its strategies left to try, the domains it narrowed as they were).
        stack: list[tuple[int, list[int], list[tuple[int, np.ndarray]]]] = []

        def choose() -> int | None:
            left = [v for v in free if v not in assigned]
            if not left:
                return None
            return min(left, key=lambda v: int(domains[v].sum()))

        def options(v: int) -> list[int]:
            allowed = domains[v].copy()
            if search.memory[v] and search.hi[v] > search.lo[v]:
                lo, hi = search.lo[v], search.hi[v]
                room = float((search.rhs[lo:hi] - search.load[lo:hi]).min())
                usage = search.usage[v]
                allowed &= usage - usage[search.s[v]] <= room
            order = np.argsort(np.where(allowed, search.values(v), np.inf), kind="stable")
            return [int(a) for a in order[: int(allowed.sum())]][::-1]

        v = choose()
        if v is None:
            return {}, True
        stack.append((v, options(v), []))
        while stack:
            steps += 1
            if steps > _DFS_STEPS or (steps % 256 == 0 and time.perf_counter() >= deadline):
                for u in list(assigned):
                    search.move(u, base[u])
                return None, False
            v, todo, narrowed = stack[-1]
            for w, saved in narrowed:
                domains[w] = saved
            narrowed.clear()
            if v in assigned:
                del assigned[v]
                search.move(v, base[v])
            if not todo:
                stack.pop()
                continue
            a = todo.pop()
            wiped = False
            for w, m in adjacency[v]:
                if w in assigned:
                    continue
                narrowed.append((w, domains[w]))
                domains[w] = domains[w] & np.isfinite(m[a])
                if not domains[w].any():
                    wiped = True
                    break
            if wiped:
                continue
            assigned[v] = a
            search.move(v, a)
            nxt = choose()
            if nxt is None:
                found = dict(assigned)
                for u in list(assigned):
                    search.move(u, base[u])
                for _, _, saved_list in stack:
                    for w, saved in saved_list:
                        domains[w] = saved
                return found, True
            stack.append((nxt, options(nxt), []))
        return None, True


def repair_forbidden(search, deadline: float, seed: int = 0) -> bool:
    """Move the search's plan (within the memory limit) to one that also makes no forbidden
    choice, keeping the memory limit at every move; whether that was reached by ``deadline``.
    The plan left is the one with the fewest forbidden pairs seen."""
    if search.violation() > 0:
        return False
    repair = _Repair(search, seed)
    if not repair.bad:
        return True
    least, best = len(repair.bad), search.s.copy()
    stalled, size = 0, _FIRST_FREE
    while repair.bad:
        if repair.moves % _CHECK_EVERY == 0 and time.perf_counter() >= deadline:
            break
        if stalled >= _STALL:
            k = list(repair.bad)[int(repair.rng.integers(len(repair.bad)))]
            if repair.with_room(k, deadline):
                stalled = 0
                continue
            found, hopeless = repair.exact(k, size, deadline)
            if hopeless:
                break
            size = _FIRST_FREE if found else min(_MOST_FREE, size * _GROWTH)
            stalled = 0
        else:
            before = repair.moves
            repair.step(least)
            if repair.moves == before:  # (no move: every strategy taboo or above the memory left)
                repair.moves += 1
        if len(repair.bad) < least:
            least, best, stalled = len(repair.bad), search.s.copy(), 0
        else:
            stalled += 1
    if repair.bad:
        search.assign(best)
        return False
    return True
