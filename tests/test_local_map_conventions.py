"""hops.local_map takes torch's local_map calling conventions, and computes what torch's
computes on DTensors (simulated ranks: ``LocalTensorMode``, torch 2.13 and newer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

import hops
from hops import Mesh, Partial, Replicate, Shard
from tests.helpers.snapshot import TestCase

MESH = Mesh((2, 2), ("data", "model"))
LINE = Mesh((2,), ("x",))
HAS_LOCAL_TENSOR = importlib.util.find_spec("torch.distributed._local_tensor") is not None


@pytest.fixture(scope="module", autouse=True)
def fake_process_group():
    """DeviceMeshes need a process group: a fake one of 4 ranks (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    leaves = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return out, torch.autograd.grad(sum(o.sum() for o in leaves), inputs, allow_unused=True)


def matmul(x, w):
    return x @ w


class TestTorchCallingConventions(TestCase):
    def test_decorator_form_and_torchs_positional_order(self):
        @hops.local_map(out_placements=[Shard(0)], in_placements=((Shard(0),), (Replicate(),)), device_mesh=LINE)
        def decorated(x, w):
            return x @ w

        positional = hops.local_map(matmul, [Shard(0)], ((Shard(0),), (Replicate(),)), None, LINE)
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        self.assertEqual(decorated(x, w), x @ w)
        self.assertEqual(positional(x, w), x @ w)
        self.assertEqual(decorated.__name__, "decorated")

    def test_out_placements_for_the_flattened_outputs_in_every_form(self):
        x = torch.randn(4, 3)
        for out_placements in ([Shard(0)], (Shard(0),), ((Shard(0),),), [[Shard(0)]]):
            f = hops.local_map(lambda t: t * 2, out_placements=out_placements, in_placements=((Shard(0),),), device_mesh=LINE)
            self.assertEqual(f(x), x * 2, msg=repr(out_placements))
        two = hops.local_map(lambda t: (t * 2, t.sum(0, keepdim=True)), out_placements=((Shard(0),), (Partial(),)), in_placements=((Shard(0),),), device_mesh=LINE)
        self.assertEqual(two(x), (x * 2, x.sum(0, keepdim=True)))

    def test_none_entries_are_non_tensor_inputs_and_outputs(self):
        def scaled(x, factor):
            return x * factor, factor + 1

        f = hops.local_map(scaled, out_placements=((Shard(0),), None), in_placements=((Shard(0),), None), device_mesh=LINE)
        out, count = f(torch.ones(4, 3), 3)
        self.assertEqual(out, torch.full((4, 3), 3.0))
        self.assertEqual(count, 4)

    def test_in_placements_none_means_every_tensor_is_whole_on_every_device(self):
        f = hops.local_map(matmul, out_placements=[Replicate()], in_placements=None, device_mesh=LINE)
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        out, (gx, gw) = grads(f, x, w)
        self.assertEqual(out, x @ w)
        self.assertEqual((gx, gw), grads(matmul, x, w)[1])

    def test_out_placements_none_is_one_replicated_output_as_in_torch(self):
        # torch wraps the output with no placements: replicated on every mesh axis.
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        f = hops.local_map(matmul, out_placements=None, in_placements=(None, None), device_mesh=LINE)
        self.assertEqual(f(x, w), x @ w)
        # Replicate outputs must agree across devices: per-shard results that differ are refused.
        g = hops.local_map(matmul, out_placements=None, in_placements=((Shard(0),), None), device_mesh=LINE)
        with self.assertRaisesRegex(ValueError, "is declared Replicate on mesh axis 'x'"):
            g(x, w)

    def test_keyword_arguments_are_passed_through(self):
        def shifted(x, *, shift, scale=1.0):
            return (x + shift) * scale

        f = hops.local_map(shifted, out_placements=[Shard(0)], in_placements=((Shard(0),),), device_mesh=LINE)
        x, shift = torch.randn(4, 3), torch.randn(3)
        self.assertEqual(f(x, shift=shift, scale=2.0), (x + shift) * 2.0)

    def test_a_device_mesh_and_torchs_placements(self):
        device_mesh = MESH.to_device_mesh()
        f = hops.local_map(
            matmul,
            out_placements=[TorchShard(0), TorchPartial()],
            in_placements=([TorchShard(0), TorchShard(1)], [TorchReplicate(), TorchShard(0)]),
            device_mesh=device_mesh,
            redistribute_inputs=True,
        )
        x, w = torch.randn(4, 6), torch.randn(6, 3)
        out, got = grads(f, x, w)
        self.assertEqual(out, x @ w)
        self.assertEqual(got, grads(matmul, x, w)[1])

    def test_without_a_mesh_or_dtensors_the_function_runs_as_is(self):
        f = hops.local_map(matmul, out_placements=[Shard(0)], in_placements=((Shard(0),), (Replicate(),)))
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        self.assertEqual(f(x, w), x @ w)

    def test_wrong_arguments_raise_torchs_error_classes(self):
        f = hops.local_map(matmul, out_placements=[Shard(0)], in_placements=((Shard(0),),), device_mesh=LINE)
        with self.assertRaisesRegex(AssertionError, r"in_placements length 1 does not match the number of input args 2"):
            f(torch.randn(4, 3), torch.randn(3, 2))
        g = hops.local_map(lambda t, n: t * n, out_placements=[Shard(0)], in_placements=((Shard(0),), (Replicate(),)), device_mesh=LINE)
        with self.assertRaisesRegex(AssertionError, r"in_placements gives placements for args\[1\], which is a int"):
            g(torch.randn(4, 3), 2)
        h = hops.local_map(lambda t: 3.0, out_placements=[Replicate()], in_placements=((Shard(0),),), device_mesh=LINE)
        with self.assertRaisesRegex(AssertionError, r"^local_map\(lambda\): returned float, which does not match out_placements: output is a float, which takes None placements"):
            h(torch.randn(4, 3))


NEGATIVE_DIM_CASES = [
    # (shape, placements with negative dims on MESH); every case has a resolved twin
    ((4, 6), (Shard(-1), Replicate())),
    ((4, 6), (Shard(-2), Shard(-1))),
    ((2, 4, 6), (Shard(-1), Shard(-3))),
    ((2, 4, 6), (Shard(-2), Shard(-2))),
]


@pytest.mark.parametrize(("shape", "placements"), NEGATIVE_DIM_CASES, ids=str)
def test_negative_shard_dims_mean_what_dtensor_means(shape, placements):
    # Shard(-1) (DTensor's, common in tensor-parallel code) counts from the last dim: the
    # same values and gradients as the resolved dims, and traced nodes hold dims >= 0.
    from torch.fx.experimental.proxy_tensor import make_fx

    import passes

    resolved = tuple(Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in placements)

    def region(dims):
        return hops.local_map(lambda t: (t.cos() * 2, t.sum(0, keepdim=True)), mesh=MESH, in_placements=(dims,),
                              out_placements=(dims, tuple(Partial() if isinstance(p, Shard) and p.dim % len(shape) == 0 else p for p in dims)))

    x = torch.randn(*shape, dtype=torch.float64)
    reference = (x.cos() * 2, x.sum(0, keepdim=True))
    for dims in (placements, resolved):
        out, grad = grads(region(dims), x)
        torch.testing.assert_close(out, reference)
        torch.testing.assert_close(grad, grads(lambda t: (t.cos() * 2, t.sum(0, keepdim=True)), x)[1])
    gm = make_fx(region(placements))(x)
    (node,) = [n for n in gm.graph.nodes if n.target is hops.local_map_hop]
    assert node.args[-1] == make_fx(region(resolved))(x).graph.find_nodes(op="call_function", target=hops.local_map_hop)[0].args[-1]
    torch.testing.assert_close(passes.inline_hops(gm)(x), reference)


def test_torchs_negative_shard_placement_is_accepted_by_local_map():
    f = hops.local_map(lambda t: t * 3, out_placements=[TorchShard(-1)], in_placements=([TorchShard(-1)],), device_mesh=LINE)
    x = torch.randn(3, 4)
    torch.testing.assert_close(f(x), x * 3)


def test_a_collective_in_the_body_on_plain_tensors_is_refused_by_name():
    # Each device's piece is computed in this process: an all_reduce would not sum the
    # simulated devices' pieces (with a real process group it would reach other processes).
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.fx.experimental.proxy_tensor import make_fx

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))

    def mm_allreduce(device_mesh, a, b):
        return funcol.all_reduce(torch.mm(a, b), "sum", device_mesh).wait()

    f = hops.local_map(mm_allreduce, out_placements=[Replicate()], in_placements=(None, [Shard(1)], [Shard(0)]), device_mesh=mesh)
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    message = r"local_map\(mm_allreduce\): the body calls the collective _c10d_functional::all_reduce; .* Partial\(\)"
    with pytest.raises(ValueError, match=message):
        f(mesh, x, w)
    with pytest.raises(ValueError, match=message):
        make_fx(lambda x, w: f(mesh, x, w))(x, w)
    # The same program with the sum left to the out placement.
    g = hops.local_map(lambda m, a, b: torch.mm(a, b), out_placements=[Partial()], in_placements=(None, [Shard(1)], [Shard(0)]), device_mesh=mesh)
    torch.testing.assert_close(g(mesh, x, w), x @ w)


