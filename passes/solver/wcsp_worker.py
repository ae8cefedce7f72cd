"""One toulbar2 run (a weighted constraint satisfaction problem), in a process the caller can kill.

Run as a script (``python wcsp_worker.py``), this file reads one model from stdin (8-byte
length, then a pickle: a dict with ``domains`` (strategies per variable), ``unary`` (a cost list
per variable), ``binary`` (``(i, j, costs)``, costs flattened row-major, ``i``'s strategy the
row), ``knapsacks`` (``(variables, values, coefficients, rhs)``: the sum of the chosen values'
coefficients is at most ``rhs``), ``top`` (the cost of a forbidden choice; every solution
costs less), ``upper`` (a cost every solution toulbar2 reports must beat, or None), ``seed``,
``vns`` (toulbar2's decomposition-guided neighbourhood search instead of its hybrid best-first
search) and ``hint`` (a solution toulbar2's value heuristic starts from, or None)), solves it
with toulbar2 (pytoulbar2), and writes toulbar2's own log to stdout as it goes: its
``New solution: COST ...`` lines each followed by the solution's values, its ``Optimality gap:
[LOWER, UPPER]`` lines. When the search ends it writes one last line, ``WCSP-END STATUS
LOWER``: ``complete`` (the search is exhaustive: the last solution is optimal, or with none,
no solution beats ``upper``, or with no ``upper``, costs less than ``top``) or ``error``, and
toulbar2's dual bound. Nothing is written after that. The caller kills this process at its
deadline and keeps the last solution read. It imports numpy and pytoulbar2 only.
"""

from __future__ import annotations

import pickle
import struct
import sys


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


if __name__ == "__main__":
    model = _read(sys.stdin.buffer)
    if model is not None:
        _solve(model)
