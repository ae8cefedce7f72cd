"""toulbar2 as an engine of the search: the reduced problem as a weighted constraint
satisfaction problem, solved in a worker process killed at the deadline.

toulbar2 (``pytoulbar2`` on the registry) is the engine of the IOPDDL contest's winning team: a
weighted-CSP solver whose soft arc consistency gives lower bounds as it searches. The reduced
problem (``search.Search``) maps onto it directly: a variable per node (its kept strategies),
its costs as a unary cost function, each edge's table as a binary one (a forbidden pair costs
``top``, more than every solution), each memory constraint of the reduced problem (the live
memory nodes' usages above their least, at most what the limit leaves) as a knapsack
constraint. toulbar2's costs are integers: a problem whose finite costs are whole numbers
(the contest's files) is given them as they are (shifted so each function's least is 0); any
other is scaled to about 1e12 over its costs' span and rounded, and the lower bound read back
is lowered by the rounding's largest effect, so it stays a bound of the problem. Usages that
are not whole numbers are scaled and rounded up (the limit down), so every solution toulbar2
finds fits; such a model is not exact, and its "no solution" is no proof.

``solve_wcsp`` runs toulbar2 until ``deadline`` (a ``time.perf_counter()`` value) in a process
of its own (``wcsp_worker.py``): toulbar2's timer counts CPU time, which on a busy machine
runs slower than the wall clock, so the worker gets no limit of its own and is killed at the
deadline; its best solution so far is read from its log as it goes (each ``New solution``
line and the values after it), so killing it loses nothing found. ``available()``: whether
pytoulbar2 is installed (without it the search runs without this engine).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

__all__ = ["available", "solve_wcsp", "WcspResult"]

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wcsp_worker.py")
# toulbar2's costs are 64-bit integers read through doubles: sums stay below this.
_COST_RANGE = 1e15
# Costs that are not whole numbers are scaled so that their span is about this.
_SCALED_SPAN = 1e12
_available: bool | None = None


def available() -> bool:
    """Whether pytoulbar2 can be imported (looked up once, without importing it here)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("pytoulbar2") is not None
    return _available


@dataclasses.dataclass
class WcspResult:
    """``status``: ``"optimal"`` (the search was exhaustive on an exact model: ``chosen`` is
    optimal, or with ``chosen`` None no solution beats the ``upper`` given), ``"complete"``
    (exhaustive, but on rounded costs or usages: optimal only to within the rounding),
    ``"infeasible"`` (exhaustive, no ``upper`` given, exact usages, no solution: a proof),
    ``"stopped"`` (the deadline came first) or ``"error"`` (toulbar2 failed; nothing is
    proven); ``chosen``: the best strategies
    found (one per node of the search), or None; ``lower``: a lower bound on every solution's
    cost (``-inf`` if toulbar2 gave none); ``solutions``: how many improving ones it reported."""

    status: str
    chosen: np.ndarray | None
    lower: float
    solutions: int
    seconds: float


@dataclasses.dataclass
class _Scale:
    base: float  # the cost every solution pays beside toulbar2's (constant and shifts)
    factor: float  # toulbar2's cost per unit of the problem's
    slack: float  # the most the rounding can have lowered a solution's toulbar2 cost
    exact: bool  # the constraints are the problem's own (no usage rounded)

    def to_problem(self, cost: float) -> float:
        return self.base + (cost - self.slack) / self.factor

    def to_wcsp(self, cost: float) -> float:
        return (cost - self.base) * self.factor


def _whole(values: np.ndarray) -> bool:
    return bool(np.all(values == np.round(values)))


class _OutOfTime(Exception):
    pass


def _checked(items, deadline: float):
    """``items``, raising ``_OutOfTime`` once ``deadline`` has passed (looked at every 256)."""
    for k, item in enumerate(items):
        if k % 256 == 0 and time.perf_counter() >= deadline:
            raise _OutOfTime
        yield item


