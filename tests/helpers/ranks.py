"""Run a script on 4 gloo ranks (separate CPU processes) and collect each rank's JSON results.

The tests that run programs on real DTensors (``tests/test_dtensor.py``, ``tests/test_real_models.py``)
spawn their ranks once per module, do the host's share of the work (tracing, solving) while the
ranks start, and read back what each rank wrote to ``OUTDIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# What a rank must not inherit: torch_xla's runtime settings (the ranks are CPU programs).
XLA_ENV = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], outdir: Path, *, world_size: int = 4, timeout: float,
              extra_env: dict[str, str] | None = None, while_running=None) -> list[dict]:
    """Start ``python script OUTDIR *args`` on ``world_size`` gloo ranks, call ``while_running()``
    in this process meanwhile, and wait for the ranks (killed after ``timeout`` seconds).

    Returns one record per rank: ``results`` (its JSON file, ``{}`` if it wrote none), ``code``
    (its exit code) and ``log`` (the end of its output, for failure messages)."""
    env = {k: v for k, v in os.environ.items() if k not in XLA_ENV and not k.startswith("XLA_")}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",  # no out-of-tree device backend (torch_xla) loaded by `import torch`
        **(extra_env or {}),
    )
    workers = []
    for rank in range(world_size):
        log = open(outdir / f"rank{rank}.log", "w")
        command = [sys.executable, script, str(outdir), *args]
        process = subprocess.Popen(command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT)
        workers.append((process, log))
    deadline = time.monotonic() + timeout
    try:
        if while_running is not None:
            while_running()
        for process, _ in workers:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process, log in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    runs = []
    for rank, (process, _) in enumerate(workers):
        path = outdir / f"rank{rank}.json"
        runs.append(
            dict(results=json.loads(path.read_text()) if path.exists() else {}, code=process.returncode,
                 log=(outdir / f"rank{rank}.log").read_text()[-3000:])
        )
    return runs
