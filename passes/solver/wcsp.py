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
of its own (``wcsp_worker.py``), which also builds the model (the caller only pickles the
reduced problem's arrays), so that the model's building, the worker's start and toulbar2's
search all end at the deadline: toulbar2's timer counts CPU time, which on a busy machine
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

from passes.solver.deadline import collector_paused
from passes.solver.wcsp_worker import Scale as _Scale

__all__ = ["available", "solve_wcsp", "WcspResult"]

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wcsp_worker.py")
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


def _data(search, upper, hint, seed: int, vns: bool, rows) -> dict:
    """What the worker builds its model from (``wcsp_worker.build_model``): the search's
    reduced problem as plain arrays, quick to pickle (the model's own lists took seconds to
    build and pickle on a 2000-node problem with the machine busy, all before the deadline
    was looked at; in the worker, they count against it)."""
    memory = np.asarray(search.memory, dtype=bool)
    return dict(
        costs=[np.asarray(c, dtype=np.float64) for c in search.cost],
        tables=[(int(i), int(j), np.asarray(m, dtype=np.float64)) for i, j, m in search.edges],
        constant=float(search.reduced.constant),
        rhs=np.asarray(search.rhs, dtype=np.float64),
        memory=memory,
        usages={int(v): np.asarray(search.usage[v], dtype=np.float64) for v in np.flatnonzero(memory).tolist()},
        lo=np.asarray(search.lo),
        hi=np.asarray(search.hi),
        rows=None if rows is None else sorted({int(r) for r in rows}),
        upper=None if upper is None or not math.isfinite(upper) else float(upper),
        hint=None if hint is None else [int(a) for a in hint],
        seed=int(seed) + 1,
        vns=bool(vns),
    )


# Seconds between looks at a ``stop`` event.
_STOP_POLL = 0.05
# A run with less time left than this is not started: its worker could not start and answer
# (importing pytoulbar2 alone takes ~0.2 s).
_LEAST_RUN = 0.2

_SCALE = re.compile(rb"^WCSP-SCALE (\S+) (\S+) (\S+) ([01]) (\d+)")
_SOLUTION = re.compile(rb"^New solution: ([-+0-9.eE]+)")
_GAP = re.compile(rb"^(?:Optimality gap|Initial lower and upper bounds): \[([-+0-9.eE]+), ")
_END = re.compile(rb"^WCSP-END (\w+) (\S+)")


def solve_wcsp(
    search, deadline: float, upper: float | None = None, hint: np.ndarray | None = None, seed: int = 0, vns: bool = False,
    rows=None, first_by: float = math.inf, stop=None,
) -> WcspResult:
    """toulbar2 on the search's reduced problem until ``deadline`` (``inf``: to its end).
    ``upper``: the cost of a plan already found (toulbar2 then reports only better ones);
    ``hint``: a plan its value heuristic starts from; ``vns``: toulbar2's neighbourhood search
    (no proofs) instead of its best-first search; ``first_by``: the run stops there if it has
    reported no solution yet (a problem too large for it hands the time back); ``stop``: a
    ``threading.Event`` that, once set, ends the run as the deadline would (the other engine
    of a portfolio proved the optimum)."""
    with collector_paused(math.isfinite(deadline)):  # (the caller's heap is not the run's time)
        return _solved_by_toulbar2(search, deadline, upper, hint, seed, vns, rows, first_by, stop)


def _solved_by_toulbar2(search, deadline, upper, hint, seed, vns, rows, first_by, stop) -> WcspResult:
    began = time.perf_counter()
    if not available():
        return WcspResult("error", None, -math.inf, 0, 0.0)
    if deadline - time.perf_counter() < _LEAST_RUN:
        return WcspResult("stopped", None, -math.inf, 0, 0.0)
    log = _Log(len(search.nodes), np.array([len(c) for c in search.cost], dtype=np.int64))
    data = _data(search, upper, hint, seed, vns, rows)
    # Writing the input is not cut at the deadline (nor is the caller's thread while it runs:
    # measured, 0.7 s for 8000 nodes with the machine busy, started 0.6 s before the deadline,
    # the arrays above 0.2 s): not started unless the time left allows it, taken as twice
    # what the arrays took.
    if deadline - time.perf_counter() < _LEAST_RUN + 2.0 * (time.perf_counter() - began):
        return WcspResult("stopped", None, -math.inf, 0, time.perf_counter() - began)
    path = _write_input(data)
    process = None
    try:
        with open(path, "rb") as stdin:
            process = subprocess.Popen([sys.executable, _WORKER, str(os.getpid())], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _follow(process, log, deadline, first_by, stop)
    finally:
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()
        os.unlink(path)
    return log.result(upper, time.perf_counter() - began)


def _write_input(data: dict) -> str:
    """``data`` pickled, behind its length, in a file for the worker's standard input; its path."""
    with tempfile.NamedTemporaryFile(prefix="wcsp-", suffix=".pickle", delete=False) as handle:
        payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        handle.write(struct.pack("<Q", len(payload)) + payload)
        return handle.name


def _follow(process: subprocess.Popen, log: _Log, deadline: float, first_by: float, stop) -> None:
    """Read the worker's log into ``log`` until it ends, the deadline (or ``first_by`` without
    a solution yet) comes, or ``stop`` is set."""
    fd = process.stdout.fileno()
    pending = b""
    while True:
        wait = (deadline if log.solutions else min(deadline, first_by)) - time.perf_counter()
        if wait <= 0:
            return
        if stop is not None:
            wait = min(wait, _STOP_POLL)
        ready, _, _ = select.select([fd], [], [], None if math.isinf(wait) else wait)
        if stop is not None and stop.is_set():
            return
        if not ready:
            if stop is not None:
                continue  # (a look at ``stop``: the deadline is looked at above)
            return
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if log.read(lines):
            return


class _Log:
    """What the worker's log has said so far: the model's scale, the best solution and how many
    were reported, the best lower bound, and how the search ended."""

    def __init__(self, nodes: int, domains: np.ndarray) -> None:
        self.nodes = nodes
        self.domains = domains
        self.scale: _Scale | None = None
        self.best: np.ndarray | None = None
        self.lower = -math.inf
        self.solutions = 0
        self.status = "stopped"
        self._expect_values = False

    def read(self, lines: list[bytes]) -> bool:
        """Take in whole lines of the log; whether the worker said it ended."""
        for line in lines:
            if self.scale is None:
                found = _SCALE.match(line)
                if found:
                    base, factor, slack = (float(found.group(k)) for k in (1, 2, 3))
                    self.scale = _Scale(base, factor, slack, found.group(4) == b"1", int(found.group(5)))
                continue
            if self._expect_values:
                self._expect_values = False
                values = line.split()
                if len(values) == self.nodes:
                    chosen = np.array([int(a) for a in values], dtype=np.int64)
                    if ((chosen >= 0) & (chosen < self.domains)).all():
                        self.best = chosen
                        self.solutions += 1
                continue
            if _SOLUTION.match(line):
                self._expect_values = True
            elif found := _GAP.match(line):
                self.lower = max(self.lower, float(found.group(1)))
            elif found := _END.match(line):
                final = float(found.group(2))
                if found.group(1) == b"complete":
                    self.status = "complete"
                    if math.isfinite(final):
                        self.lower = max(self.lower, final)
                else:
                    self.status = "error"
                return True
        return False

    def result(self, upper: float | None, seconds: float) -> WcspResult:
        """The run's result in the problem's terms (what an exhaustive end proves: see ``WcspResult``)."""
        scale, status = self.scale, self.status
        if scale is None:  # (stopped before the worker had built its model)
            return WcspResult("error" if status == "error" else "stopped", None, -math.inf, 0, seconds)
        if status == "complete":
            if self.best is None and (upper is None or not math.isfinite(upper)):
                # (Rounded costs do not matter here: every plan toulbar2 could see costs less than top.)
                status = "infeasible" if scale.exact else "error"
            elif scale.exact and scale.factor == 1.0:
                status = "optimal"
        # (With usages rounded up, toulbar2's bound is of a smaller problem's: no bound of this one.)
        bounded = scale.exact and math.isfinite(self.lower) and self.lower < scale.top
        problem_lower = scale.to_problem(self.lower) if bounded else -math.inf
        return WcspResult(status, self.best, problem_lower, self.solutions, seconds)
