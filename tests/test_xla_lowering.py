"""lower_to_xla on real torch_xla: 4 CPU devices under SPMD, reading the HLO it emits."""

import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import aot_trace, hlo_text

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
    forward, backward, _ = aot_trace(two_annotations, x, w)
    forward, backward = passes.lower_to_xla(forward), passes.lower_to_xla(backward)

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
    from passes.xla import ops as xla_ops

    x = torch.randn(8, 8)
    gm = passes.lower_to_xla(make_fx(two_annotations)(x, x))
    gm(x.to(xla_device()), x.to(xla_device()))
    cached = {key: value for key, value in xla_ops._OP_SHARDINGS.items()}
    gm(x.to(xla_device()), x.to(xla_device()))
    assert (repr(ROWS), 2) in cached and (repr(BOTH), 2) in cached
    assert all(xla_ops._OP_SHARDINGS[key] is value for key, value in cached.items())


def test_lowered_op_refuses_a_spec_that_does_not_fit_the_tensor():
    from passes.xla import ops as xla_ops

    with pytest.raises(ValueError, match="shards dim 1, but the tensor has rank 1"):
        xla_ops.sharding_constraint(torch.randn(8, device=xla_device()), repr(COLS))
    with pytest.raises(ValueError, match="not a spec"):
        xla_ops.sharding_constraint(torch.randn(8, device=xla_device()), "rows please")


# --------------------------------------------------------------------------- local_map regions


def aot_lowered(fn, *args):
    """AOTAutograd's forward and backward graphs of ``fn``, lowered to XLA."""
    forward, backward, _ = aot_trace(fn, *args)
    return passes.lower_to_xla(forward), passes.lower_to_xla(backward)


def custom_call_targets(hlo):
    return re.findall(r'custom_call_target="(\w+)"', hlo)


def all_reduce_groups(hlo):
    return re.findall(r"all-reduce\(.*replica_groups=(\{[^ ]*\}),", hlo)


def matmul(x, w):
    return x @ w


# autoparallel#515: a (Replicate, Shard(0)) weight whose gradient must be (Partial, Shard(0)).
sharded_matmul = hops.local_map(
    matmul,
    mesh=MESH,
    in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),
    out_placements=(Shard(0), hops.Partial()),
)


def run_forward_backward(fn, *args):
    """Lowered forward and backward on XLA; returns (out, grads, forward HLO, backward HLO)."""
    forward, backward = aot_lowered(fn, *(a.detach().requires_grad_() for a in args))
    device = xla_device()
    out, *saved = forward(*(a.detach().to(device) for a in args))
    forward_hlo = hlo_text(out)
    sync()
    grads = backward(*saved, torch.ones(out.shape, device=device))
    return out, grads, forward_hlo, hlo_text(*grads)


def test_local_map_lowers_to_a_manual_region_forward_and_backward():
    x, w = torch.randn(8, 6), torch.randn(6, 4)
    out, (grad_x, grad_w), forward_hlo, backward_hlo = run_forward_backward(sharded_matmul, x, w)
    assert custom_call_targets(forward_hlo) == [
        "Sharding", "SPMDFullToShardShape", "Sharding", "SPMDFullToShardShape",
        "Sharding", "SPMDShardToFullShape",
    ]
    # The Partial output is summed over "model" (device groups {0,1},{2,3}) inside the region.
    assert all_reduce_groups(forward_hlo) == ["{{0,1},{2,3}}"]
    assert re.search(r"dot\(f32\[4,3\]\{1,0\} %custom-call\.\d+, f32\[3,4\]", forward_hlo)  # local shapes
    # Backward: the weight's Partial gradient is summed over "data" ({0,2},{1,3}).
    assert all_reduce_groups(backward_hlo) == ["{{0,2},{1,3}}"]
    assert custom_call_targets(backward_hlo).count("SPMDShardToFullShape") == 2

    reference_x, reference_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    (reference_x @ reference_w).sum().backward()
    torch.testing.assert_close(out.cpu(), x @ w)
    torch.testing.assert_close(grad_x.cpu(), reference_x.grad)
    torch.testing.assert_close(grad_w.cpu(), reference_w.grad)


def scale_and_project(x, w):
    return x * 2, x @ w


def test_replicated_output_cotangent_enters_the_backward_region_as_partial():
    # y is Replicate: its cotangent enters the backward region as Partial (first device
    # along each axis holds it), so the replicated x's gradient sums correctly.
    region = hops.local_map(
        scale_and_project,
        mesh=MESH,
        in_placements=((Replicate(), Replicate()), (Replicate(), Shard(1))),
        out_placements=((Replicate(), Replicate()), (Replicate(), Shard(1))),
    )

    def loss(x, w):
        y, z = region(x, w)
        return y.sum() + z.sum()

    x, w = torch.randn(4, 6), torch.randn(6, 8)
    out, (grad_x, grad_w), _, backward_hlo = run_forward_backward(loss, x, w)
    simulated_x, simulated_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss(simulated_x, simulated_w).backward()
    reference_x, reference_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ((reference_x * 2).sum() + (reference_x @ reference_w).sum()).backward()
    torch.testing.assert_close(simulated_x.grad, reference_x.grad)
    torch.testing.assert_close(grad_x.cpu(), reference_x.grad)
    torch.testing.assert_close(grad_w.cpu(), reference_w.grad)
    torch.testing.assert_close(out.cpu(), loss(x, w))
    assert "all-reduce" in backward_hlo


