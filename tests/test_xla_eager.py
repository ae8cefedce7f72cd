"""HOPs called on XLA tensors outside any tracer, the way torch_xla programs run: under
SPMD on 4 CPU devices they shard (and read the real HLO), and their numbers equal eager
PyTorch on CPU."""

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import device, hlo_text, sharding_of

pytestmark = pytest.mark.xla

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


def test_an_annotation_shards_like_mark_sharding_forward_and_backward():
    import torch_xla.distributed.spmd as xs

    x = torch.randn(8, 4)
    spec = ShardingSpec(MESH, (Shard(0), Replicate()), (Replicate(), Shard(1)))
    on_xla = x.to(device()).requires_grad_()
    y = hops.annotate_sharding(on_xla * 2, spec)
    reference = (x.to(device()) * 2)
    xs.mark_sharding(reference, MESH.to_xla(), ("data", None))
    assert 'custom_call_target="Sharding"' in hlo_text(y)
    assert sharding_of(y) == sharding_of(reference)
    torch.testing.assert_close(y.cpu(), x * 2)
    (grad,) = torch.autograd.grad(y.sum(), on_xla)
    # The gradient carries the gradient layout: columns over "model".
    assert "Sharding" in hlo_text(grad) and "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}" in hlo_text(grad)
    torch.testing.assert_close(grad.cpu(), torch.full((8, 4), 2.0))


def test_a_local_map_with_two_chunks_of_one_tensor_is_a_manual_region_with_the_simulations_numbers():
    x = torch.randn(8, 4)
    f = hops.local_map(lambda t: t * 2 + t.sum(), mesh=MESH, in_placements=((Shard(0), Shard(1)),), out_placements=(Shard(0), Shard(1)))
    expected = f(x)  # CPU: the SPMD simulation
    on_xla = x.to(device()).requires_grad_()
    out = f(on_xla)
    hlo = hlo_text(out)
    assert "SPMDFullToShardShape" in hlo and "SPMDShardToFullShape" in hlo
    torch.testing.assert_close(out.cpu(), expected)
    (grad,) = torch.autograd.grad(out.sum(), on_xla)
    cpu_x = x.clone().requires_grad_()
    (expected_grad,) = torch.autograd.grad(f(cpu_x).sum(), cpu_x)
    torch.testing.assert_close(grad.cpu(), expected_grad)


def test_an_einsum_step_scan_equals_the_loop():
    def step(c, w):
        return c, torch.einsum("bnsk,bnkh->bnsh", c, w)

    c0, ws = torch.randn(2, 2, 4, 4), torch.randn(3, 2, 2, 4, 4)
    _, ys = hops.scan(step, c0.to(device()), ws.to(device()))
    expected = torch.stack([torch.einsum("bnsk,bnkh->bnsh", c0, w) for w in ws])
    torch.testing.assert_close(ys.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_outputs_of_scans_and_annotations_feed_later_scans():
    def step(c, x):
        return c + x, c * 2

    xs = torch.randn(3, 4)
    c1, ys1 = hops.scan(step, torch.zeros(4, device=device()), xs.to(device()))
    c2, _ = hops.scan(step, c1, ys1)
    expected_c1, expected_ys1 = hops.scan(step, torch.zeros(4), xs)
    torch.testing.assert_close(c2.cpu(), hops.scan(step, expected_c1, expected_ys1)[0])
    annotated = hops.annotate_sharding(torch.randn(8, 4).to(device()), ROWS)
    c3, _ = hops.scan(step, annotated[0], annotated)
    torch.testing.assert_close(c3.cpu(), hops.scan(step, annotated.cpu()[0], annotated.cpu())[0])


def test_make_fx_in_real_mode_over_xla_tensors_is_refused_not_baked():
    def step(c, x):
        return c + x, c * 2

    with pytest.raises(RuntimeError, match="make_fx in real mode does not track XLA tensors"):
        make_fx(lambda c, x: hops.scan(step, c, x))(torch.zeros(4, device=device()), torch.ones(3, 4, device=device()))


def test_mark_sharding_with_gradients_inside_a_scan_body():
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(4), (4,), ("x",))

    def step(c, x):
        c = xs.mark_sharding_with_gradients(c + x, mesh, ("x",))
        return c, c.sum()

    xs_cpu = torch.randn(3, 8)
    init = torch.zeros(8, device=device(), requires_grad=True)
    last, ys = hops.scan(step, init, xs_cpu.to(device()))
    torch.testing.assert_close(last.cpu(), xs_cpu.sum(0))
    torch.testing.assert_close(ys.cpu(), torch.stack([xs_cpu[:i].sum() for i in range(1, 4)]))
    (grad,) = torch.autograd.grad(last.sum() + ys.sum(), init)
    torch.testing.assert_close(grad.cpu(), torch.full((8,), 4.0))


