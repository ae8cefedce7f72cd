"""What a scan on XLA tensors moves between host and device: nothing, as torch_xla's own
``torch_xla.experimental.scan`` (its tests check ``TransferFromDeviceTime`` on a step that
makes tensors, and ``TransferToDeviceTime`` on a call). Values a step makes on the host
(``torch.tensor(2.0)``, ``torch.ones(())``, a small ``torch.tensor([...])``) are literals of
the staged loop; a call binds device tensors only. Measured with torch_xla's metrics."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import device

pytestmark = pytest.mark.xla

ROWS = ShardingSpec(Mesh((2, 2), ("data", "model")), (Shard(0), Replicate()))


def moved(fn):
    """``fn()`` run and synced, and what it moved: host->device and device->host transfers
    (torch_xla's ``TransferToDeviceTime`` / ``TransferFromDeviceTime`` samples) and the ops
    that fell back to the CPU (``aten::`` counters, ``aten::_local_scalar_dense`` an ``.item()``)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    torch_xla.sync(wait=True)
    met.clear_all()
    out = fn()
    torch_xla.sync(wait=True)

    def samples(name):
        data = met.metric_data(name)
        return data[0] if data else 0

    fallbacks = sorted(name for name in met.counter_names() if name.startswith("aten::"))
    return out, {"to_device": samples("TransferToDeviceTime"), "from_device": samples("TransferFromDeviceTime"), "fallbacks": fallbacks}


NOTHING = {"to_device": 0, "from_device": 0, "fallbacks": []}


def constant_step(h, x, w):
    # Host constants of every kind a traced step holds: a lifted 0-dim constant, a 0-dim
    # factory, a vector copied to the device, an integer one promoted, a Python number.
    scale = torch.tensor(0.5)
    shift = torch.tensor([1.0, -2.0, 3.0, 0.25, 0.0, 1.5, -1.0, 2.0], device=x.device)
    h = torch.tanh(h @ w * scale + x + torch.ones(()) + shift * torch.tensor(2)) * 0.75
    h = hops.annotate_sharding(h, ROWS)
    return h, h.sum(-1)


def python_loop(step, h, xs, w):
    carry, ys = h, []
    for x in xs:
        carry, y = step(carry, x, w)
        ys.append(y)
    return carry, torch.stack(ys)


def inputs(length=5):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(length, 4, 8, generator=g), torch.randn(8, 8, generator=g) * 0.3


def test_a_step_that_makes_constants_moves_no_data_on_any_call():
    h, xs, w = inputs(length=7)  # a length no other test uses: the first call traces and stages
    expected = python_loop(constant_step, h, xs, w)
    args = [t.to(device()) for t in (h, xs, w)]
    for call in range(3):
        (last, ys), what = moved(lambda: hops.scan(constant_step, args[0], args[1], additional_inputs=(args[2],)))
        assert what == NOTHING, (call, what)
        torch.testing.assert_close((last.cpu(), ys.cpu()), expected, rtol=1e-5, atol=1e-5)


def test_forward_and_backward_move_no_data_after_the_first_call():
    h, xs, w = inputs(length=9)
    reference = [t.clone().requires_grad_() for t in (h, xs, w)]
    last, ys = python_loop(constant_step, *reference)
    expected_grads = torch.autograd.grad(last.sum() + ys.square().sum(), reference)
    args = [t.to(device()).requires_grad_() for t in (h, xs, w)]

    def train_step():
        last, ys = hops.scan(constant_step, args[0], args[1], additional_inputs=(args[2],))
        return torch.autograd.grad(last.sum() + ys.square().sum(), args)

    moved(train_step)  # warm-up: traces, stages and compiles forward and backward
    for call in range(2):
        grads, what = moved(train_step)
        assert what == NOTHING, (call, what)
        for grad, want in zip(grads, expected_grads):
            torch.testing.assert_close(grad.cpu(), want, rtol=1e-4, atol=1e-4)


def test_a_constant_too_large_for_a_literal_is_uploaded_once_and_never_read_back():
    from passes.xla.staging import LITERAL_ELEMENTS

    table = torch.linspace(-1, 1, LITERAL_ELEMENTS + 1).tolist()

    def step(c, x):
        c = c + torch.tensor(table, device=x.device) * x
        return c, c.sum()

    c, xs = torch.zeros(LITERAL_ELEMENTS + 1), torch.randn(3, LITERAL_ELEMENTS + 1)
    expected = python_loop(lambda c, x, _: step(c, x), c, xs, None)
    args = [t.to(device()) for t in (c, xs)]
    results = [moved(lambda: hops.scan(step, *args)) for _ in range(3)]
    first, *later = (what for _, what in results)
    assert first == {"to_device": 1, "from_device": 0, "fallbacks": []}, first  # staged as device data
    assert later == [NOTHING, NOTHING], later  # then a loop-invariant operand bound by each call
    for (last, ys), _ in results:
        torch.testing.assert_close((last.cpu(), ys.cpu()), expected, rtol=1e-5, atol=1e-5)


def test_a_step_that_draws_random_numbers_uploads_what_any_random_op_uploads():
    # torch_xla's device RNG uploads its seed once per graph that draws: a scan whose step
    # draws moves exactly what one plain random op does, and reads nothing back.
    import torch_xla

    def noisy(c, x):
        y = torch.nn.functional.dropout(x, 0.5, training=True) * torch.tensor(3.0)
        return c + y.sum(), y

    c, xs = torch.zeros((), device=device()), torch.ones(11, 16, device=device())
    _, baseline = moved(lambda: xs + torch.rand(16, device=torch_xla.device()))
    moved(lambda: hops.scan(noisy, c, xs))
    (last, ys), what = moved(lambda: hops.scan(noisy, c, xs))
    assert what == baseline and what["from_device"] == 0 and what["fallbacks"] == [], (what, baseline)
    ys = ys.cpu()
    assert set(ys.unique().tolist()) <= {0.0, 6.0}
    torch.testing.assert_close(last.cpu(), ys.sum())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool]),
    shape=st.sampled_from([(), (1,), (4,), (2, 4)]),
    seed=st.integers(0, 2**16),
)
def test_any_small_host_constant_is_a_literal_of_the_loop(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=g) * 4).to(dtype).tolist()

    def step(c, x):
        made = torch.tensor(values, dtype=dtype)
        if made.dim():
            made = made.to(x.device)
        c = c * 0.5 + x + made
        return c, (c * made).sum()

    c, xs = torch.randn(2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    expected = python_loop(lambda c, x, _: step(c, x), c, xs, None)
    args = [t.to(device()) for t in (c, xs)]
    for call in range(2):
        (last, ys), what = moved(lambda: hops.scan(step, *args))
        assert what == NOTHING, (call, what)
        torch.testing.assert_close((last.cpu(), ys.cpu()), expected, rtol=1e-5, atol=1e-5)
