"""Time limits kept as deadlines: every HiGHS run gets only the time left, and ends there.

HiGHS's own ``time_limit`` is not a bound on its run: measured on generated problems
(``families.contest_like``), a MILP given 0.6 s ran 13 s inside one simplex solve that does
not look at the clock, and contest instance S ran 23 minutes on a 240 s limit; with highspy's
interrupt callback it stops sooner, but not always (a run cancelled at its deadline was still
going 0.25 s later, and a thread still inside HiGHS when the interpreter exits aborts it).
So a run with a deadline is solved in a worker process (``highs_worker.py``, one per
concurrent caller, kept between runs), given the time left as HiGHS's limit, and killed if it
has not answered by the deadline. Without a deadline it runs in this process.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

from passes.solver.highs_worker import solve_model

__all__ = ["solve_model_by", "start_workers", "wait_for_workers", "CANCEL_GRACE", "OutOfTime", "check", "collector_paused"]

# Seconds before the deadline HiGHS's own time limit ends (its answer to that limit is usually
# this prompt): the worker is killed at the deadline itself, so a run ends by it, answer and all.
CANCEL_GRACE = 0.1

# Seconds between looks at a ``stop`` event while a run is waited for.
_STOP_POLL = 0.05

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "highs_worker.py")
_idle: list[subprocess.Popen] = []
_all: set[subprocess.Popen] = set()
_ready: set[subprocess.Popen] = set()  # workers that said they imported HiGHS
_lock = threading.Lock()


class OutOfTime(Exception):
    """A step that must finish before the search can start (the problem's copy for the
    reductions, the memory rows, the search's arrays) reached the deadline: what it built is
    unusable, and ``solve_problem`` answers with the plan it has without them."""


def check(deadline: float) -> None:
    """Raise ``OutOfTime`` if ``deadline`` (a ``time.perf_counter()`` value) has passed."""
    if time.perf_counter() >= deadline:
        raise OutOfTime


_paused_by = 0  # time-limited calls running with the cyclic collector paused
_collector_was_enabled = False


@contextlib.contextmanager
def collector_paused(bounded: bool):
    """Python's cyclic garbage collector paused while a call with a time limit or a deadline
    (``bounded``) runs, and restored (as it was) when the last such call ends; nothing changes
    for an unbounded call. Every call that promises a deadline holds it: ``solve_problem``, the
    FX front's solves, and the engines' runs (``solve_model_by``, ``wcsp.solve_wcsp``), which
    are also called alone.

    A full collection walks every object of the caller's process, not the solver's: in a test
    process holding millions of objects (torch's compiled programs), one took 1.2-1.5 s of a
    0.3 s limit. The solver makes no reference cycles worth collecting in that time (numpy
    arrays and lists); the caller's own garbage is collected after the call, as it would be."""
    global _paused_by, _collector_was_enabled
    if not bounded:
        yield
        return
    with _lock:
        if _paused_by == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _paused_by += 1
    try:
        yield
    finally:
        with _lock:
            _paused_by -= 1
            if _paused_by == 0 and _collector_was_enabled:
                gc.enable()


def _spawn() -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    with _lock:
        _all.add(process)
    return process


def _worker() -> subprocess.Popen:
    with _lock:
        while _idle:
            process = _idle.pop()
            if process.poll() is None:
                return process
            _all.discard(process)
    return _spawn()


def _wait_ready(process: subprocess.Popen, deadline: float) -> bool:
    """Whether ``process`` has imported HiGHS (read its one-byte hello) by ``deadline``."""
    if process in _ready:
        return True
    ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.perf_counter()))
    if not ready or process.stdout.read(1) != b"R":
        return False
    _ready.add(process)
    return True


def wait_for_workers(deadline: float) -> None:
    """Wait (until ``deadline`` at most) for the idle workers to have imported HiGHS, so that
    the runs timed after this do not count their start."""
    with _lock:
        idle = list(_idle)
    for process in idle:
        if not _wait_ready(process, deadline):
            return