def build_model(
    search, upper: float | None = None, hint: np.ndarray | None = None, seed: int = 0, vns: bool = False, rows=None,
    deadline: float = math.inf,
) -> tuple[dict, _Scale]:
    """The search's reduced problem as the worker's model, and how its costs map back
    (``_OutOfTime`` past ``deadline``: a large model takes seconds to build)."""
    costs = [np.asarray(c, dtype=np.float64) for c in search.cost]
    tables = [(int(i), int(j), np.asarray(m, dtype=np.float64)) for i, j, m in search.edges]
    base = float(search.reduced.constant)
    shifted_costs, shifted_tables, span = [], [], 0.0
    whole = True
    for c in _checked(costs, deadline):
        finite = c[np.isfinite(c)]
        shift = float(finite.min()) if len(finite) else 0.0
        base += shift
        shifted_costs.append(c - shift)
        span += float(finite.max() - shift) if len(finite) else 0.0
        whole = whole and _whole(finite - shift)
    for i, j, m in _checked(tables, deadline):
        finite = m[np.isfinite(m)]
        shift = float(finite.min()) if len(finite) else 0.0
        base += shift
        shifted_tables.append((i, j, m - shift))
        span += float(finite.max() - shift) if len(finite) else 0.0
        whole = whole and _whole(finite - shift)
    terms = len(costs) + len(tables)
    if whole and span < _COST_RANGE:
        factor, slack = 1.0, 0.0
    else:
        factor = _SCALED_SPAN / span if span > 0 else 1.0
        slack = 0.5 * terms
    top = int(math.ceil(span * factor + 0.5 * terms)) + 2

    def scaled(values: np.ndarray) -> list[float]:
        return np.where(np.isfinite(values), np.round(values * factor), float(top)).tolist()

    unary = [scaled(c) for c in shifted_costs]
    binary = []
    for i, j, m in _checked(shifted_tables, deadline):
        if np.isfinite(m).all() and not m.any():
            continue
        binary.append((i, j, scaled(m.reshape(-1))))
    knapsacks, exact = _knapsacks(search, rows, deadline)
    model = dict(
        domains=[len(c) for c in costs], unary=unary, binary=binary, knapsacks=knapsacks, top=top, seed=int(seed) + 1, vns=vns,
        upper=None if upper is None or not math.isfinite(upper) else float(math.floor((upper - base) * factor + slack)),
        hint=None if hint is None else [int(a) for a in hint],
    )
    return model, _Scale(base, factor, slack, exact)


def _knapsacks(search, rows=None, deadline: float = math.inf) -> tuple[list, bool]:
    """The reduced problem's memory constraints (``rows``: those of these indices; None:
    all) as knapsacks (variables, values, coefficients, rhs), and whether they are exact
    (whole usages and limits; else usages rounded up)."""
    rhs = np.asarray(search.rhs, dtype=np.float64)
    memory = np.flatnonzero(search.memory)
    if not len(rhs) or not len(memory):
        return [], True
    usages = {int(v): np.asarray(search.usage[v], dtype=np.float64) for v in memory.tolist()}
    values = np.concatenate([rhs, *usages.values()])
    exact = _whole(values) and float(np.abs(values).max(initial=0.0)) * (len(memory) + 1) < _COST_RANGE
    factor = 1.0 if exact else 1e12 / max(float(np.abs(values).max(initial=0.0)) * (len(memory) + 1), 1e-300)
    terms: dict[int, tuple] = {}  # per memory node: its values of nonzero usage, their usages, the most

    def node_terms(v: int) -> tuple:
        found = terms.get(v)
        if found is None:
            u = usages[v]
            c = u if exact else np.ceil(u * factor - 1e-9)
            used = np.flatnonzero(c > 0)
            found = terms[v] = (used.tolist(), c[used].astype(np.int64).tolist(), float(c.max(initial=0.0)))
        return found

    lo, hi = np.asarray(search.lo)[memory], np.asarray(search.hi)[memory]
    knapsacks = []
    for k in _checked(range(len(rhs)) if rows is None else sorted({int(r) for r in rows}), deadline):
        variables, vals, coefs = [], [], []
        total_max = 0.0
        for v in memory[(lo <= k) & (hi > k)].tolist():
            used, c, most = node_terms(v)
            if not used:
                continue
            variables.append(v)
            vals.append(used)
            coefs.append(c)
            total_max += most
        bound = math.floor(rhs[k] * factor + 1e-9) if not exact else int(rhs[k])
        if variables and total_max > bound:
            knapsacks.append((variables, vals, coefs, int(bound)))
    return knapsacks, exact


