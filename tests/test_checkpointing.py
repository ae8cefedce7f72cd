"""Activation checkpointing and saved-tensor hooks around every body HOP, eager and compiled."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hops
from hops import Mesh, Replicate, Shard
from tests.helpers.hop_db import SAMPLES
from tests.helpers.snapshot import TestCase

LINE = Mesh((2,), ("a",))

region = hops.local_map(
    lambda x, w: torch.tanh(x @ w), mesh=LINE, in_placements=((Shard(0),), (Replicate(),)), out_placements=(Shard(0),)
)


def step(c, x):
    return torch.tanh(c + x), c.sum()


scope = hops.named_scope("block")(lambda x: x.sin() * x)


def program(x, w):
    """A region, a scan over its rows, a scope: every body HOP, with dropout in between."""
    y = torch.nn.functional.dropout(region(x, w), 0.3)
    c, ys = hops.scan(step, y[0], y)
    return scope(c).sum() + ys.sum()


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def selective(fn):
    return lambda x, w: checkpoint(
        fn, x, w, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    )


def inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=generator, requires_grad=True), torch.randn(3, 3, generator=generator, requires_grad=True)


def reference_gradients(seed=0):
    x, w = inputs()
    torch.manual_seed(seed)
    program(x, w).backward()
    return x.grad, w.grad


class TestCheckpointing(TestCase):
    def check(self, run):
        expected = reference_gradients()
        x, w = inputs()
        torch.manual_seed(0)  # the checkpoint replays the forward's random draws
        run(x, w).backward()
        self.assertEqual((x.grad, w.grad), expected)
        self.assertEqual(_get_current_dispatch_mode_stack(), [])

    def test_non_reentrant(self):
        self.check(lambda x, w: checkpoint(program, x, w, use_reentrant=False))

    def test_reentrant(self):
        self.check(lambda x, w: checkpoint(program, x, w, use_reentrant=True))

    def test_selective_with_a_policy(self):
        self.check(selective(program))

    def test_compiled(self):
        # Compiled code draws random numbers its own way: a program without dropout.
        def deterministic(x, w):
            y = region(x, w)
            c, ys = hops.scan(step, y[0], y)
            return scope(c).sum() + ys.sum()

        torch._dynamo.reset()
        expected_x, expected_w = inputs()
        deterministic(expected_x, expected_w).backward()
        for run in (
            lambda x, w: checkpoint(deterministic, x, w, use_reentrant=False),
            selective(deterministic),
        ):
            x, w = inputs()
            torch.compile(run, backend="aot_eager", fullgraph=True)(x, w).backward()
            self.assertEqual((x.grad, w.grad), (expected_x.grad, expected_w.grad))


class TestSavedTensorHooks(TestCase):
    def test_hooks_see_only_real_tensors_and_offloading_round_trips(self):
        packed = []

        def offload(t):
            packed.append(type(t))
            return t.device, t.to("cpu", copy=True)

        def restore(saved):
            device, t = saved
            return t.to(device)

        expected = reference_gradients()
        x, w = inputs()
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(offload, restore):
            out = program(x, w)
        out.backward()
        self.assertTrue(packed)
        self.assertEqual(set(packed), {torch.Tensor})
        self.assertEqual((x.grad, w.grad), expected)


# --------------------------------------------------------------------------- every HOP


def _policies(hop):
    """Save the HOP's output and recompute the rest, or recompute everything."""

    def save_the_hop(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is hop else CheckpointPolicy.PREFER_RECOMPUTE

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    return {"save the hop": save_the_hop, "recompute all": recompute_all}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_selective_checkpointing_of_every_hop(sample, compiled):
    # torch's selective activation checkpointing sees each HOP as one op it saves or
    # recomputes; gradients are the reference's either way.
    inputs = sample.inputs(0)
    expected_out = sample.reference(*inputs)
    expected = torch.autograd.grad(sum(o.sum() for o in torch.utils._pytree.tree_leaves(expected_out)), inputs)
    for name, policy in _policies(sample.hop).items():
        torch._dynamo.reset()

        def run(*args, policy=policy):
            context = functools.partial(create_selective_checkpoint_contexts, policy)
            return checkpoint(sample.program, *args, use_reentrant=False, context_fn=context)

        run = torch.compile(run, backend="aot_eager") if compiled else run
        fresh = [t.detach().clone().requires_grad_() for t in inputs]
        out = run(*fresh)
        grads = torch.autograd.grad(sum(o.sum() for o in torch.utils._pytree.tree_leaves(out)), fresh)
        torch.testing.assert_close(out, expected_out, msg=name)
        torch.testing.assert_close(grads, expected, msg=name)