def _causal_bias_from_ones(s):
    # SDPA's math path on XLA: a boolean lower triangle of ones, made into a float bias.
    n = s.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    return torch.where(keep, torch.scalar_tensor(0.0, device=s.device), torch.scalar_tensor(float("-inf"), device=s.device))


def _causal_bias_from_arange(s):
    n = s.shape[-1]
    rows = torch.arange(n, device=s.device)
    return torch.full((n, n), float("-inf"), device=s.device).masked_fill(rows[:, None] >= rows[None, :], 0.0)


def _attention_with(bias):
    def attention(q, k, v):
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        return torch.softmax(scores + bias(scores), -1) @ v

    return attention


def _sdpa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "attention",
    [_attention_with(_causal_bias_from_ones), _attention_with(_causal_bias_from_arange), _sdpa_causal],
    ids=["ones_tril_where", "arange_full", "sdpa_is_causal"],
)
def test_a_scan_step_whose_region_makes_tensors_trains_like_the_loop(attention):
    """A scan step holding a ``local_map`` region whose body makes tensors (a causal mask, as
    SDPA's math path does on XLA), the step writing in place (its joint has writes, so it is
    traced again through functionalization): run eagerly on XLA tensors, the loss and the
    gradients of the carry and the stacked weights equal the Python loop on CPU. The region's
    body, traced under that functionalization, once made its tensors for real on XLA."""
    heads = ((Shard(0), Shard(1)),)  # [batch, heads, seq, dim]: batch over "data", heads over "model"
    region = hops.local_map(attention, mesh=MESH, in_placements=heads * 3, out_placements=heads)

    def step(h, w):
        q = h @ w
        q = q.clone()
        q[:, :, 0] = q[:, :, 0] * 2
        return h + region(q, h, q), q.sum()

    def loop(h, ws):
        ys = []
        for w in ws:
            h, y = step(h, w)
            ys.append(y)
        return h, torch.stack(ys)

    torch.manual_seed(0)
    h0, ws = torch.randn(2, 2, 8, 4), torch.randn(3, 4, 4) * 0.3

    def loss_and_grads(run, where):
        h, w = h0.to(where).requires_grad_(), ws.to(where).requires_grad_()
        last, ys = run(h, w)
        loss = last.square().sum() + ys.sum()
        return [t.cpu() for t in (loss, *torch.autograd.grad(loss, (h, w)))]

    expected = loss_and_grads(loop, "cpu")
    got = loss_and_grads(lambda h, w: hops.scan(step, h, w), device())
    for name, a, b in zip(("loss", "grad h", "grad ws"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


_HEADS = ((Shard(0), Shard(1)),)
HOPS_RUN_EAGERLY = {
    "scan": lambda x, w: hops.scan(lambda c, r: (torch.tanh(c @ r), c.sum()), x, w)[0],
    "local_map": lambda x, w: hops.local_map(lambda t: t * 2 + t.sum(), mesh=MESH, in_placements=_HEADS, out_placements=_HEADS)(x @ w[0]),
    "annotate_sharding": lambda x, w: hops.annotate_sharding(x @ w[0], ROWS),
}


@pytest.mark.parametrize("hop", HOPS_RUN_EAGERLY)
def test_outputs_of_hops_run_eagerly_on_xla_feed_a_compiled_function(hop):
    """A HOP's results on XLA tensors outside any tracer are XLA tensors like torch_xla's own
    (no functorch level), so a compiled function takes them: on torch 2.9 a compiled model
    graph-breaks at a scan, which runs eagerly, and the graph after the break is handed its
    results (Dynamo once refused them while fakeifying). The loss and the weights' gradient
    equal CPU's."""
    x, w = torch.randn(8, 4), torch.randn(3, 4, 4) * 0.5

    def loss_and_grad(where, compile):
        weights = w.to(where).requires_grad_()
        out = HOPS_RUN_EAGERLY[hop](x.to(where), weights)
        assert not torch._C._functorch.is_functorch_wrapped_tensor(out)

        def tail(t):
            return (t.sin() * 3).sum()

        loss = (torch.compile(tail, backend="hops_xla", fullgraph=True) if compile else tail)(out)
        return [t.cpu() for t in (loss, *torch.autograd.grad(loss, weights))]

    torch._dynamo.reset()
    for got, expected in zip(loss_and_grad(device(), True), loss_and_grad("cpu", False)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