_SOLUTION = re.compile(rb"^New solution: ([-+0-9.eE]+)")
_GAP = re.compile(rb"^(?:Optimality gap|Initial lower and upper bounds): \[([-+0-9.eE]+), ")
_END = re.compile(rb"^WCSP-END (\w+) (\S+)")


def solve_wcsp(
    search, deadline: float, upper: float | None = None, hint: np.ndarray | None = None, seed: int = 0, vns: bool = False,
    rows=None, first_by: float = math.inf,
) -> WcspResult:
    """toulbar2 on the search's reduced problem until ``deadline`` (``inf``: to its end).
    ``upper``: the cost of a plan already found (toulbar2 then reports only better ones);
    ``hint``: a plan its value heuristic starts from; ``vns``: toulbar2's neighbourhood search
    (no proofs) instead of its best-first search; ``first_by``: the run stops there if it has
    reported no solution yet (a problem too large for it hands the time back)."""
    began = time.perf_counter()
    if not available():
        return WcspResult("error", None, -math.inf, 0, 0.0)
    try:
        model, scale = build_model(search, upper, hint, seed, vns, rows, deadline)
    except _OutOfTime:
        return WcspResult("stopped", None, -math.inf, 0, time.perf_counter() - began)
    if time.perf_counter() >= deadline:
        return WcspResult("stopped", None, -math.inf, 0, time.perf_counter() - began)
    n = len(model["domains"])
    with tempfile.NamedTemporaryFile(prefix="wcsp-", suffix=".pickle", delete=False) as handle:
        data = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
        handle.write(struct.pack("<Q", len(data)) + data)
        path = handle.name
    best = None
    lower = -math.inf
    solutions = 0
    status = "stopped"
    process = None
    try:
        with open(path, "rb") as stdin:
            process = subprocess.Popen([sys.executable, _WORKER], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        fd = process.stdout.fileno()
        pending = b""
        expect_values = False
        ended = False
        while not ended:
            wait = (deadline if solutions else min(deadline, first_by)) - time.perf_counter()
            if wait <= 0:
                break
            ready, _, _ = select.select([fd], [], [], None if math.isinf(wait) else wait)
            if not ready:
                break
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if expect_values:
                    expect_values = False
                    values = line.split()
                    if len(values) == n:
                        chosen = np.array([int(a) for a in values], dtype=np.int64)
                        if ((chosen >= 0) & (chosen < np.asarray(model["domains"]))).all():
                            best = chosen
                            solutions += 1
                    continue
                if _SOLUTION.match(line):
                    expect_values = True
                elif found := _GAP.match(line):
                    lower = max(lower, float(found.group(1)))
                elif found := _END.match(line):
                    ended = True
                    final = float(found.group(2))
                    if found.group(1) == b"complete":
                        status = "complete"
                        if math.isfinite(final):
                            lower = max(lower, final)
                    else:
                        status = "error"
                    break
    finally:
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()
        os.unlink(path)
    if status == "complete":
        if best is None and model["upper"] is None:
            # (Rounded costs do not matter here: every plan toulbar2 could see costs less than top.)
            status = "infeasible" if scale.exact else "error"
        elif scale.exact and scale.factor == 1.0:
            status = "optimal"
    # (With usages rounded up, toulbar2's bound is of a smaller problem's: no bound of this one.)
    bounded = scale.exact and math.isfinite(lower) and lower < model["top"]
    problem_lower = scale.to_problem(lower) if bounded else -math.inf
    return WcspResult(status, best, problem_lower, solutions, time.perf_counter() - began)
