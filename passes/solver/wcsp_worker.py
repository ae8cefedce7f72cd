"""One toulbar2 run (a weighted constraint satisfaction problem), in a process the caller can kill.

Run as a script (``python wcsp_worker.py``), this file reads one problem from stdin (8-byte
length, then a pickle: ``wcsp._data``'s dict, the search's reduced problem as arrays), builds
toulbar2's model of it (``build_model``), writes ``WCSP-SCALE BASE FACTOR SLACK EXACT TOP`` (how
the model's costs map back: ``Scale``), solves it with toulbar2 (pytoulbar2), and writes
toulbar2's own log to stdout as it goes: its ``New solution: COST ...`` lines each followed by
the solution's values, its ``Optimality gap: [LOWER, UPPER]`` lines. When the search ends it
writes one last line, ``WCSP-END STATUS LOWER``: ``complete`` (the search is exhaustive: the
last solution is optimal, or with none, no solution beats ``upper``, or with no ``upper``,
costs less than ``top``) or ``error``, and toulbar2's dual bound. Nothing is written after
that. The model is built here, not by the caller, so that building it (seconds for thousands
of nodes on a busy machine) counts against the caller's deadline: the caller kills this
process at its deadline and keeps the last solution read, and it dies with the caller
(``_die_with``). It imports numpy and pytoulbar2 only.

The model: ``domains`` (strategies per variable), ``unary`` (a cost list per variable),
``binary`` (``(i, j, costs)``, costs flattened row-major, ``i``'s strategy the row),
``knapsacks`` (``(variables, values, coefficients, rhs)``: the sum of the chosen values'
coefficients is at most ``rhs``), ``top`` (the cost of a forbidden choice; every solution
costs less), ``upper`` (a cost every solution toulbar2 reports must beat, or None), ``seed``,
``vns`` (toulbar2's decomposition-guided neighbourhood search instead of its hybrid best-first
search) and ``hint`` (a solution toulbar2's value heuristic starts from, or None).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import struct
import sys

import numpy as np

# toulbar2's costs are 64-bit integers read through doubles: sums stay below this.
_COST_RANGE = 1e15
# Costs that are not whole numbers are scaled so that their span is about this.
_SCALED_SPAN = 1e12


@dataclasses.dataclass
class Scale:
    base: float  # the cost every solution pays beside toulbar2's (constant and shifts)
    factor: float  # toulbar2's cost per unit of the problem's
    slack: float  # the most the rounding can have lowered a solution's toulbar2 cost
    exact: bool  # the constraints are the problem's own (no usage rounded)
    top: int  # toulbar2's cost of a forbidden choice

    def to_problem(self, cost: float) -> float:
        return self.base + (cost - self.slack) / self.factor

    def to_wcsp(self, cost: float) -> float:
        return (cost - self.base) * self.factor


def _whole(values: np.ndarray) -> bool:
    return bool(np.all(values == np.round(values)))


def build_model(data: dict) -> tuple[dict, Scale]:
    """toulbar2's model of ``data`` (``wcsp._data``), and how its costs map back."""
    costs, tables = data["costs"], data["tables"]
    base = float(data["constant"])
    shifted_costs, shifted_tables, span = [], [], 0.0
    whole = True
    for c in costs:
        finite = c[np.isfinite(c)]
        shift = float(finite.min()) if len(finite) else 0.0
        base += shift
        shifted_costs.append(c - shift)
        span += float(finite.max() - shift) if len(finite) else 0.0
        whole = whole and _whole(finite - shift)
    for i, j, m in tables:
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
    for i, j, m in shifted_tables:
        if np.isfinite(m).all() and not m.any():
            continue
        binary.append((i, j, scaled(m.reshape(-1))))
    knapsacks, exact = _knapsacks(data)
    upper = data["upper"]
    model = dict(
        domains=[len(c) for c in costs], unary=unary, binary=binary, knapsacks=knapsacks, top=top, seed=data["seed"],
        vns=data["vns"], upper=None if upper is None else float(math.floor((upper - base) * factor + slack)), hint=data["hint"],
    )
    return model, Scale(base, factor, slack, exact, top)


