"""The placement problem as a pairwise cost model over choices, reduced exactly, solved as an ILP.

Each node with strategies is a *choice* (one option per strategy) with a cost per option
(compute, times how often it runs) and the bytes per device it keeps (for a memory budget:
with ``Problem.memory_terms``, per value over the interval it is live, the budget bounding
the peak; else one sum). Each read of a value is a *factor* between the value's choice and
the reader's: a table of redistribution seconds indexed by the value's placement and the
placement the reader needs (``inf`` where two placements must be equal and are not).

Exact reductions before the ILP (each keeps the optimum):
- factors with a one-option side become option costs; factors between the same two choices merge;
- options indistinguishable to every factor and to memory keep only the cheapest;
- a choice with at most two neighbours and no memory term is eliminated (a chain link's
  min-plus product, a leaf's minimum), so chains and trees shrink to their branch points; a
  link is kept when its product would have more entries than the two factors it replaces.

The rest is an integer program: a binary per option, one option per choice; per factor a
continuous variable per (row, column) of its table whose row and column sums equal the
options on each side (exact for binary options); with a budget, a memory row per largest set
of terms live together (``peak_sets``), or one row of every choice's memory. It is
solved by HiGHS through ``scipy.optimize.milp`` (``milp_solver="scipy"``), or through HiGHS's
own binding (``"highspy"``) or PuLP's CBC (``"cbc"``) for comparison.

On meshes of 3 or more axes a value has up to (rank + 2)^3 layouts and that program outgrows
HiGHS (1.75M variables for LLaMA-3 8B on 4x4x4). Past ``_EXACT_PAIRS`` pair variables the
choices' per-axis codes (``Choice.axes``) drive a search instead (``_axis_search``): a coarse
level with two mesh axes tied, then neighbourhoods of the plan (any one axis per choice; any
two axes for every choice), each an exact integer program of at most the size of a 2-D
mesh's, repeated while the plan improves. The plan is valid and never worse than the coarse
level's optimum, but not proven optimal; ``stats["status"]`` says so.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Any, Sequence

import numpy as np

from passes.solver.deadline import CANCEL_GRACE, solve_model_by, start_workers

__all__ = ["Choice", "Factor", "Problem", "SolveResult", "InfeasiblePlacementError", "NoPlanFoundError", "solve_problem"]

# Costs enter the integer program in microseconds (seconds are too close to solver tolerances).
_SCALE = 1e6
# The optimum is proven within this relative gap (the solvers' default, 1e-4, is not exact).
_GAP = 1e-9
# HiGHS's presolve on these programs (one-hot options, pair variables tied to them by row
# and column sums) took half of each solve and removed little: LLaMA-3 8B on 8x8 (75k
# variables) 1.31 -> 0.72 s without it, the 3-D search's programs 1.1-2.0 -> 0.5-1.05 s, the
# same optima (their relaxations came out integral at the root).
_PRESOLVE = False
# A neighbourhood of the axis search (``_axis_search``) stops within 0.1% of its optimum: a
# plane of 70k variables took 3-6 s to prove that no plan 0.03% cheaper was left (LLaMA-3 70B
# on 8x8x8), 1-2 s to get within 0.1%.
_NEIGHBOURHOOD_GAP = 1e-3


class InfeasiblePlacementError(ValueError):
    """No placement satisfies the fixed placements and the memory budget (proven)."""


class NoPlanFoundError(TimeoutError):
    """The time limit ran out before any plan was found; the problem is not proven infeasible."""


@dataclasses.dataclass
class Choice:
    name: str
    cost: np.ndarray  # seconds per option
    memory: np.ndarray  # bytes per device per option
    # Per option, one code per mesh axis: options with equal codes on an axis place every
    # tensor they touch alike on that axis (``None``: the options are not per-axis layouts).
    axes: np.ndarray | None = None


@dataclasses.dataclass
class Factor:
    """Cost ``table[rows[i], cols[j]]`` when choice ``a`` takes option ``i`` and ``b`` option ``j``."""

    a: int
    b: int
    rows: np.ndarray  # class of each option of a
    cols: np.ndarray  # class of each option of b
    table: np.ndarray  # seconds; inf: not allowed

    def flipped(self) -> Factor:
        return Factor(self.b, self.a, self.cols, self.rows, self.table.T)


@dataclasses.dataclass
class MemoryTerm:
    """Bytes per device a value takes while it is live, ``[start, end)`` in program order,
    per option of the choice that places it."""

    choice: int
    start: int
    end: int
    usage: np.ndarray


@dataclasses.dataclass
class Problem:
    choices: list[Choice]
    factors: list[Factor]
    constant: float = 0.0  # seconds that no choice changes
    # With terms, the memory budget bounds the peak over time of the live terms' usages
    # (each choice's ``memory`` is then the sum of its terms); without, the sum of every
    # choice's ``memory``.
    memory_terms: list[MemoryTerm] = dataclasses.field(default_factory=list)


def peak_sets(terms: Sequence[MemoryTerm]) -> list[list[int]]:
    """The sets of terms live together at the times where the live set is largest: each
    start followed by an end (a time whose live set another's contains bounds nothing more)."""
    events = sorted([(t.start, 1, i) for i, t in enumerate(terms)] + [(t.end, 0, i) for i, t in enumerate(terms)])
    live: set[int] = set()
    sets, growing = [], False
    for _, is_start, i in events:  # at equal times ends come first: intervals are half-open
        if is_start:
            live.add(i)
            growing = True
        else:
            if growing:
                sets.append(sorted(live))
            growing = False
            live.discard(i)
    if growing and live:
        sets.append(sorted(live))
    return sets


@dataclasses.dataclass
class SolveResult:
    options: list[int]  # chosen option per choice
    cost: float  # seconds
    stats: dict


def _classes(values: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    index: dict[Any, int] = {}
    rows = np.array([index.setdefault(v, len(index)) for v in values], dtype=np.int64)
    return rows, list(index)


class _Reducer:
    """Exact reductions (see the module docstring); remembers how to expand a solution."""

    def __init__(self, problem: Problem, keep_memory: bool) -> None:
        self.choices = problem.choices
        self.cost = [c.cost.astype(float).copy() for c in problem.choices]
        self.memory = [c.memory.astype(float).copy() for c in problem.choices]
        self.memory_terms = problem.memory_terms
        self.peak_sets = peak_sets(problem.memory_terms) if problem.memory_terms else None
        # What tells a choice's options apart to the memory rows: each of its terms' usages.
        by_choice: dict[int, list[np.ndarray]] = {}
        for term in problem.memory_terms:
            by_choice.setdefault(term.choice, []).append(term.usage)
        self.memory_keys = [np.stack(by_choice[i], axis=1) if i in by_choice else m[:, None] for i, m in enumerate(self.memory)]
        self.alive = [np.ones(len(c.cost), dtype=bool) for c in problem.choices]
        self.constant = problem.constant
        self.keep_memory = keep_memory
        self.factors: dict[int, Factor] = {}
        self.incident: list[set[int]] = [set() for _ in problem.choices]
        self.removed = [False] * len(problem.choices)
        self.fixed: dict[int, int] = {}
        self.eliminated: list[tuple] = []  # (choice, kind, data) in elimination order
        self._next = 0
        for factor in problem.factors:
            self._add_factor(factor)

    # ---------------------------------------------------------------- factor bookkeeping

    def _add_factor(self, factor: Factor) -> None:
        if factor.a == factor.b:
            self.cost[factor.a] += factor.table[factor.rows, factor.cols]
            return
        fid = self._next
        self._next += 1
        self.factors[fid] = factor
        self.incident[factor.a].add(fid)
        self.incident[factor.b].add(fid)

    def _drop_factor(self, fid: int) -> Factor:
        factor = self.factors.pop(fid)
        self.incident[factor.a].discard(fid)
        self.incident[factor.b].discard(fid)
        return factor

    def _oriented(self, fid: int, choice: int) -> Factor:
        factor = self.factors[fid]
        return factor if factor.a == choice else factor.flipped()

    def _neighbours(self, choice: int) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for fid in self.incident[choice]:
            factor = self.factors[fid]
            out.setdefault(factor.b if factor.a == choice else factor.a, []).append(fid)
        return out

    # ---------------------------------------------------------------- reductions

    def fold_single_options(self) -> None:
        """Factors whose one side has one live option become costs of the other side."""
        for fid in list(self.factors):
            if fid not in self.factors:
                continue
            factor = self.factors[fid]
            for side in (factor.a, factor.b):
                live = np.flatnonzero(self.alive[side])
                if len(live) == 1:
                    oriented = self._oriented(fid, side)
                    self._drop_factor(fid)
                    row = oriented.rows[live[0]]
                    self.cost[oriented.b] += oriented.table[row, oriented.cols]
                    break

    def merge_parallel(self, choice: int) -> None:
        """One factor per neighbour of ``choice``."""
        for fids in self._neighbours(choice).values():
            if len(fids) < 2:
                continue
            merged = self._oriented(fids[0], choice)
            self._drop_factor(fids[0])
            for fid in fids[1:]:
                other = self._oriented(fid, choice)
                self._drop_factor(fid)
                merged = _merge(merged, other)
            self._add_factor(merged)

    def prune_options(self, choice: int) -> None:
        """Options no factor and no memory row tells apart keep only the cheapest; options
        that some factor forbids whatever the neighbour does are dropped."""
        cost = self.cost[choice]
        alive = self.alive[choice] & np.isfinite(cost)
        keys = list(self.memory_keys[choice].T) if self.keep_memory else []
        for fid in self.incident[choice]:
            oriented = self._oriented(fid, choice)
            row_allowed = np.isfinite(oriented.table).any(axis=1)
            alive &= row_allowed[oriented.rows]
            keys.append(oriented.rows)
        if keys:
            stacked = np.stack(keys, axis=1)
            best: dict[bytes, int] = {}
            for option in np.flatnonzero(alive):
                key = stacked[option].tobytes()
                if key in best:
                    keep = best[key]
                    if cost[option] < cost[keep]:
                        alive[keep] = False
                        best[key] = option
                    else:
                        alive[option] = False
                else:
                    best[key] = option
        elif alive.any():
            keep = np.flatnonzero(alive)[np.argmin(cost[alive])]
            alive[:] = False
            alive[keep] = True
        if not alive.any():
            raise InfeasiblePlacementError(
                f"no strategy of {self.choices[choice].name} is compatible with the placements fixed around it"
            )
        self.alive[choice] = alive

    def _check_deadline(self, count: int) -> None:
        if count % 256 == 255 and time.perf_counter() >= getattr(self, "deadline", math.inf):
            raise NoPlanFoundError("the time limit ran out in the exact reductions")

    def eliminate(self) -> None:
        """Eliminate choices with at most two neighbours and no memory term, cheapest first."""
        queue = list(range(len(self.choices)))
        while queue:
            next_queue = []
            for count, choice in enumerate(queue):
                self._check_deadline(count)
                if self.removed[choice]:
                    continue
                if self.keep_memory and np.any(self.memory[choice][self.alive[choice]] != 0):
                    continue
                self.merge_parallel(choice)
                neighbours = self._neighbours(choice)
                if len(neighbours) > 2 or (len(neighbours) == 2 and self._link_grows(choice, neighbours)):
                    continue
                touched = self._eliminate_one(choice, neighbours)
                next_queue.extend(touched)
            queue = next_queue

    def _link_grows(self, choice: int, neighbours: dict[int, list[int]]) -> bool:
        """Whether eliminating the link ``choice`` makes a factor with more live (row, column)
        pairs than the two it replaces (a few options between two many-option neighbours, as
        a view between two values on a 3-D mesh): the integer program would grow."""
        own = int(self.alive[choice].sum())
        sizes = []
        for fids in neighbours.values():
            factor = self._oriented(fids[0], choice)
            sizes.append(len(np.unique(factor.cols[self.alive[factor.b]])))
        return sizes[0] * sizes[1] > own * (sizes[0] + sizes[1])

    def _eliminate_one(self, choice: int, neighbours: dict[int, list[int]]) -> list[int]:
        live = np.flatnonzero(self.alive[choice])
        cost = self.cost[choice][live]
        self.removed[choice] = True
        if not neighbours:
            best = int(np.argmin(cost))
            if not np.isfinite(cost[best]):
                raise InfeasiblePlacementError(f"no strategy of {self.choices[choice].name} is feasible")
            self.constant += float(cost[best])
            self.fixed[choice] = int(live[best])
            return []
        (first, [fid_a]), *rest = neighbours.items()
        factor_a = self._oriented(fid_a, choice)  # rows: choice's classes
        self._drop_factor(fid_a)
        # table_a[o, r]: cost between option o of ``choice`` and class r of ``first``
        table_a = factor_a.table[factor_a.rows[live], :]
        if not rest:
            total = table_a + cost[:, None]
            best = np.argmin(total, axis=0)  # per class of ``first``
            per_class = total[best, np.arange(total.shape[1])]
            self.cost[first] += per_class[factor_a.cols]
            self.eliminated.append((choice, "leaf", (first, factor_a.cols, live[best])))
            return [first]
        (second, [fid_b]), = rest
        factor_b = self._oriented(fid_b, choice)
        self._drop_factor(fid_b)
        table_b = factor_b.table[factor_b.rows[live], :]
        combined, best = _min_plus(table_a, cost, table_b)
        self._add_factor(Factor(first, second, factor_a.cols, factor_b.cols, combined))
        self.eliminated.append((choice, "link", (first, factor_a.cols, second, factor_b.cols, live[best])))
        return [first, second]

    def restricted(self, masks: dict[int, np.ndarray]) -> _Reducer:
        """A copy of this reduced problem keeping only the options in ``masks`` (per choice)."""
        sub = object.__new__(_Reducer)
        sub.choices = self.choices
        sub.cost = [c.copy() for c in self.cost]
        sub.memory = self.memory
        sub.memory_terms, sub.peak_sets, sub.memory_keys = self.memory_terms, self.peak_sets, self.memory_keys
        sub.alive = [a & masks[i] if i in masks else a.copy() for i, a in enumerate(self.alive)]
        sub.constant = self.constant
        sub.keep_memory = self.keep_memory
        sub.factors = dict(self.factors)
        sub.incident = [set(i) for i in self.incident]
        sub.removed = list(self.removed)
        sub.fixed = dict(self.fixed)
        sub.eliminated = []
        sub._next = self._next
        return sub

    def _expanded(self, options: dict[int, int]) -> dict[int, int]:
        """Options of the choices left in the ILP, the fixed and the eliminated ones."""
        chosen = dict(self.fixed)
        chosen.update(options)
        for choice, kind, data in reversed(self.eliminated):
            if kind == "leaf":
                first, cols, best = data
                chosen[choice] = int(best[cols[chosen[first]]])
            else:
                first, cols_a, second, cols_b, best = data
                chosen[choice] = int(best[cols_a[chosen[first]], cols_b[chosen[second]]])
        return chosen

    def expand(self, options: dict[int, int]) -> list[int]:
        """Options of every choice from those of the choices left in the ILP."""
        chosen = self._expanded(options)
        return [chosen[i] for i in range(len(self.choices))]

    def expand_partial(self, options: dict[int, int], keep: Sequence[int]) -> dict[int, int]:
        """Options of the choices ``keep`` (those a restricted copy started from) from those left in its ILP."""
        chosen = self._expanded(options)
        return {i: chosen[i] for i in keep}

    def reduce(self, eliminate: bool = True, deadline: float = math.inf) -> None:
        """The exact reductions (see the module docstring), in order; ``NoPlanFoundError`` if
        ``deadline`` comes first."""
        self.deadline = deadline
        self.fold_single_options()
        remaining = [c for c in range(len(self.choices)) if not self.removed[c]]
        for count, choice in enumerate(remaining):
            self._check_deadline(count)
            self.prune_options(choice)
        self.fold_single_options()
        if eliminate:
            self.eliminate()
        for count, choice in enumerate(remaining):
            self._check_deadline(count)
            if not self.removed[choice]:
                self.merge_parallel(choice)
                self.prune_options(choice)

    def pair_count(self) -> int:
        """Pair variables the integer program of what is left would have."""
        total = 0
        for factor in self.factors.values():
            rows = np.unique(factor.rows[self.alive[factor.a]])
            cols = np.unique(factor.cols[self.alive[factor.b]])
            total += int(np.isfinite(factor.table[np.ix_(rows, cols)]).sum())
        return total


def _min_plus(table_a: np.ndarray, cost: np.ndarray, table_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``min`` over options ``o`` of ``table_a[o, r] + cost[o] + table_b[o, c]`` for every
    ``(r, c)``, and the ``o`` reaching it (the first on ties). Large products run one option at
    a time: a 3-D mesh's link of 343 options between two of 343 would be a 40M-entry array."""
    if table_a.size * table_b.shape[1] <= 1 << 20:
        total = table_a[:, :, None] + cost[:, None, None] + table_b[:, None, :]  # o x ra x rb
        best = np.argmin(total, axis=0)
        return np.take_along_axis(total, best[None], axis=0)[0], best
    combined = table_a[0][:, None] + (cost[0] + table_b[0])[None, :]
    best = np.zeros(combined.shape, dtype=np.int64)
    for option in range(1, len(cost)):
        candidate = table_a[option][:, None] + (cost[option] + table_b[option])[None, :]
        better = candidate < combined
        np.copyto(combined, candidate, where=better)
        best[better] = option
    return combined, best


def _merge(one: Factor, other: Factor) -> Factor:
    """Two factors between the same choices (both oriented ``a -> b``) as one."""
    rows, row_keys = _classes(list(zip(one.rows.tolist(), other.rows.tolist())))
    cols, col_keys = _classes(list(zip(one.cols.tolist(), other.cols.tolist())))
    r1 = np.array([k[0] for k in row_keys])
    r2 = np.array([k[1] for k in row_keys])
    c1 = np.array([k[0] for k in col_keys])
    c2 = np.array([k[1] for k in col_keys])
    table = one.table[np.ix_(r1, c1)] + other.table[np.ix_(r2, c2)]
    return Factor(one.a, one.b, rows, cols, table)


# --------------------------------------------------------------------------- the integer program


@dataclasses.dataclass
class _Milp:
    cost: np.ndarray
    integrality: np.ndarray
    matrix: Any  # scipy.sparse csr
    row_lower: np.ndarray
    row_upper: np.ndarray
    option_columns: dict[int, tuple[np.ndarray, np.ndarray]]  # choice -> (options, columns)
    # per factor: (a, rows of a's options, b, cols of b's options, used rows, used cols, pair columns by [row, col])
    pairs: list = dataclasses.field(default_factory=list)

    def start(self, options: dict[int, int]) -> np.ndarray:
        """The column values of a plan (an option per choice of the program)."""
        x = np.zeros(len(self.cost))
        for choice, (live, columns) in self.option_columns.items():
            x[columns[np.flatnonzero(live == options[choice])[0]]] = 1.0
        for a, rows, b, cols, used_rows, used_cols, grid in self.pairs:
            r = np.searchsorted(used_rows, rows[options[a]])
            c = np.searchsorted(used_cols, cols[options[b]])
            x[grid[r, c]] = 1.0
        return x


def _build_milp(reducer: _Reducer, memory_budget: float | None, deadline: float = math.inf) -> _Milp | None:
    """The integer program of what ``reducer`` left (``None``: nothing left); raises
    ``NoPlanFoundError`` if ``deadline`` comes while it is built."""
    import scipy.sparse as sparse

    def check(count: int) -> None:
        if count % 16 == 15 and time.perf_counter() >= deadline:
            raise NoPlanFoundError("the time limit ran out while the integer program was built")

    remaining = [i for i in range(len(reducer.choices)) if not reducer.removed[i]]
    # Options of each remaining choice; a choice left with one option is fixed.
    costs, integrality = [], []
    rows_i, cols_j, values = [], [], []
    row_lower, row_upper = [], []
    option_columns: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    pairs: list = []
    # Without memory terms, one row of every choice's memory (its columns and the fixed part).
    one_row = memory_budget is not None and reducer.peak_sets is None
    memory_columns: list[tuple[np.ndarray, np.ndarray]] = []
    memory_constant = 0.0

    columns_so_far = [0]

    def new_columns(cost: np.ndarray, integer: bool) -> np.ndarray:
        start = columns_so_far[0]
        columns_so_far[0] += len(cost)
        costs.append(cost)
        integrality.append(np.full(len(cost), 1 if integer else 0))
        return np.arange(start, start + len(cost))

    def add_row(columns: np.ndarray, coefficients: np.ndarray, lower: float, upper: float) -> None:
        row = len(row_lower)
        rows_i.append(np.full(len(columns), row))
        cols_j.append(columns)
        values.append(coefficients)
        row_lower.append(lower)
        row_upper.append(upper)

    for choice in remaining:
        live = np.flatnonzero(reducer.alive[choice])
        columns = new_columns(reducer.cost[choice][live] * _SCALE, True)
        option_columns[choice] = (live, columns)
        add_row(columns, np.ones(len(columns)), 1.0, 1.0)
        if one_row:
            memory_columns.append((columns, reducer.memory[choice][live]))
    for choice in range(len(reducer.choices)):
        if reducer.removed[choice] and one_row and choice in reducer.fixed:
            memory_constant += reducer.memory[choice][reducer.fixed[choice]]
    if memory_budget is not None and reducer.peak_sets is not None:
        # One row per largest live set: the live terms' usages under the options chosen.
        for count, live_set in enumerate(reducer.peak_sets):
            check(count)
            coefficients: dict[int, np.ndarray] = {}
            constant = 0.0
            for i in live_set:
                term = reducer.memory_terms[i]
                if term.choice in option_columns:
                    live = option_columns[term.choice][0]
                    coefficients[term.choice] = coefficients.get(term.choice, 0.0) + term.usage[live]
                elif term.choice in reducer.fixed:
                    constant += float(term.usage[reducer.fixed[term.choice]])
            if coefficients:
                add_row(
                    np.concatenate([option_columns[c][1] for c in coefficients]),
                    np.concatenate(list(coefficients.values())),
                    -np.inf,
                    memory_budget - constant,
                )
    for count, factor in enumerate(reducer.factors.values()):
        check(count)
        live_a, columns_a = option_columns[factor.a]
        live_b, columns_b = option_columns[factor.b]
        rows_of_a = factor.rows[live_a]
        cols_of_b = factor.cols[live_b]
        used_rows = np.unique(rows_of_a)
        used_cols = np.unique(cols_of_b)
        table = factor.table[np.ix_(used_rows, used_cols)]
        finite = np.isfinite(table)
        r_idx, c_idx = np.nonzero(finite)
        pair_columns = new_columns(table[r_idx, c_idx] * _SCALE, False)
        grid = np.full(table.shape, -1, dtype=np.int64)
        grid[r_idx, c_idx] = pair_columns
        pairs.append((factor.a, factor.rows, factor.b, factor.cols, used_rows, used_cols, grid))
        # Row sums: each class of a equals the sum of a's options in it.
        for k, r in enumerate(used_rows):
            mine = pair_columns[r_idx == k]
            options = columns_a[rows_of_a == r]
            add_row(np.concatenate([mine, options]), np.concatenate([np.ones(len(mine)), -np.ones(len(options))]), 0.0, 0.0)
        for k, c in enumerate(used_cols):
            mine = pair_columns[c_idx == k]
            options = columns_b[cols_of_b == c]
            add_row(np.concatenate([mine, options]), np.concatenate([np.ones(len(mine)), -np.ones(len(options))]), 0.0, 0.0)
    if one_row and memory_columns:
        columns = np.concatenate([c for c, _ in memory_columns])
        coefficients = np.concatenate([m for _, m in memory_columns])
        add_row(columns, coefficients, -np.inf, memory_budget - memory_constant)
    if not costs:
        return None
    n_cols = sum(len(c) for c in costs)
    matrix = sparse.csr_matrix(
        (np.concatenate(values), (np.concatenate(rows_i), np.concatenate(cols_j))), shape=(len(row_lower), n_cols)
    )
    return _Milp(
        np.concatenate(costs), np.concatenate(integrality), matrix, np.array(row_lower), np.array(row_upper), option_columns,
        pairs,
    )


def _solve_highs(
    milp: _Milp, deadline: float = math.inf, start: np.ndarray | None = None, gap: float = _GAP
) -> tuple[str, np.ndarray | None]:
    try:
        import highspy  # noqa: F401
    except ImportError as e:  # pragma: no cover - only for comparisons
        raise ImportError("milp_solver='highspy' needs highspy (pip install highspy, or the 'bench' extra)") from e

    csc = milp.matrix.tocsc()
    model = dict(
        col_cost=milp.cost,
        col_upper=np.ones(csc.shape[1]),
        row_lower=milp.row_lower,
        row_upper=milp.row_upper,
        start=csc.indptr,
        index=csc.indices,
        value=csc.data,
        integer=np.asarray(milp.integrality, dtype=bool),
        options=dict(threads=1, mip_rel_gap=gap, presolve="off" if _PRESOLVE is False else "choose"),
        x0=start,
    )
    # Ended at the deadline whatever HiGHS's own time limit does (``solve_model_by``).
    result = solve_model_by(model, deadline)
    if result is None:
        return "time limit", None
    if result["status"] == "infeasible":
        return "infeasible", None
    return result["status"], result["x"]  # (x: the best plan found when stopped early)


def _solve_scipy(milp: _Milp, deadline: float = math.inf, gap: float = _GAP) -> tuple[str, np.ndarray | None]:
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.optimize import milp as scipy_milp

    options = {"disp": False, "mip_rel_gap": gap, "presolve": _PRESOLVE}
    if math.isfinite(deadline):
        # (Not cut at the deadline: scipy's HiGHS keeps its own time limit, not always.)
        options["time_limit"] = max(1e-3, deadline - time.perf_counter())
    result = scipy_milp(
        milp.cost,
        integrality=milp.integrality,
        bounds=Bounds(0, 1),
        constraints=LinearConstraint(milp.matrix, milp.row_lower, milp.row_upper),
        options=options,
    )
    if result.status == 0:
        return "optimal", result.x
    if result.status == 2:
        return "infeasible", None
    return result.message, result.x


def _solve_cbc(milp: _Milp, deadline: float = math.inf, gap: float = _GAP) -> tuple[str, np.ndarray | None]:
    try:
        import pulp
    except ImportError as e:  # pragma: no cover - only for comparisons
        raise ImportError("milp_solver='cbc' needs PuLP (pip install pulp, or the 'bench' extra)") from e
    problem = pulp.LpProblem("placements", pulp.LpMinimize)
    variables = [
        pulp.LpVariable(f"v{i}", 0, 1, cat="Binary" if milp.integrality[i] else "Continuous")
        for i in range(len(milp.cost))
    ]
    problem += pulp.lpSum(c * v for c, v in zip(milp.cost.tolist(), variables) if c)
    csr = milp.matrix
    for r in range(csr.shape[0]):
        start, end = csr.indptr[r], csr.indptr[r + 1]
        expression = pulp.lpSum(csr.data[k] * variables[csr.indices[k]] for k in range(start, end))
        lower, upper = milp.row_lower[r], milp.row_upper[r]
        if lower == upper:
            problem += expression == lower
        else:
            if np.isfinite(lower):
                problem += expression >= lower
            if np.isfinite(upper):
                problem += expression <= upper
    time_limit = max(1e-3, deadline - time.perf_counter()) if math.isfinite(deadline) else None
    problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap))
    status = pulp.LpStatus[problem.status]
    if status == "Optimal":
        return "optimal", np.array([v.value() or 0.0 for v in variables])
    if status == "Infeasible":
        return "infeasible", None
    return status.lower(), None


_BACKENDS = {"scipy": _solve_scipy, "highspy": _solve_highs, "cbc": _solve_cbc}


# Above this many pair variables after the exact reductions, a problem whose options are
# per-axis layouts on a mesh of 3 or more axes is searched by axes (``search="axes"``).
_EXACT_PAIRS = 400_000
_SEARCHES = ("auto", "exact", "axes")


def _greedy_start(reducer: _Reducer, deadline: float, sweeps: int = 5) -> dict[int, int]:
    """An option per choice left in ``reducer``: the cheapest, then each choice moved to its
    cheapest option given its neighbours' (a few sweeps, or until ``deadline``)."""
    remaining = [c for c in range(len(reducer.choices)) if not reducer.removed[c]]
    live = {c: np.flatnonzero(reducer.alive[c]) for c in remaining}
    chosen = {c: int(live[c][np.argmin(reducer.cost[c][live[c]])]) for c in remaining}
    for _ in range(sweeps):
        changed = False
        for count, c in enumerate(remaining):
            if count % 256 == 255 and time.perf_counter() >= deadline:
                return chosen
            total = reducer.cost[c][live[c]].copy()
            for fid in reducer.incident[c]:
                factor = reducer._oriented(fid, c)
                total = total + factor.table[factor.rows[live[c]], factor.cols[chosen[factor.b]]]
            best = int(live[c][np.argmin(total)])
            if best != chosen[c] and total.min() < total[np.flatnonzero(live[c] == chosen[c])[0]]:
                chosen[c] = best
                changed = True
        if not changed:
            break
    return chosen


def _satisfies(milp: _Milp, x: np.ndarray) -> bool:
    """Whether ``x`` meets every row and bound of ``milp`` (with a small tolerance)."""
    if not np.isfinite(x).all() or (x < -1e-9).any() or (x > 1 + 1e-9).any():
        return False
    activity = milp.matrix @ x
    tolerance = 1e-6 * np.maximum(1.0, np.abs(activity))
    return bool(((activity >= milp.row_lower - tolerance) & (activity <= milp.row_upper + tolerance)).all())


def _highspy_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:  # pragma: no cover - highspy is in the test extra
        return False
    return True


def _solve_reduced(
    reducer: _Reducer,
    memory_budget: float | None,
    milp_solver: str,
    deadline: float = math.inf,
    start: dict[int, int] | None = None,
    gap: float = _GAP,
) -> tuple[dict[int, int], str, int, int, int]:
    """The integer program of what ``reducer`` left: (options of its choices, status, variables,
    constraints, choices in it). ``deadline``: a ``time.perf_counter()`` value the solver is
    cut at (with a deadline, HiGHS runs through highspy when it is installed: scipy's cannot be
    cut); ``start``: a plan to start HiGHS from (an option per choice, used with highspy when
    the reductions kept its options); ``gap``: the relative gap at which the solver stops.
    Raises ``NoPlanFoundError`` when the deadline came before a plan."""
    if math.isfinite(deadline) and milp_solver == "scipy" and _highspy_available():
        milp_solver = "highspy"
    milp = _build_milp(reducer, memory_budget, deadline)
    options: dict[int, int] = {}
    if milp is None:
        return options, "optimal", 0, 0, 0
    initial = None
    if start is not None and milp_solver == "highspy":
        try:
            initial = milp.start(start)
        except IndexError:  # an option of the plan was reduced away (an equivalent one kept)
            initial = None
    if initial is not None:
        status, x = _solve_highs(milp, deadline, initial, gap)
    else:
        status, x = _BACKENDS[milp_solver](milp, deadline, gap=gap)
    if x is None and initial is not None and _satisfies(milp, initial):
        # Stopped before HiGHS had a plan of its own: the start is the best plan found.
        status, x = f"{status}; the start plan", initial
    if x is None:
        if status == "infeasible":
            budget = "" if memory_budget is None else f" and memory_budget={memory_budget:.6g} bytes per device"
            raise InfeasiblePlacementError(
                f"no placement satisfies the fixed placements{budget}; raise the budget or drop a fixed placement"
            )
        raise NoPlanFoundError(f"the MILP solver stopped without a plan ({status}) before the time limit")
    for choice, (live, columns) in milp.option_columns.items():
        options[choice] = int(live[int(np.argmax(x[columns]))])
    return options, status, milp.matrix.shape[1], milp.matrix.shape[0], len(milp.option_columns)


def _axis_search(
    problem: Problem, reducer: _Reducer, memory_budget: float | None, milp_solver: str, deadline: float = math.inf
) -> tuple[dict[int, int], dict] | None:
    """Two levels over the mesh axes of a reduced problem too large for one integer program.

    1. Coarse: every choice keeps only the options that place alike on the first two mesh axes
       (the mesh with those two axes merged; the next pair if that is infeasible), solved exactly.
    2. Refine: every choice may change its layout on any one axis (each choice its own axis) from
       the best plan so far, solved exactly, repeated while the plan gets cheaper; then (3 or
       more axes) every plane of two axes at once, each a program of its own; back to one
       axis while a plane finds a cheaper plan.

    Each step is an integer program over a subset of the options that holds the plan so far
    (the coarse level solved exactly, a neighbourhood to within ``_NEIGHBOURHOOD_GAP`` of its
    optimum), so the plan only improves, but the result is the best found in these
    neighbourhoods, not a proven optimum. ``None`` when no coarse level is feasible (the
    caller solves exactly) or none was solved by ``deadline`` (a ``time.perf_counter()``
    value; every program is cut there, and the threads solving them end by then).
    """
    import itertools

    keep = [c for c in range(len(problem.choices)) if not reducer.removed[c]]
    axes = {c: problem.choices[c].axes for c in keep if problem.choices[c].axes is not None}
    if not axes:
        return None
    ndim = max(a.shape[1] for a in axes.values())
    stats = dict(variables=0, constraints=0, choices_in_ilp=0, ilps=0, coarse_costs=[], refine_costs=[])

    # HiGHS's own binding takes the plan so far as a start; scipy's does not.
    solver = milp_solver
    if milp_solver == "scipy":
        try:
            import highspy  # noqa: F401

            solver = "highspy"
        except ImportError:
            pass

    def run(masks: dict[int, np.ndarray], incumbent: dict[int, int] | None = None) -> tuple[dict[int, int], float, tuple]:
        """The best plan in the neighbourhood ``masks``, its cost, and what the program took
        (thread-safe: several neighbourhoods are solved at once)."""
        sub = reducer.restricted(masks)
        sub.reduce(deadline=deadline)
        began = time.thread_time()
        gap = _GAP if incumbent is None else _NEIGHBOURHOOD_GAP
        options, _, variables, constraints, in_ilp = _solve_reduced(sub, memory_budget, solver, deadline, incumbent, gap)
        chosen = sub.expand_partial(options, keep)
        return chosen, evaluate(problem, reducer.expand(chosen)), (time.thread_time() - began, variables, constraints, in_ilp)

    def record(found: tuple) -> tuple[dict[int, int], float]:
        seconds, variables, constraints, in_ilp = found[2]
        stats["ilps"] += 1
        stats.setdefault("ilp_cpu_seconds", []).append(round(seconds, 2))
        stats.setdefault("ilp_variables", []).append(variables)
        if variables > stats["variables"]:
            stats.update(variables=variables, constraints=constraints, choices_in_ilp=in_ilp)
        return found[0], found[1]

    best: tuple[dict[int, int], float] | None = None
    for a, b in itertools.combinations(range(ndim), 2):
        if best is not None:
            break  # one coarse level is a start; the neighbourhoods below untie it
        masks = {}
        for choice, codes in axes.items():
            tied = codes[:, a] == codes[:, b]
            if tied[reducer.alive[choice]].any():
                masks[choice] = tied
        try:
            found = record(run(masks))
        except InfeasiblePlacementError:
            continue
        except NoPlanFoundError:
            break  # the deadline came first
        stats["coarse_costs"].append(found[1])
        if best is None or found[1] < best[1]:
            best = found
    if best is None:
        return None

    def one_axis(chosen: dict[int, int]) -> dict[int, np.ndarray]:
        """Each choice may change its layout on any one axis."""
        return {choice: (codes != codes[chosen[choice]]).sum(axis=1) <= 1 for choice, codes in axes.items()}

    def plane(chosen: dict[int, int], pair: tuple[int, int]) -> dict[int, np.ndarray]:
        """Every choice may change its layout on the two axes of ``pair``, the others as in the plan."""
        fixed = [axis for axis in range(ndim) if axis not in pair]
        return {choice: (codes[:, fixed] == codes[chosen[choice], fixed]).all(axis=1) for choice, codes in axes.items()}

    def better(found: tuple[dict[int, int], float]) -> bool:
        return found[1] < best[1] - 1e-12 * abs(best[1])

    def time_left() -> bool:
        return time.perf_counter() < deadline

    # Neighbourhoods of the plan so far: each choice changes any one axis; on 3 or more axes,
    # every plane of two axes (the others as in the plan). The first round solves the one-axis
    # neighbourhood of the coarse plan alone (cheap, and it usually improves); each later
    # round solves the neighbourhoods not yet solved from the plan so far at once (they are
    # independent programs, and HiGHS runs outside the GIL), the largest first so that a
    # worker done with a small one takes the next. Stops when a plan's neighbourhoods are all
    # solved without improving it.
    planes = list(itertools.combinations(range(ndim), 2)) if ndim >= 3 else []
    one_axis_from = planes_from = None  # the plans those neighbourhoods were last solved from
    first_round = True
    while time_left():
        chosen = best[0]
        tasks = []
        if one_axis_from is not chosen:
            tasks.append(one_axis(chosen))
            one_axis_from = chosen
        if planes and planes_from is not chosen and not first_round:
            tasks += [plane(chosen, pair) for pair in planes]
            planes_from = chosen
        first_round = False
        if not tasks:
            break
        order = sorted(range(len(tasks)), key=lambda i: -sum(int(m.sum()) for m in tasks[i].values()))
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(tasks), os.cpu_count() or 1)) as pool:
            submitted = {i: pool.submit(run, tasks[i], chosen) for i in order}
        results = []
        for i in range(len(tasks)):
            try:
                results.append(record(submitted[i].result()))
            except NoPlanFoundError:  # the deadline came inside this neighbourhood: keep the plan so far
                pass
        stats["refine_costs"].extend(cost for _, cost in results)
        improved = [found for found in results if better(found)]
        if improved:
            best = min(improved, key=lambda found: found[1])
    stats["status"] = "best of the axis neighbourhoods (not proven optimal)"
    return best[0], stats