def test_local_map_region_off_xla_refuses_clearly():
    gm = passes.lower_to_xla(make_fx(sharded_matmul)(torch.randn(8, 6), torch.randn(6, 4)))
    with pytest.raises(RuntimeError, match="run only on XLA tensors under SPMD"):
        gm(torch.randn(8, 6), torch.randn(6, 4))


# A graph lowered where torch_xla is not imported (the README allows lowering on one machine
# and running on another), then run on this process's 4 XLA devices: each program's mesh is
# checked where it first meets the runtime, as a ValueError naming the mesh.
LOWERED_ELSEWHERE = r"""
import json, os, sys
import torch
from torch.fx.experimental.proxy_tensor import make_fx
import hops, passes

MESHES = {
    "eight": hops.Mesh.of(data=2, model=4),
    "three": hops.Mesh.of(data=3),
    "id 7": hops.Mesh((2, 2), ("data", "model"), (0, 1, 2, 7)),
    "permuted": hops.Mesh((2, 2), ("data", "model"), (3, 1, 2, 0)),
}


def programs(mesh):
    rows = (hops.Shard(0),) + (hops.Replicate(),) * (mesh.ndim - 1)
    spec = hops.ShardingSpec(mesh, rows)
    region = hops.local_map(lambda x: x * 2, out_placements=rows, in_placements=(rows,), device_mesh=mesh)

    def step(c, x):
        c = hops.annotate_sharding(torch.tanh(c + x), spec)
        return c, c.sum()

    return {
        "annotation": lambda x: hops.annotate_sharding(x * 2, spec) + 1,
        "region": lambda x: region(x) + 1,
        "scan": lambda x: hops.scan(step, x, x.unsqueeze(0).expand(3, -1, -1))[0],
    }


x = torch.randn(12, 8)
lowered = {(m, p): (passes.lower_to_xla(make_fx(fn)(x)), fn(x)) for m, mesh in MESHES.items() for p, fn in programs(mesh).items()}
assert "torch_xla" not in sys.modules  # lowered without torch_xla: nothing checked the mesh yet

os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
results = {}
for (m, p), (gm, expected) in lowered.items():
    try:
        out = gm(x.to(torch_xla.device()))
        torch_xla.sync()
        results[f"{m} {p}"] = ["ran", bool(torch.allclose(out.cpu(), expected, atol=1e-5))]
    except Exception as error:
        results[f"{m} {p}"] = [type(error).__name__, str(error)]
print(json.dumps(results))
"""


def test_a_graph_lowered_without_torch_xla_checks_its_mesh_where_it_first_runs():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_SPMD", "PJRT_DEVICE", "CPU_NUM_DEVICES")}
    result = subprocess.run([sys.executable, "-c", LOWERED_ELSEWHERE], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.splitlines()[-1])
    described = {
        "eight": (r"hops\.Mesh\.of\(data=2, model=4\)", r"\[0, 1, 2, 3, 4, 5, 6, 7\]"),
        "three": (r"hops\.Mesh\.of\(data=3\)", r"\[0, 1, 2\]"),
        "id 7": (r"hops\.Mesh\.of\(\(0, 1, 2, 7\), data=2, model=2\)", r"\[0, 1, 2, 7\]"),
    }
    for mesh, (name, ids) in described.items():
        for program in ("annotation", "region", "scan"):
            kind, message = results[f"{mesh} {program}"]
            assert kind == "ValueError", (mesh, program, kind, message)
            assert re.search(
                rf"hops_xla\.\w+ with .*: its mesh {name} has devices {ids}, but this process has 4 XLA devices "
                r"\(0\.\.3, 4 addressable\); an XLA mesh must use each device once",
                message,
            ), (mesh, program, message)
    # A mesh of the runtime's devices in another order runs, after the refusals, and is right.
    for program in ("annotation", "region", "scan"):
        assert results[f"permuted {program}"] == ["ran", True], results[f"permuted {program}"]


def test_mesh_to_xla_refuses_a_mesh_that_is_not_the_runtime_devices():
    with pytest.raises(ValueError, match=r"Mesh.to_xla\(\): its mesh hops.Mesh.of\(data=3\) has devices \[0, 1, 2\], but this process has 4"):
        Mesh.of(data=3).to_xla()
    with pytest.raises(ValueError, match=r"has devices \[0, 1, 2, 7\]"):
        Mesh((2, 2), ("data", "model"), (0, 1, 2, 7)).to_xla()
    assert Mesh.from_xla(Mesh((2, 2), ("data", "model"), (3, 1, 2, 0)).to_xla()) == Mesh((2, 2), ("data", "model"), (3, 1, 2, 0))
