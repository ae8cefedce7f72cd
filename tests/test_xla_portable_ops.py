"""Ops only the tracing host runs (CPU flash attention) get portable forms in ``lower_to_xla``.

A graph traced on CPU records ``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
which torch_xla has no kernel for. Their portable forms are checked against the CPU kernels on
every leg (outputs, logsumexp, layout and gradients, generated shapes and options), and a
lowered training step runs on XLA with the CPU's numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Shard, ShardingSpec
from passes.xla import portable

aten = torch.ops.aten


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 1, 2, 3]),  # query heads per key head (grouped-query attention)
    length=st.integers(1, 6),
    source=st.integers(1, 6),
    dim=st.sampled_from([1, 4, 8]),
    is_causal=st.booleans(),
    mask=st.sampled_from([None, "float", "masking"]),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_portable_flash_attention_equals_the_cpu_kernels(batch, heads, group, length, source, dim, is_causal, mask, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads * group, length, dim, generator=g, dtype=torch.double)
    k, v = (torch.randn(batch, heads, source, dim, generator=g, dtype=torch.double) for _ in range(2))
    attn_mask = None
    if mask == "masking":  # the CPU kernel takes a mask of the query's dtype only
        hidden = torch.rand(length, source, generator=g) > 0.7
        hidden[:, 0] = False  # every row sees something (an empty row is NaN in both)
        attn_mask = torch.zeros(length, source, dtype=torch.double).masked_fill(hidden, float("-inf"))
    elif mask == "float":
        attn_mask = torch.randn(length, source, generator=g, dtype=torch.double)
    if is_causal and (attn_mask is not None or length > source):
        is_causal = False  # the CPU kernel's causal mask is top-left; no row may be empty
    options = dict(attn_mask=attn_mask, scale=scale)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, **options)
    got_out, got_lse = portable.flash_attention(q, k, v, 0.0, is_causal, **options)
    torch.testing.assert_close(got_out, out)
    torch.testing.assert_close(got_lse, lse)
    assert got_out.stride() == out.stride(), (got_out.stride(), out.stride())  # the kernel's layout
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.double)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, is_causal, **options)
    got = portable.flash_attention_backward(grad_out, q, k, v, out, lse, 0.0, is_causal, **options)
    for name, a, b in zip(("query", "key", "value"), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"grad of {name}: {m}")


def attention_step(q, k, v, w):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out.transpose(1, 2).flatten(2) @ w).square().sum()


def traced_training_step():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    w = torch.randn(16, 8, generator=g)

    def step(q, k, v, w):
        loss = attention_step(q, k, v, w)
        return (loss, *torch.autograd.grad(loss, (q, k, v, w)))

    leaves = [t.requires_grad_() for t in (q, k, v, w)]
    gm = make_fx(step)(*leaves)
    return gm, [t.detach() for t in leaves]


def test_a_traced_step_holds_the_cpu_kernels_and_the_lowering_replaces_them():
    gm, inputs = traced_training_step()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert set(portable.PORTABLE) <= targets, "the traced step no longer records the CPU kernels"
    expected = gm(*inputs)
    passes.lower_to_xla(gm)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not set(portable.PORTABLE) & targets
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_is_refused_naming_the_op():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(NotImplementedError, match=r"lower_to_xla: CPU flash attention with dropout_p > 0"):
        portable.flash_attention(q, q, q, 0.1)


@pytest.mark.xla
def test_a_step_traced_on_cpu_runs_on_xla_with_the_cpus_numbers():
    import torch_xla

    mesh = Mesh((2, 2), ("data", "model"))

    def step(q, k, v, w):
        q = hops.annotate_sharding(q, ShardingSpec(mesh, (Shard(0), Shard(1))))
        loss = attention_step(q, k, v, w)
        return (loss, *torch.autograd.grad(loss, (q, k, v, w)))

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 2, 4, 8, generator=g) for _ in range(3)] + [torch.randn(16, 8, generator=g)]
    gm = make_fx(step)(*[t.clone().requires_grad_() for t in inputs])
    expected = gm(*[t.clone().requires_grad_() for t in inputs])
    passes.lower_to_xla(gm)
    device = torch_xla.device()
    got = gm(*[t.to(device) for t in inputs])
    torch_xla.sync()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b.detach(), rtol=1e-4, atol=1e-5)


REDUCTIONS = {  # each reduction of portable.REDUCE_EVERY_DIM_WHEN_EMPTY, called with dim=[]
    aten.sum.dim_IntList: lambda x, keep: aten.sum.dim_IntList(x, [], keep),
    aten.mean.dim: lambda x, keep: aten.mean.dim(x, [], keep),
    aten.amax.default: lambda x, keep: aten.amax.default(x, [], keep),
    aten.amin.default: lambda x, keep: aten.amin.default(x, [], keep),
    aten.var.correction: lambda x, keep: aten.var.correction(x, [], correction=1, keepdim=keep),
    aten.std.correction: lambda x, keep: aten.std.correction(x, dim=[], correction=0, keepdim=keep),
    aten.var_mean.correction: lambda x, keep: aten.var_mean.correction(x, [], correction=1, keepdim=keep)[1],
    aten.std_mean.correction: lambda x, keep: aten.std_mean.correction(x, [], keepdim=keep)[0],
    aten.linalg_vector_norm.default: lambda x, keep: aten.linalg_vector_norm.default(x, 2, [], keep),
}


def test_every_listed_reduction_is_checked():
    assert set(REDUCTIONS) == set(portable.REDUCE_EVERY_DIM_WHEN_EMPTY)


def test_a_reduction_over_an_empty_dim_list_keeps_torchs_meaning_and_others_are_untouched():
    # Only nodes given dim=[] are rewritten; their results are torch's on any device.
    def program(x):
        kept = aten.sum.dim_IntList(x, [1])  # a real dim list: left as it is
        return tuple(reduce(x, False) for reduce in REDUCTIONS.values()) + (kept, aten.amax.default(x, [0]))

    x = torch.randn(3, 5)
    gm = make_fx(program)(x)
    expected = program(x)
    passes.lower_to_xla(gm)
    rewritten = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.endswith("_every_dim")]
    assert len(rewritten) == len(REDUCTIONS), rewritten
    assert [str(n.target) for n in gm.graph.nodes if str(n.target) in ("aten.sum.dim_IntList", "aten.amax.default")] == ["aten.sum.dim_IntList", "aten.amax.default"]
    for got, want in zip(gm(x), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.xla
@pytest.mark.parametrize("keepdim", [False, True])
def test_a_reduction_over_an_empty_dim_list_reduces_every_dim_on_xla(keepdim):
    # torch_xla reads dim=[] as "no dim" (a loss of shape [32] from an exported model's
    # decomposed cross entropy); the lowered graph gives torch's shapes and values.
    import torch_xla

    def program(x):
        inner = hops.scan(lambda c, row: (c + aten.sum.dim_IntList(row, []), None), torch.zeros(()), x)[0]
        return tuple(reduce(x, keepdim) for reduce in REDUCTIONS.values()) + (inner,)

    x = torch.randn(3, 5)
    gm = make_fx(program)(x)
    expected = program(x)
    passes.lower_to_xla(gm)
    got = gm(x.to(torch_xla.device()))
    torch_xla.sync()
    for name, a, b in zip([*map(str, REDUCTIONS), "sum in a scan body"], got, expected):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
