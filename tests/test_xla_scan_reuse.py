"""hops.scan called eagerly on XLA tensors reuses the trace of an earlier call whose step has
the same code and Python state, and traces again whenever anything the step reads changed."""

import contextlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import device

pytestmark = pytest.mark.xla

ROWS = ShardingSpec(Mesh((2, 2), ("data", "model")), (Shard(0), Replicate()))
OFFSET = 0.5


@contextlib.contextmanager
def counting_runs(code):
    """How many times Python runs ``code`` (a step's code object) inside the block."""
    runs = [0]
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            runs[0] += 1

    sys.setprofile(profile)
    try:
        yield runs
    finally:
        sys.setprofile(previous)


def make_step(scale, spec=ROWS):
    """A new step function object per call, closing over ``scale`` and ``spec``."""

    def step(h, x, w):
        h = hops.annotate_sharding(torch.tanh(h @ w * scale + x + OFFSET), spec)
        return h, h.sum(-1)

    return step


STEP_CODE = make_step(1.0).__code__


def reference(step, h, xs, w):
    """The Python loop on CPU: (loss, gradients of h, xs, w)."""
    h, xs, w = (t.detach().requires_grad_() for t in (h, xs, w))
    carry, ys = h, []
    for x in xs:
        carry, y = step(carry, x, w)
        ys.append(y)
    loss = carry.sum() + torch.stack(ys).square().sum()
    return loss.detach(), torch.autograd.grad(loss, (h, xs, w))


def on_xla(step, h, xs, w, requires_grad=True):
    """hops.scan on XLA tensors: (loss, gradients) on the CPU, or (loss, None) without grad."""
    args = [t.detach().to(device()).requires_grad_(requires_grad) for t in (h, xs, w)]
    last, ys = hops.scan(step, args[0], args[1], additional_inputs=(args[2],))
    loss = last.sum() + ys.square().sum()
    if not requires_grad:
        return loss.cpu(), None
    grads = torch.autograd.grad(loss, args)
    return loss.detach().cpu(), [g.cpu() for g in grads]


def inputs(length=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g), torch.randn(length, 4, 8, generator=g), torch.randn(8, 8, generator=g) * 0.3


def check(got, expected):
    (loss, grads), (expected_loss, expected_grads) = got, expected
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-4)
    if grads is not None:
        for grad, want in zip(grads, expected_grads):
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-4)


def test_a_new_step_object_with_the_same_code_and_state_is_not_traced_again():
    h, xs, w = inputs(seed=1)  # shapes no other test uses: the first call traces
    xs = torch.cat([xs, xs[:1]])
    runs = []
    for _ in range(3):
        step = make_step(2.0)  # a new function object each time, as in a training step
        with counting_runs(STEP_CODE) as count:
            result = on_xla(step, h, xs, w)
        runs.append(count[0])
        check(result, reference(step, h, xs, w))
    assert runs[0] > 0 and runs[1:] == [0, 0], runs


def test_a_changed_closure_global_or_spec_traces_again_and_gives_the_new_values():
    global OFFSET
    h, xs, w = inputs(length=7)

    def runs_of(step):
        with counting_runs(STEP_CODE) as count:
            result = on_xla(step, h, xs, w)
        check(result, reference(step, h, xs, w))
        return count[0]

    runs_of(make_step(2.0))
    assert runs_of(make_step(2.0)) == 0
    assert runs_of(make_step(3.0)) > 0  # a closure value
    OFFSET = 1.5
    try:
        assert runs_of(make_step(3.0)) > 0  # a global the step reads
    finally:
        OFFSET = 0.5
    columns = ShardingSpec(Mesh((2, 2), ("data", "model")), (Replicate(), Shard(0)))
    assert runs_of(make_step(3.0, columns)) > 0  # a spec value


