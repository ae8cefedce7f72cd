"""The default ``torch.compile`` backend (inductor) on every HOP sample: forward and
backward equal the eager program and the plain-torch reference, and inductor receives only
what it lowers (no HOP node; a kernel as its opaque ``hops_kernels`` op). See
``hops/_inductor.py``."""

from __future__ import annotations

import pytest
import torch
from hop_db import SAMPLES, forward_backward, fresh

import hops
from hops import Mesh, Replicate, Shard


def inductor_graphs():
    """A backend that is inductor, keeping the graphs inductor compiles (after AOTAutograd
    and the decompositions)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graphs = []

    def inner(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend, graphs


def targets(graphs):
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_default_backend_matches_eager_forward_and_backward(sample):
    torch._dynamo.reset()
    inputs = sample.inputs(seed=3)
    compiled = torch.compile(sample.program, fullgraph=True)
    got, got_grads = forward_backward(compiled, fresh(inputs))
    eager, eager_grads = forward_backward(sample.program, fresh(inputs))
    reference, reference_grads = forward_backward(sample.reference, fresh(inputs))
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grads, eager_grads, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grads, reference_grads, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_inductor_receives_no_hop(sample):
    torch._dynamo.reset()
    backend, graphs = inductor_graphs()
    compiled = torch.compile(sample.program, backend=backend, fullgraph=True)
    forward_backward(compiled, fresh(sample.inputs()))
    assert len(graphs) == 2  # forward and backward
    received = targets(graphs)
    assert not [t for t in received if "hops_" in t and "hops_kernels" not in t], received
    if sample.hop is hops.einsum or getattr(sample.hop, "kernel_name", "").startswith("einsum"):
        assert not [t for t in received if "hops_kernels" in t], received  # einsum is plain torch
    elif isinstance(sample.hop, hops.Kernel):
        assert f"hops_kernels.{sample.hop.kernel_name}.default" in received, received


def test_other_backends_keep_the_nodes():
    # The decompositions are inductor's alone: aot_eager records the HOP.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    sample = next(s for s in SAMPLES if s.hop is hops.scan_hop)
    compiled = torch.compile(sample.program, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    forward_backward(compiled, fresh(sample.inputs()))
    assert "hops_scan" in targets(graphs)


class Block(torch.nn.Module):
    """A residual MLP block whose layers run through hops.scan over stacked weights, with a
    local_map region and an annotation: what a user hands to torch.compile(model)."""

    def __init__(self, layers=3, width=8):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(layers, width, width) / width**0.5)
        self.mesh = Mesh((2, 2), ("data", "model"))
        self.norm = hops.local_map(
            lambda x: x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(),
            mesh=self.mesh,
            in_placements=((Shard(0), Replicate()),),
            out_placements=((Shard(0), Replicate()),),
        )

    def layer(self, h, w):
        h = h + torch.tanh(hops.einsum("bi,io->bo", self.norm(h), w))
        return hops.annotate_sharding(h, hops.ShardingSpec(self.mesh, (Shard(0), Replicate()))), h.sum()

    def forward(self, x):
        h, sums = hops.scan(self.layer, x, self.weights)
        return h, sums


def test_compiled_model_trains_like_eager():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8)
    compiled = torch.compile(model)
    got = forward_backward(compiled, [x])[0]
    got_grad = model.weights.grad.clone()
    model.weights.grad = None
    expected = forward_backward(model, [x])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grad, model.weights.grad, atol=1e-5, rtol=1e-4)


def test_compiled_step_inside_eager_scan():
    w = torch.randn(3, 3)

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sin()

    torch._dynamo.reset()
    xs = torch.randn(5, 3, requires_grad=True)
    got_c, got_ys = hops.scan(torch.compile(step), torch.ones(3), xs)
    expected_c, expected_ys = torch.ones(3), []
    for x in xs:
        expected_c, y = step(expected_c, x)
        expected_ys.append(y)
    expected_ys = torch.stack(expected_ys)
    torch.testing.assert_close(got_c, expected_c)
    torch.testing.assert_close(got_ys, expected_ys)
    (got_grad,) = torch.autograd.grad(got_ys.sum(), xs)
    (expected_grad,) = torch.autograd.grad(expected_ys.sum(), xs)
    torch.testing.assert_close(got_grad, expected_grad)