# --------------------------------------------------------------------------- against torch's local_map

PROGRAMS = [
    # (name, function, in_placements, out_placements, input shapes)
    ("rows", lambda x: torch.tanh(x) * 2, [[Shard(0), Replicate()]], [Shard(0), Replicate()], [(8, 4)]),
    ("matmul with a contracted dim split", matmul, [[Shard(0), Shard(1)], [Replicate(), Shard(0)]], [Shard(0), Partial()], [(4, 6), (6, 3)]),
    ("replicated weight (autoparallel#515)", matmul, [[Shard(0), Replicate()], [Replicate(), Replicate()]], [Shard(0), Replicate()], [(4, 3), (3, 5)]),
    (
        "two outputs",
        lambda q, k: ((q @ k.t()).softmax(-1), q.sum(-1)),
        [[Shard(0), Replicate()], [Replicate(), Replicate()]],
        ([Shard(0), Replicate()], [Shard(0), Replicate()]),
        [(4, 3), (6, 3)],
    ),
]


def to_torch(placements):
    """Our placements (one group, or a tuple of groups) as DTensor's."""
    if placements is None:
        return None
    if all(isinstance(p, hops.Placement) for p in placements):
        return [p.to_dtensor() for p in placements]
    return tuple(to_torch(p) for p in placements)


