"""One HiGHS MILP solve, in this process or in a worker process the caller can kill.

``solve_model(model)`` solves a model given as plain arrays (a dict: ``col_cost``,
``col_upper``, ``row_lower``, ``row_upper``, the column-wise matrix ``start`` / ``index`` /
``value``, ``integer`` (bool per column), ``options`` (HiGHS options), ``x0`` (a start, or
None), ``wall_deadline`` (a ``time.time()`` value HiGHS's time limit runs to, or None)) and returns a dict: ``status`` (HiGHS's model status as text, ``"optimal"`` /
``"infeasible"`` named so), ``x`` (the best solution found, or None), ``dual_bound``.

Run as a script (``python highs_worker.py``) this file is a worker: it reads models from
stdin and writes results to stdout (8-byte length, then a pickle), until stdin closes. It
imports numpy and highspy only (not this package, which would import torch).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time

_banner_shown = False
_banner_lock = threading.Lock()


def _new_highs() -> object:
    """A silent ``highspy.Highs``. HiGHS prints its banner to fd 1 when the process makes its
    first one, before any option can be set: in the caller's process (a solve without a
    deadline) that first one is made with fd 1 pointed at the null device (the worker points
    fd 1 at its stderr itself)."""
    global _banner_shown
    import highspy

    with _banner_lock:
        if _banner_shown:
            highs = highspy.Highs()
        else:
            sys.stdout.flush()
            saved = os.dup(1)
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 1)
                highs = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(null)
            _banner_shown = True
    highs.setOptionValue("output_flag", False)
    return highs


def solve_model(model: dict) -> dict:
    import highspy
    import numpy as np

    highs = _new_highs()
    for name, value in model["options"].items():
        highs.setOptionValue(name, value)
    if model.get("wall_deadline") is not None:
        highs.setOptionValue("time_limit", max(1e-3, model["wall_deadline"] - time.time()))
    ncols = len(model["col_cost"])
    lp = highspy.HighsLp()
    lp.num_col_ = ncols
    lp.num_row_ = len(model["row_lower"])
    lp.col_cost_ = np.asarray(model["col_cost"], dtype=np.float64)
    lp.col_lower_ = np.zeros(ncols)
    lp.col_upper_ = np.asarray(model["col_upper"], dtype=np.float64)
    lp.row_lower_ = np.maximum(np.asarray(model["row_lower"], dtype=np.float64), -highspy.kHighsInf)
    lp.row_upper_ = np.minimum(np.asarray(model["row_upper"], dtype=np.float64), highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = model["start"]
    lp.a_matrix_.index_ = model["index"]
    lp.a_matrix_.value_ = model["value"]
    lp.integrality_ = [highspy.HighsVarType.kInteger if k else highspy.HighsVarType.kContinuous for k in model["integer"]]
    highs.passModel(lp)
    if model.get("x0") is not None:
        solution = highspy.HighsSolution()
        solution.col_value = list(model["x0"])
        solution.value_valid = True
        highs.setSolution(solution)
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    if status == highspy.HighsModelStatus.kOptimal:
        name = "optimal"
    elif status == highspy.HighsModelStatus.kInfeasible:
        name = "infeasible"
    else:
        name = highs.modelStatusToString(status)
    x = np.array(highs.getSolution().col_value) if info.primal_solution_status == 2 else None
    return dict(status=name, x=x, dual_bound=float(info.mip_dual_bound))


def _read(stream) -> object | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def _write(stream, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _serve() -> None:
    # Results go to the original stdout; anything else written to fd 1 (HiGHS's banner) to stderr.
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import highspy  # noqa: F401  (imported before the worker says it is ready)

    results.write(b"R")
    results.flush()
    models = sys.stdin.buffer
    while True:
        model = _read(models)
        if model is None:
            return
        _write(results, solve_model(model))


if __name__ == "__main__":
    _serve()
