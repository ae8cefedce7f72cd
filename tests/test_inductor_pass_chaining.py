"""Importing ``hops`` writes no inductor setting; a user's post-grad pass keeps running.

Inductor lowers this package's HOP nodes in a post-grad custom pass. It is installed when a
program holding a HOP is first traced, wrapping whatever pass the user set, before or after
``import hops``, and again when the user sets another later. Each scenario runs in a fresh
interpreter: the package is imported there for the first time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = """
import torch
from torch._inductor import config

runs = {}

def user_pass(name):
    def run(graph):
        runs[name] = runs.get(name, 0) + 1
    return run

def compile_and_check(hops, fn_name):
    def step(c, w):
        c = c + torch.tanh(c @ w)
        return c, c
    def program(h, ws):
        last, ys = hops.scan(step, h, ws)
        return last.sum() + ys.sum()
    program.__name__ = fn_name
    h = torch.randn(4, 8, requires_grad=True)
    ws = (torch.randn(3, 8, 8) / 8).requires_grad_()
    torch._dynamo.reset()
    loss = torch.compile(program, fullgraph=True)(h, ws)
    grads = torch.autograd.grad(loss, (h, ws))
    expected = program(h, ws)
    expected_grads = torch.autograd.grad(expected, (h, ws))
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
"""


def run(script: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROGRAM) + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_import_leaves_the_post_grad_pass_as_the_user_set_it():
    run(
        """
        before = user_pass("before")
        config.post_grad_custom_pre_pass = before
        import hops
        assert config.post_grad_custom_pre_pass is before, config.post_grad_custom_pre_pass
        compile_and_check(hops, "first")
        assert runs.get("before", 0) >= 2, runs   # forward and backward graphs
        """
    )


def test_import_writes_no_post_grad_pass():
    run(
        """
        import hops
        assert config.post_grad_custom_pre_pass is None, config.post_grad_custom_pre_pass
        """
    )


@pytest.mark.parametrize("when", ["after_import", "after_first_compile"])
def test_user_pass_set_later_runs_and_hops_still_compile(when):
    run(
        f"""
        import hops
        if "{when}" == "after_first_compile":
            compile_and_check(hops, "first")
        config.post_grad_custom_pre_pass = user_pass("later")
        compile_and_check(hops, "second")
        assert runs.get("later", 0) >= 2, runs
        """
    )