@pytest.mark.skipif(not HAS_LOCAL_TENSOR, reason="torch.distributed._local_tensor (simulated ranks) arrives in torch 2.13")
@pytest.mark.parametrize("program", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_outputs_and_gradients_equal_torchs_local_map_on_simulated_ranks(program):
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    name, fn, in_placements, out_placements, shapes = program
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    # torch gives every device a replicated output's whole cotangent: the gradient layouts
    # right in that convention (what a torch user writes), derived by our spec.
    outs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    torch_grads = hops.LocalMapSpec(MESH, tuple(map(tuple, in_placements)), tuple(map(tuple, outs)), (None,) * len(in_placements)).grad_placements()

    ours = hops.local_map(fn, out_placements=out_placements, in_placements=tuple(in_placements), mesh=MESH)
    expected, expected_grads = grads(ours, *inputs)
    # The same layouts given explicitly (torch's convention) give the same gradients.
    ours_explicit = hops.local_map(fn, out_placements=out_placements, in_placements=tuple(in_placements), in_grad_placements=torch_grads, mesh=MESH)
    torch.testing.assert_close(grads(ours_explicit, *inputs), (expected, expected_grads))

    def rank0(t):
        return t._local_tensors[0] if isinstance(t, LocalTensor) else t

    with LocalTensorMode(frozenset(range(4))):
        device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
        dtensors = [
            distribute_tensor(t, device_mesh, to_torch(p)).requires_grad_() for t, p in zip(inputs, in_placements)
        ]
        theirs = torch_local_map(
            fn,
            out_placements=to_torch(out_placements),
            in_placements=tuple(to_torch(p) for p in in_placements),
            in_grad_placements=tuple(to_torch(p) for p in torch_grads),
            device_mesh=device_mesh,
        )(*dtensors)
        outputs = theirs if isinstance(theirs, tuple) else (theirs,)
        sum(o.sum() for o in outputs).backward()
        got = [rank0(o.full_tensor()) for o in outputs]
        got_grads = [rank0(t.grad.full_tensor()) for t in dtensors]
    torch.testing.assert_close(tuple(got), expected if isinstance(expected, tuple) else (expected,))
    torch.testing.assert_close(tuple(got_grads), tuple(expected_grads))


@pytest.mark.skipif(not HAS_LOCAL_TENSOR, reason="torch.distributed._local_tensor (simulated ranks) arrives in torch 2.13")
def test_dtensor_inputs_run_torchs_local_map_with_pending_sum_gradients_for_replicated_inputs():
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    ours = hops.local_map(matmul, out_placements=[Shard(0)], in_placements=((Shard(0),), (Replicate(),)))
    with LocalTensorMode(frozenset(range(2))):
        device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
        x_d = distribute_tensor(x, device_mesh, [TorchShard(0)]).requires_grad_()
        w_d = distribute_tensor(w, device_mesh, [TorchReplicate()]).requires_grad_()
        out = ours(x_d, w_d)
        out.sum().backward()
        full, grad_w = out.full_tensor(), w_d.grad.full_tensor()
    rank0 = lambda t: t._local_tensors[0] if isinstance(t, LocalTensor) else t  # noqa: E731
    torch.testing.assert_close(rank0(full), x @ w)
    # The weight's gradient sums both shards' contributions (torch's default would keep one).
    torch.testing.assert_close(rank0(grad_w), x.t() @ torch.ones(4, 5))
