"""lower_to_xla on real torch_xla: 4 CPU devices under SPMD, reading the HLO it emits."""

import re

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec

pytestmark = pytest.mark.xla

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLS = ShardingSpec(MESH, (Replicate(), Shard(1)))
BOTH = ShardingSpec(MESH, (Shard(1), Shard(0)))


def xla_device():
    import torch_xla

    return torch_xla.device()


def sync():
    """Materialize pending tensors and wait for the execution: reading HLO of tensors built on
    results of a still-running execution intermittently crashes torch_xla 2.9 (SIGSEGV)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def hlo_text(*tensors):
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def sharding_custom_calls(hlo):
    """The ``sharding={...}`` attribute of every ``Sharding`` custom call, in HLO order."""
    return re.findall(r'custom_call_target="Sharding", sharding=(\{[^}]*\})', hlo)


def xs_sharding(spec, like):
    """What torch_xla's own mark_sharding attaches for ``spec`` on a tensor like ``like``."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    t = torch.zeros(like.shape, device=xla_device()) + 1
    xs.mark_sharding(t, spec.mesh.to_xla(), spec.to_partition_spec(t.dim()))
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def two_annotations(x, w):
    h = hops.annotate_sharding(x @ w, ROWS)
    return hops.annotate_sharding(h.relu() * 3, BOTH)


def annotated_input(x, w):
    return hops.annotate_sharding(x, COLS) @ w


def test_forward_emits_one_sharding_call_per_annotation_with_mark_sharding_tiles():
    x, w = torch.randn(8, 4), torch.randn(4, 8)
    gm = passes.lower_to_xla(make_fx(two_annotations)(x, w))
    out = gm(x.to(xla_device()), w.to(xla_device()))
    calls = sharding_custom_calls(hlo_text(out))
    assert calls == [xs_sharding(ROWS, out), xs_sharding(BOTH, out)]
    assert calls[0] != calls[1]
    torch.testing.assert_close(out.cpu(), two_annotations(x, w))


def test_annotation_of_a_graph_input_emits_a_custom_call():
    x, w = torch.randn(8, 4), torch.randn(4, 8)
    gm = passes.lower_to_xla(make_fx(annotated_input)(x, w))
    out = gm(x.to(xla_device()), w.to(xla_device()))
    hlo = hlo_text(out)
    assert sharding_custom_calls(hlo) == [xs_sharding(COLS, x)]
    # The custom call's operand is computed from the parameter, not the parameter resharded on the host.
    assert re.search(r"custom-call\(f32\[8,4\]\{1,0\} %\S+\), custom_call_target=\"Sharding\"", hlo)
    torch.testing.assert_close(out.cpu(), annotated_input(x, w))


def test_aot_forward_and_backward_graphs_lower_and_match_eager():
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    aot_function(two_annotations, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(x, w).sum().backward()
    forward = passes.lower_to_xla(graphs["forward"])
    backward = passes.lower_to_xla(graphs["backward"])

    device = xla_device()
    out, *saved = forward(x.detach().to(device), w.detach().to(device))
    assert sharding_custom_calls(hlo_text(out)) == [xs_sharding(ROWS, out), xs_sharding(BOTH, out)]
    sync()  # materialize the forward so the backward's HLO starts from device data
    grads = backward(*saved, torch.ones(8, 8, device=device))
    backward_calls = sharding_custom_calls(hlo_text(*grads))
    # The gradient of each annotation carries the same spec, in reverse order.
    assert backward_calls == [xs_sharding(BOTH, out), xs_sharding(ROWS, out)]

    reference_x, reference_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    two_annotations(reference_x, reference_w).sum().backward()
    torch.testing.assert_close(out.cpu(), two_annotations(x, w).detach())
    torch.testing.assert_close(grads[0].cpu(), reference_x.grad)
    torch.testing.assert_close(grads[1].cpu(), reference_w.grad)


def test_lowered_op_is_differentiable_on_xla_with_grad_spec():
    def annotated(x):
        return hops.annotate_sharding(x * 2, ROWS, grad_spec=COLS).sin()

    x = torch.randn(8, 8)
    gm = passes.lower_to_xla(make_fx(annotated)(x))
    x_xla = x.to(xla_device()).requires_grad_()
    gm(x_xla).sum().backward()
    # The gradient's HLO holds the forward annotation it depends on (spec), then the
    # gradient's own annotation, which uses grad_spec.
    assert sharding_custom_calls(hlo_text(x_xla.grad)) == [xs_sharding(ROWS, x), xs_sharding(COLS, x)]
    reference = x.clone().requires_grad_()
    annotated(reference).sum().backward()
    torch.testing.assert_close(x_xla.grad.cpu(), reference.grad)


def test_sharding_objects_are_built_once_per_spec():
    from passes import xla_ops

    x = torch.randn(8, 8)
    gm = passes.lower_to_xla(make_fx(two_annotations)(x, x))
    gm(x.to(xla_device()), x.to(xla_device()))
    cached = {key: value for key, value in xla_ops._OP_SHARDINGS.items()}
    gm(x.to(xla_device()), x.to(xla_device()))
    assert (repr(ROWS), 2) in cached and (repr(BOTH), 2) in cached
    assert all(xla_ops._OP_SHARDINGS[key] is value for key, value in cached.items())


def test_lowered_op_refuses_a_spec_that_does_not_fit_the_tensor():
    from passes import xla_ops

    with pytest.raises(ValueError, match="shards dim 1, but the tensor has rank 1"):
        xla_ops.sharding_constraint(torch.randn(8, device=xla_device()), repr(COLS))
    with pytest.raises(ValueError, match="not a spec"):
        xla_ops.sharding_constraint(torch.randn(8, device=xla_device()), "rows please")
