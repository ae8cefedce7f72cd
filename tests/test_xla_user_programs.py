"""What torch_xla users meet that the other XLA tests never wrote (issue 32): programs in the
order a user writes them, in a fresh process where the test session's set-up (``conftest.py``
runs one XLA backward first) would hide the problem."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )


@pytest.mark.xla
def test_a_cpu_backward_before_the_first_xla_backward_is_a_typed_error_naming_the_remedy():
    """A user computes the CPU reference first (one CPU backward), then compiles with
    ``backend="hops_xla"``: torch's autograd engine has sized its device queues without the
    XLA device (torch_xla's behaviour under SPMD), and no XLA backward can run in the process.
    The backend says so when it compiles, naming what works, instead of torch's internal
    assert at the user's ``loss.backward()``. (That ``prepare_autograd_for_xla()`` called first
    makes XLA backwards work is what ``conftest.py`` relies on for the whole suite.)"""
    program = """
        import torch, torch_xla
        import torch_xla.runtime as xr
        xr.use_spmd()
        import passes.xla
        w = torch.randn(4, 4, requires_grad=True)
        (w.tanh().sum()).backward()  # the CPU reference
        wx = w.detach().to(torch_xla.device()).requires_grad_()
        try:
            torch.compile(lambda w: w.tanh().sum(), backend="hops_xla")(wx)
        except Exception as error:
            causes = [error]
            while causes[-1] is not None:
                causes.append(causes[-1].__cause__ or getattr(causes[-1], "inner_exception", None))
            typed = [e for e in causes if isinstance(e, passes.xla.XlaAutogradOrderError)]
            print(f"{type(typed[0]).__name__}: {typed[0]}" if typed else f"untyped {type(error).__name__}: {error}")
    """
    done = run_fresh(program)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert last.startswith("XlaAutogradOrderError"), done.stdout + done.stderr[-2000:]
    assert "passes.xla.prepare_autograd_for_xla()" in last, last