def _knapsacks(data: dict) -> tuple[list, bool]:
    """The memory constraints (``data["rows"]``: those of these indices; None: all) as
    knapsacks (variables, values, coefficients, rhs), and whether they are exact (whole
    usages and limits; else usages rounded up)."""
    rhs, usages = data["rhs"], data["usages"]
    memory = np.flatnonzero(data["memory"])
    if not len(rhs) or not len(memory):
        return [], True
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

    lo, hi = np.asarray(data["lo"])[memory], np.asarray(data["hi"])[memory]
    knapsacks = []
    for k in range(len(rhs)) if data["rows"] is None else data["rows"]:
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


def _post(cfn, model: dict) -> None:
    wcsp = cfn.CFN.wcsp
    for k, size in enumerate(model["domains"]):
        wcsp.makeEnumeratedVariable(f"x{k}", 0, int(size) - 1)
    for k, costs in enumerate(model["unary"]):
        if any(costs):
            wcsp.postUnaryConstraint(k, costs, False)
    for i, j, costs in model["binary"]:
        wcsp.postBinaryConstraint(int(i), int(j), costs, False)
    for variables, values, coefficients, rhs in model["knapsacks"]:
        # sum(coefficient) <= rhs, as toulbar2's knapsack: sum(-coefficient) >= -rhs.
        params = [str(-int(rhs))]
        for vals, coefs in zip(values, coefficients):
            params.append(str(len(vals)))
            for a, c in zip(vals, coefs):
                params.append(f"{int(a)} {-int(c)}")
        wcsp.postKnapsackConstraint([int(v) for v in variables], " ".join(params), kp=True)
    if model.get("upper") is not None:
        cfn.UbInit = model["upper"]
    hint = model.get("hint")
    if hint is not None:
        # The value heuristic starts from this solution (toulbar2's solution-based phase saving).
        cfn.Option.solutionBasedPhaseSaving = True
        for k, a in enumerate(hint):
            wcsp.setBestValue(k, int(a))


def _solve(model: dict) -> None:
    import pytoulbar2

    cfn = pytoulbar2.CFN(model["top"], seed=model.get("seed", 1), vns=-4 if model.get("vns") else None, verbose=0)
    try:
        _post(cfn, model)
    except cfn.Contradiction:
        # Posting the constraints emptied a domain: no solution (a proof if the model is exact).
        print("WCSP-END complete nan", flush=True)
        return
    status = "complete"
    try:
        cfn.Solve(showSolutions=1)
    except Exception:  # noqa: BLE001 (toulbar2 gave up: no proof of anything)
        status = "error"
    try:
        lower = float(cfn.GetDDualBound())
    except Exception:  # noqa: BLE001
        lower = float("nan")
    sys.stdout.flush()
    print(f"WCSP-END {status} {lower!r}", flush=True)


def _read(stream) -> object | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def _die_with(parent: int) -> None:
    """This process killed when ``parent`` (the solver that started it, as ``argv[1]``) dies.
    toulbar2 holds the GIL and writes nothing while it proves, so neither a thread nor a broken
    pipe would notice: a solver killed by a shell or a test runner's timeout left its run
    solving for minutes. (Linux: the kernel's parent-death signal, which the spawning thread's
    exit also sends; that thread waits for this process, so it fires only when the solver dies.)"""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (it died before the signal was asked for)
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _die_with(int(sys.argv[1]))
    data = _read(sys.stdin.buffer)
    if data is not None:
        model, scale = build_model(data)
        print(f"WCSP-SCALE {scale.base!r} {scale.factor!r} {scale.slack!r} {int(scale.exact)} {scale.top}", flush=True)
        _solve(model)