def test_a_closed_over_tensor_is_an_input_of_every_call():
    """A cached trace reads the closed-over tensor as an input: a value changed in place is
    seen (no re-trace needed), a new tensor object traces again, and its gradient arrives."""
    h, xs, _ = inputs(length=4)
    w = (torch.randn(8, 8) * 0.3).to(device()).requires_grad_()

    def closing(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    def run():
        on = [t.to(device()) for t in (h, xs)]
        last, ys = hops.scan(closing, on[0], on[1])
        loss = last.sum() + ys.square().sum()
        (grad,) = torch.autograd.grad(loss, (w,))
        cpu_w = w.detach().cpu().requires_grad_()
        carry, expected_ys = h, []
        for x in xs:
            carry = torch.tanh(carry @ cpu_w + x)
            expected_ys.append(carry.sum(-1))
        expected = carry.sum() + torch.stack(expected_ys).square().sum()
        torch.testing.assert_close(loss.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad.cpu(), torch.autograd.grad(expected, (cpu_w,))[0], rtol=1e-4, atol=1e-4)

    with counting_runs(closing.__code__) as first:
        run()
    with torch.no_grad():
        w.mul_(-1.5)
    with counting_runs(closing.__code__) as second:
        run()
    assert first[0] > 0 and second[0] == 0
    w = (torch.randn(8, 8) * 0.3).to(device()).requires_grad_()  # closing reads the new object
    with counting_runs(closing.__code__) as third:
        run()
    assert third[0] > 0


def test_state_without_a_key_and_is_fn_pure_false_are_traced_on_every_call():
    from functorch.compile import default_partition

    h, xs, w = inputs(length=3)

    class Config:
        scale = 2.0

    config = Config()

    def reads_an_attribute(c, x, w):
        c = torch.tanh(c @ w * config.scale + x)
        return c, c.sum(-1)

    for scale in (2.0, 2.0, -1.0):
        config.scale = scale
        with counting_runs(reads_an_attribute.__code__) as count:
            check(on_xla(reads_an_attribute, h, xs, w), reference(reads_an_attribute, h, xs, w))
        assert count[0] > 0

    # torch_xla's positional order: scan(fn, init, xs, partition_fn, is_fn_pure).
    step = make_step(2.0)
    stacked = torch.stack([w] * 3)

    def pairs(c, xw):
        return step(c, xw[0], xw[1])

    for _ in range(2):
        with counting_runs(STEP_CODE) as count:
            last, ys = hops.scan(pairs, h.to(device()), (xs.to(device()), stacked.to(device())), default_partition, False)
        assert count[0] > 0
        expected = h
        for x in xs:
            expected, _ = step(expected, x, w)
        torch.testing.assert_close(last.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_shapes_requires_grad_and_grad_mode_each_select_their_own_trace():
    h, xs, w = inputs(length=6)
    step = make_step(0.7)
    expected = reference(step, h, xs, w)
    check(on_xla(step, h, xs, w), expected)
    with counting_runs(STEP_CODE) as count:
        check(on_xla(make_step(0.7), h, xs, w, requires_grad=False), expected)
    assert count[0] > 0
    with counting_runs(STEP_CODE) as count:  # the same again: reused
        check(on_xla(make_step(0.7), h, xs, w, requires_grad=False), expected)
    assert count[0] == 0
    with torch.no_grad(), counting_runs(STEP_CODE) as count:
        check(on_xla(make_step(0.7), h, xs, w, requires_grad=False), expected)
    assert count[0] > 0
    longer = torch.cat([xs, xs])
    with counting_runs(STEP_CODE) as count:
        check(on_xla(make_step(0.7), h, longer, w), reference(step, h, longer, w))
    assert count[0] > 0


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from([1.0, -0.5]), st.sampled_from([3, 4]), st.booleans(), st.booleans()), min_size=2, max_size=4))
def test_every_call_in_a_sequence_matches_the_python_loop(calls):
    """Whatever sequence of closure values, lengths, requires_grad and in-place writes to a
    closed-over tensor, each call equals the Python loop: reuse never returns a stale trace."""
    bias = torch.zeros(8).to(device())
    cpu_bias = torch.zeros(8)
    for scale, length, requires_grad, write in calls:
        if write:
            with torch.no_grad():
                bias.add_(0.25)
            cpu_bias += 0.25

        def step(h, x, w, scale=scale):
            h = torch.tanh(h @ w * scale + x + bias)
            return h, h.sum(-1)

        def cpu_step(h, x, w, scale=scale):
            h = torch.tanh(h @ w * scale + x + cpu_bias)
            return h, h.sum(-1)

        h, xs, w = inputs(length=length)
        check(on_xla(step, h, xs, w, requires_grad=requires_grad), reference(cpu_step, h, xs, w))


def dropout_step(c, x):
    y = torch.nn.functional.dropout(x, 0.5, training=True)
    return c + y.sum(), y


@pytest.mark.parametrize("before", ["sync", "a_random_result_read_without_sync"])
def test_a_reused_trace_draws_new_random_numbers_on_each_call(before):
    import torch_xla

    torch_xla.sync()
    if before != "sync":
        # Reading a result with .cpu() runs its graph without a sync: the RNG seed a later
        # staging reads is then not the device's root seed node.
        hops.scan(dropout_step, torch.zeros((), device=device()), torch.ones(6, 64).to(device()))[1].cpu()
    xs = torch.ones(4 if before == "sync" else 5, 64).to(device())  # each case traces its own step
    masks = []
    for _ in range(3):

        def noisy(c, x):
            y = torch.nn.functional.dropout(x, 0.5, training=True)
            return c + y.sum(), y

        with counting_runs(noisy.__code__) as count:
            _, ys = hops.scan(noisy, torch.zeros((), device=device()), xs)
        masks.append((count[0], ys.cpu()))
    assert masks[0][0] > 0 and [runs for runs, _ in masks[1:]] == [0, 0]
    for _, ys in masks:
        assert set(ys.unique().tolist()) <= {0.0, 2.0}
    # Equal masks by chance: 2**-256 per pair of calls.
    assert not torch.equal(masks[0][1], masks[1][1]) and not torch.equal(masks[1][1], masks[2][1])
