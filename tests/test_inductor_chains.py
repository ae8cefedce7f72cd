"""Chains of scans compiled by inductor: gradients equal the Python loop's.

Generated programs: 1 to 3 scans in a row (each scan's ys are the next one's xs), over dim 0
or 1, forwards or reversed, each step closing over its own parameters (two to four, of the
same or of different shapes), compiled with ``torch.compile`` (inductor, fullgraph). The
forward value and every parameter's gradient equal the same steps run as a Python loop,
and the backward leaves the parameters' values as they were.

Inductor lowers a scan as a ``while_loop``, whose body is a subgraph with its own inputs.
Torch 2.9 .. 2.14 let such a subgraph of a backward graph take the backward's donated-buffer
indices as its own: an input of the loop body at one of those positions (a closed-over
parameter, read at every step) was overwritten by the body's first step.
"""

from __future__ import annotations

import random

import pytest
import torch

import hops

BATCH, LENGTH, WIDTH = 2, 5, 3

SEEDS = 2  # generated chains (each compiles a forward and a backward: 10-30 s with a cold cache)

# A step's parameters: (name, shape); the step reads those it closes over.
SHAPES = {"gain": (WIDTH,), "shift": (WIDTH,), "decay": (WIDTH,), "mix": (WIDTH, WIDTH)}


def make_step(params):
    """``(state, x) -> (new state, y)``: a leaky tanh cell reading the closed-over ``params``
    that it has (``gain`` always; ``shift``, ``decay``, ``mix`` when present)."""

    def step(state, x):
        inner = x + params["shift"] if "shift" in params else x
        if "mix" in params:
            inner = inner @ params["mix"]
        leak = params["decay"] * state if "decay" in params else 0.5 * state
        new = state + 0.1 * (params["gain"] * torch.tanh(inner) - leak)
        return new, new * 2

    return step


def loop(step, xs, dim, reverse):
    """The scan of ``step`` over ``xs`` along ``dim`` as a Python loop: the stacked ys."""
    state = torch.zeros(BATCH, WIDTH)
    ys = [None] * LENGTH
    for t in reversed(range(LENGTH)) if reverse else range(LENGTH):
        state, ys[t] = step(state, xs.select(dim, t))
    return torch.stack(ys, dim)


def program(cells, xs, use_loop):
    for step, dim, reverse in cells:
        if dim == 0:
            xs = xs.movedim(1, 0)
        if use_loop:
            ys = loop(step, xs, dim, reverse)
        else:
            ys = hops.scan(step, torch.zeros(BATCH, WIDTH), xs, dim=dim, reverse=reverse)[1]
        xs = ys.movedim(0, 1) if dim == 0 else ys
    return xs.square().sum()


NAMES = [("gain", "shift", "decay"), ("gain", "shift"), ("gain", "decay", "mix"), ("gain", "shift", "decay", "mix")]


def generated_chain(seed):
    """A chain of 1 to 3 scans (mostly 2 or 3): each one's parameter names, dim, reverse."""
    rng = random.Random(seed)
    length = rng.choice([1, 2, 2, 3, 3])
    return [(rng.choice(NAMES), rng.choice([0, 1]), rng.random() < 0.3) for _ in range(length)]


# The issue's program: two cells of three same-shaped parameters, over dim 1.
ISSUE = [(("gain", "shift", "decay"), 1, False)] * 2
CHAINS = [ISSUE, *(generated_chain(seed) for seed in range(SEEDS))]


def run_chain(cells, seed=0):
    """The chain's (forward, parameter grads) compiled by inductor, the same as a Python
    loop, and the parameters' values before and after the compiled backward."""
    g = torch.Generator().manual_seed(seed)
    params = [{name: torch.randn(SHAPES[name], generator=g).requires_grad_() for name in names} for names, _, _ in cells]
    steps = [(make_step(p), dim, reverse) for p, (_, dim, reverse) in zip(params, cells)]
    flat = [t for p in params for t in p.values()]
    xs = torch.randn(BATCH, LENGTH, WIDTH, generator=g)
    values = [t.detach().clone() for t in flat]

    expected = program(steps, xs, use_loop=True)
    expected_grads = torch.autograd.grad(expected, flat)

    torch._dynamo.reset()
    compiled = torch.compile(lambda xs: program(steps, xs, use_loop=False), backend="inductor", fullgraph=True)
    got = compiled(xs)
    got_grads = torch.autograd.grad(got, flat)
    return (got, got_grads), (expected, expected_grads), values, [t.detach() for t in flat]


@pytest.mark.parametrize("case", range(len(CHAINS)), ids=["issue", *(f"generated{seed}" for seed in range(SEEDS))])
def test_chained_scans_compiled_by_inductor_match_the_python_loop(case):
    (got, got_grads), (expected, expected_grads), before, after = run_chain(CHAINS[case], seed=case)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grads, expected_grads, atol=1e-5, rtol=1e-4)
    # The backward wrote into no parameter.
    for value, param in zip(before, after):
        assert torch.equal(param, value)
