"""The Dynamo backends ``hops_xla`` (``passes/xla/backend.py``) and ``hops_inductor``
(``passes/backends.py``), found by name as torch.compile users call them."""

from __future__ import annotations

import configparser
import importlib
import pathlib

import pytest
import torch

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.samples_together import assert_close_apart, forward_backward_apart, together, together_inputs

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
FEATURES = ShardingSpec(MESH, (Shard(0), Shard(1)))


def _declared_backends() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    lines = config["options.entry_points"]["torch_dynamo_backends"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


def test_each_backend_lives_where_its_name_says():
    # hops_inductor has nothing to do with XLA; hops_xla belongs to the XLA target, hops_jax to the jax one.
    assert _declared_backends() == {
        "hops_xla": "passes.xla.backend:hops_xla",
        "hops_inductor": "passes.backends:hops_inductor",
        "hops_jax": "passes.jax.backend:hops_jax",
    }
    for name, target in _declared_backends().items():
        module, _, attribute = target.partition(":")
        backend = getattr(importlib.import_module(module), attribute)
        assert backend.__name__ == name
        # torch.compile finds it by name (through the entry point group).
        assert torch._dynamo.lookup_backend(name) is backend


def test_the_backends_earlier_import_path_still_works():
    from passes.backends import hops_inductor
    from passes.xla import dynamo
    from passes.xla.backend import hops_xla, lowered_and_staged

    assert (dynamo.hops_xla, dynamo.hops_inductor, dynamo.lowered_and_staged) == (hops_xla, hops_inductor, lowered_and_staged)


def test_hops_inductor_matches_eager():
    # Every sample in one program (one forward and one backward graph), its values and
    # gradients read sample by sample.
    torch._dynamo.reset()
    inputs = together_inputs(seed=5)
    got = forward_backward_apart(torch.compile(together(), backend="hops_inductor", fullgraph=True), inputs)
    assert_close_apart(got, forward_backward_apart(together(), inputs), atol=1e-5, rtol=1e-4)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(16, 32) / 4)
        self.down = torch.nn.Parameter(torch.randn(32, 16) / 32**0.5)

    def forward(self, x):
        h = hops.annotate_sharding(hops.annotate_sharding(x, ROWS) @ self.up, FEATURES)
        return hops.annotate_sharding(h.relu() @ self.down, ROWS)


@pytest.mark.xla
def test_hops_xla_lowers_the_annotations_and_copies_nothing():
    import torch_xla
    import torch_xla.debug.metrics as metrics

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    expected = model(x)
    device = torch_xla.device()
    xla_model = MLP()
    xla_model.load_state_dict(model.state_dict())
    xla_model = xla_model.to(device)
    xla_x = x.to(device)
    torch_xla.sync()
    compiled = torch.compile(xla_model, backend="hops_xla")
    out = compiled(xla_x)
    assert out.device.type == "xla"
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert hlo.count('custom_call_target="Sharding"') == 3
    torch.testing.assert_close(out.cpu(), expected.detach())

    def transfers():
        return metrics.metric_data("TransferToDeviceTime")[0] if metrics.metric_data("TransferToDeviceTime") else 0

    def compiles():
        return metrics.metric_data("CompileTime")[0] if metrics.metric_data("CompileTime") else 0

    for _ in range(2):  # steady state: the first call's leftovers (saved tensors) executed
        out = compiled(xla_x)
        torch_xla.sync()
    before = (transfers(), compiles())
    parameter_ids = [id(p) for p in xla_model.parameters()]
    for _ in range(3):
        out = compiled(xla_x)
        torch_xla.sync()

    # Inputs and parameters stay where they are (no transfer per call), the program is
    # compiled once (later calls hit torch_xla's cache), and the parameters are the same objects.
    assert (transfers(), compiles()) == before
    assert [id(p) for p in xla_model.parameters()] == parameter_ids
    torch.testing.assert_close(out.cpu(), expected.detach())


def _decaying_step(carry, x):
    return carry * 0.5 + x.sin(), carry * x


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks"])
def test_a_compiled_step_scanned_inside_a_compiled_function_matches_eager(fullgraph):
    # Dynamo 2.9 traced nothing of a torch.compile'd function but its call (its name, as
    # scan reads it, was an "Unsupported hasattr call"); values and gradients as eager's loop.
    compiled_step = torch.compile(_decaying_step, backend="eager")

    def program(init, xs):
        return hops.scan(compiled_step, init, xs)

    def loop(init, xs):
        carry, ys = init, []
        for x in xs:
            carry, y = _decaying_step(carry, x)
            ys.append(y)
        return carry, torch.stack(ys)

    torch._dynamo.reset()
    init, xs = torch.randn(4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    got = torch.compile(program, backend="aot_eager", fullgraph=fullgraph)(init, xs)
    expected = loop(init, xs)
    torch.testing.assert_close(got, expected)
    grads = torch.autograd.grad([got[0].sum() + got[1].sum()], [init, xs])
    torch.testing.assert_close(grads, torch.autograd.grad([expected[0].sum() + expected[1].sum()], [init, xs]))
