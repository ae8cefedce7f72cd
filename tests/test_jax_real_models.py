"""Real model code through target ``"jax"``: as ``examples/auto_shard.py`` (and
``tests/test_real_models.py``'s solver test), the layers scanned, the attention a ``local_map``
region, AOTAutograd's forward and backward graphs solved together and the plan applied as
annotations; then lowered to JAX and jitted on 4 virtual CPU devices: the plain model's loss and
gradients, and the StableHLO holds the plan (Shardy constraints, one manual computation, one
while loop). The models' ATen ops (SDPA's CPU kernels and their backward, ``nll_loss``,
``native_layer_norm``, the complex rotary embedding of torchtitan) all have JAX rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="target 'jax' needs jax (the 'jax' extra)")

import passes  # noqa: E402
from passes.jax import lower_to_jax  # noqa: E402
from tests.helpers import real_models as rm  # noqa: E402
from tests.helpers.snapshot import aot_trace  # noqa: E402
from tests.test_real_models import assert_same, build, one_thread, reference, scanned_grads, some  # noqa: E402, F401


@pytest.fixture
def shardy():
    """Shardy's partitioner for the test: torch_xla, where a test of this process used it,
    switched jax to GSPMD for the whole process (its jax_workarounds.py), whose text holds
    GSPMD custom calls instead of the ``sdy`` constraints read below."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", True)
    yield
    jax.config.update("jax_use_shardy_partitioner", previous)


@pytest.mark.parametrize("name", some("hf_gpt2_sdpa", "torchtitan_llama3"))
def test_solver_plan_of_the_scanned_layers_runs_through_the_jax_target(name, shardy):
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    region = rm.region_attention(real)
    model = rm.ScannedDecoder(region)
    names = [n for n, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())

    def loss_fn(ids, targets, *args):
        params = dict(zip(names, args[: len(names)]))
        logits = torch.func.functional_call(model, (params, buffers), (ids, *args[len(names) :]))
        return rm.loss_of(logits, targets)

    leaves = [p.detach().requires_grad_() for _, p in model.named_parameters()]
    inputs = [ids, targets, *leaves, *rm.layer_tensors(region)]
    forward, backward, _ = aot_trace(loss_fn, *inputs)
    solution = passes.solve_placements((forward, backward), rm.MESH, cost_model=passes.CostModel.preset("tpu-v5e"))
    passes.apply_placements((forward, backward), solution)

    forward_jax, backward_jax = jax.jit(lower_to_jax(forward)), jax.jit(lower_to_jax(backward))
    arrays = [t.detach().numpy() for t in inputs]
    loss, *saved = forward_jax(*arrays)
    grads = backward_jax(*saved, np.ones((), np.float32))
    as_torch = [None if g is None else torch.from_numpy(np.array(g)) for g in grads[2 : 2 + len(names)]]
    assert_same(torch.from_numpy(np.array(loss)), scanned_grads(model, dict(zip(names, as_torch))), expected_loss, expected_grads, rtol=1e-4, atol=1e-5)

    text = forward_jax.lower(*arrays).as_text()
    assert text.count("sdy.sharding_constraint") >= 10, "the plan's layouts are constraints of the program"
    assert text.count("sdy.manual_computation(") == 1 and text.count("stablehlo.while") == 1


@pytest.mark.parametrize("name", some("hf_llama_sdpa"))
def test_scanned_layers_compile_with_the_hops_jax_backend(name):
    """``torch.compile(backend="hops_jax")``, the loss inside the compiled function: AOTAutograd's
    forward and backward run as JAX programs with the plain model's loss and gradients; from the
    second step, the backward in the forward's program (``backend._Fused``). HF Llama's SDPA
    passes grouped key/value heads to the CPU kernel as they are."""
    from hops import _compat
    from passes.jax import backend
    from tests.test_real_models import LossOf

    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    scanned = rm.ScannedDecoder(real)
    torch._dynamo.reset()
    compiled = torch.compile(LossOf(scanned), backend="hops_jax", fullgraph=_compat.DYNAMO_SPECULATES_FUNCTIONAL_CALL)  # 2.9: a graph break, numbers checked
    for _ in range(2):
        scanned.zero_grad(set_to_none=True)
        loss = compiled(ids, targets, *rm.layer_tensors(real))
        loss.backward()
        assert_same(loss.detach(), scanned.grads_by_plain_name(), expected_loss, expected_grads, rtol=1e-4, atol=1e-5)
    assert [graph.fused.hits for graph in backend.COMPILED if graph.fused is not None][-1:] == [1]


@pytest.mark.parametrize("name", some("hf_llama_sdpa"))
def test_an_hf_model_compiled_as_users_do_runs_its_backward_fused_from_the_second_step(name):
    """``torch.compile(model, backend="hops_jax")`` and ``model(ids, labels=ids).loss.backward()``:
    the graph returns the loss and the logits; the logits' cotangent is autograd's zeros, so the
    forward's program computes the backward from the second step (``backend._Fused``)."""
    import copy

    from passes.jax import backend

    real = build(name)
    (ids, _), _ = reference(real)
    model, eager = real.model, copy.deepcopy(real.model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hops_jax")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        expected = eager(ids, labels=ids).loss
        expected.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
        for (parameter, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=parameter)
    assert [(graph.fused.hits, graph.fused.count) for graph in backend.COMPILED if graph.fused is not None][-1:] == [(2, 2)]