def start_workers(count: int) -> None:
    """Have ``count`` idle workers (started now, they import HiGHS while the caller works)."""
    with _lock:
        missing = count - sum(process.poll() is None for process in _idle)
    for _ in range(max(0, missing)):
        process = _spawn()
        with _lock:
            _idle.append(process)


def _kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()
    with _lock:
        _all.discard(process)
        _ready.discard(process)


@atexit.register
def _shutdown() -> None:
    with _lock:
        processes = list(_all)
        _all.clear()
        _idle.clear()
    for process in processes:
        process.kill()
        process.wait()


# Bytes per write to, or read from, a worker's pipe.
_CHUNK = 1 << 16


def _send(process: subprocess.Popen, model: dict, deadline: float) -> bool:
    """``model`` written to the worker as ``highs_worker._read`` reads it, by ``deadline``
    (whether it was). A model is megabytes that the worker reads as it goes: a blocking write
    waits on the worker, which a busy machine (or a stopped worker) makes wait past any
    deadline."""
    data = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    fd = process.stdin.fileno()
    sent = 0
    os.set_blocking(fd, False)
    try:
        while sent < len(view):
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            _, ready, _ = select.select([], [fd], [], left)
            if not ready:
                return False
            try:
                sent += os.write(fd, view[sent : sent + _CHUNK])
            except BlockingIOError:
                continue
    finally:
        os.set_blocking(fd, True)
    return True


def _receive(process: subprocess.Popen, deadline: float) -> dict | None:
    """The worker's answer (``highs_worker._write``'s), read by ``deadline`` (None if not, or if
    the worker closed its end). (Read from the pipe itself: the only byte read through
    ``process.stdout``'s buffer is the worker's hello, and nothing follows it before a model.)"""
    fd = process.stdout.fileno()

    def read(size: int) -> bytes | None:
        parts, got = [], 0
        while got < size:
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, min(_CHUNK, size - got))
            if not chunk:
                return None
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    head = read(8)
    if head is None:
        return None
    body = read(struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)


def solve_model_by(model: dict, deadline: float = math.inf, stop: threading.Event | None = None) -> dict | None:
    """``highs_worker.solve_model(model)`` ended by ``deadline`` (a ``time.perf_counter()``
    value; ``inf``: in this process, no limit): HiGHS gets the time left as its own limit and
    its worker is killed at the deadline (HiGHS's own limit ends ``CANCEL_GRACE`` before it, the
    time to hand its answer back), or as soon as ``stop`` is set (another engine of a portfolio
    proved the optimum: the answer is no longer needed). None if it had no answer."""
    if not math.isfinite(deadline):
        return solve_model(model)
    with collector_paused(True):
        return _solve_model_in_worker(model, deadline, stop)


def _solve_model_in_worker(model: dict, deadline: float, stop: threading.Event | None) -> dict | None:
    left = deadline - time.perf_counter()
    if left <= 0:
        return None
    # The worker sets HiGHS's limit from the wall clock when it has the model (a new worker
    # may still be importing HiGHS), the time to answer kept (but never under half the time left).
    model = dict(model, wall_deadline=time.time() + max(0.5 * left, left - CANCEL_GRACE))
    process = _worker()
    try:
        if not _wait_ready(process, deadline):
            _kill(process)
            return None
        if not _send(process, model, deadline):
            _kill(process)
            return None
        while True:
            wait = max(0.0, deadline - time.perf_counter())
            ready, _, _ = select.select([process.stdout], [], [], wait if stop is None else min(wait, _STOP_POLL))
            if ready:
                break
            if time.perf_counter() >= deadline or (stop is not None and stop.is_set()):
                _kill(process)
                return None
        result = _receive(process, deadline)
    except (OSError, EOFError, ValueError, pickle.UnpicklingError):  # the worker died (or was killed at exit)
        _kill(process)
        return None
    if result is None:
        _kill(process)
        return None
    with _lock:
        _idle.append(process)
    return result