def solve_problem(
    problem: Problem,
    *,
    memory_budget: float | None = None,
    milp_solver: str = "scipy",
    time_limit: float | None = None,
    reduce: bool = True,
    search: str = "auto",
) -> SolveResult:
    """The cheapest option per choice under the memory budget (bytes per device).

    ``search``: ``"exact"`` solves one integer program over every option (proven optimal);
    ``"axes"`` searches by mesh axes (see ``_axis_search``: each step exact, the result not
    proven optimal) when the choices carry per-axis ``axes`` codes on 3 or more axes;
    ``"auto"``: ``"axes"`` when the exact program would have more than ``_EXACT_PAIRS`` pair
    variables after the exact reductions, else ``"exact"``. ``time_limit`` (seconds): the call
    returns within it plus the larger of 1 s and 2% of it, with the best plan found (HiGHS
    through highspy, cut at the deadline; scipy's HiGHS keeps only its own time limit), or
    raises ``NoPlanFoundError`` when none was found by then.
    """
    if milp_solver not in _BACKENDS:
        raise ValueError(f"milp_solver must be one of {sorted(_BACKENDS)}, got {milp_solver!r}")
    if search not in _SEARCHES:
        raise ValueError(f"search must be one of {list(_SEARCHES)}, got {search!r}")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0):
        raise ValueError(f"time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
    start = time.perf_counter()
    # Every program is cut at ``deadline``; the rest of the time limit is kept for a cancelled
    # run to stop and for expanding and costing the plan.
    deadline = math.inf
    if time_limit is not None:
        reserve = min(0.2 * time_limit, CANCEL_GRACE + 0.1 + 1e-5 * (len(problem.choices) + len(problem.factors)))
        deadline = start + float(time_limit) - reserve
    if time_limit is not None and _highspy_available():
        start_workers(os.cpu_count() or 1)  # (HiGHS's runs end at the deadline in worker processes)
    reducer = _Reducer(problem, keep_memory=memory_budget is not None)
    if memory_budget is not None:
        if reducer.peak_sets is not None:
            least = np.array([float(np.min(term.usage)) for term in problem.memory_terms])
            smallest = max(float(least[live_set].sum()) for live_set in reducer.peak_sets)
        else:
            smallest = sum(float(np.min(m)) for m in reducer.memory if len(m))
        if smallest > memory_budget:
            raise InfeasiblePlacementError(
                f"memory_budget={memory_budget:.6g} bytes per device is below the smallest footprint any "
                f"placement allows ({smallest:.6g} bytes at its peak: every parameter, gradient, optimizer state "
                "and live value sharded as far as its strategies go)"
            )
    reducer.reduce(eliminate=reduce, deadline=deadline)
    per_axis = [c.axes for c in problem.choices if c.axes is not None]
    by_axes = search != "exact" and bool(per_axis) and max(a.shape[1] for a in per_axis) >= 3
    exact_pairs = reducer.pair_count() if by_axes else None
    if by_axes and search == "auto":
        by_axes = exact_pairs > _EXACT_PAIRS
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    searched = _axis_search(problem, reducer, memory_budget, milp_solver, deadline) if by_axes else None
    if searched is not None:
        options, stats = searched
        # The size of the exact program the search stands for: what grows with the problem
        # (its neighbourhoods' programs follow the plan).
        stats.update(search="axes", exact_pair_variables=exact_pairs)
    else:
        # Under a time limit HiGHS may find no plan of its own in time (or the program may not
        # be built by then): it starts from the cheapest options improved one choice at a time
        # (memory not looked at), which is the plan if nothing better comes and it is valid.
        greedy = _greedy_start(reducer, deadline) if math.isfinite(deadline) else None
        try:
            options, status, variables, constraints, in_ilp = _solve_reduced(reducer, memory_budget, milp_solver, deadline, greedy)
        except NoPlanFoundError:
            plan = None if greedy is None else reducer.expand(greedy)
            if plan is None or not math.isfinite(evaluate(problem, plan)) or (
                memory_budget is not None and memory_of(problem, plan) > memory_budget
            ):
                raise
            options, status, variables, constraints, in_ilp = greedy, "time limit; the greedy plan", 0, 0, 0
        stats = dict(variables=variables, constraints=constraints, choices_in_ilp=in_ilp, status=status, search="exact")
    solve_seconds = time.perf_counter() - start
    chosen = reducer.expand(options)
    stats.update(
        choices=len(problem.choices),
        build_seconds=build_seconds,
        solve_seconds=solve_seconds,
        milp_solver=milp_solver,
    )
    return SolveResult(chosen, evaluate(problem, chosen), stats)


def evaluate(problem: Problem, options: Sequence[int]) -> float:
    """Seconds of ``options`` under ``problem`` (``inf`` if a factor forbids them)."""
    total = problem.constant + sum(float(c.cost[o]) for c, o in zip(problem.choices, options))
    for factor in problem.factors:
        total += float(factor.table[factor.rows[options[factor.a]], factor.cols[options[factor.b]]])
    return total


def memory_of(problem: Problem, options: Sequence[int]) -> float:
    """Bytes per device of ``options``: the peak over time of the live terms' usages, or the
    sum of every choice's memory when the problem has no terms."""
    if problem.memory_terms:
        terms = problem.memory_terms
        return max(sum(float(terms[i].usage[options[terms[i].choice]]) for i in live_set) for live_set in peak_sets(terms))
    return sum(float(c.memory[o]) for c, o in zip(problem.choices, options))
