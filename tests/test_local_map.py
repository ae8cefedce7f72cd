"""local_map_hop: the eager SPMD simulation against single-device references, gradients,
errors, and the graphs every non-Dynamo frontend records (make_fx, functionalization,
AOTAutograd, non-strict export)."""

import copy
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import LocalMapSpec, Mesh, Partial, Replicate, Shard
from tests.helpers.snapshot import TestCase, aot_trace, delete_meta, readable

MESH = Mesh((2, 2), ("data", "model"))
LINE = Mesh((2,), ("x",))
ONE_D_SHAPES = [(2,), (4,), (8,)]
TWO_D_SHAPES = [(2, 2), (2, 4), (4, 2)]


def mesh_of(shape):
    return Mesh(shape, ("x",) if len(shape) == 1 else ("data", "model"))


def spread(shape, seed=0):
    """A tensor of ``shape`` whose entries are all different (so misplaced chunks show)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator)


def requiring_grad(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


aot_graphs = aot_trace  # (forward, backward, outputs)


def local_map_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hops.local_map_hop]


def subgraph_names(gm):
    return [n.args[0].target for n in local_map_nodes(gm)]


def generated_code(gm):
    """The Python code of ``gm`` and of each subgraph, by module path."""
    return {name: m.code for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


# --------------------------------------------------------------------------- programs


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(0, 1), dim=-1) @ v


# Rows of q split over "data"; every device holds all of k and v.
sharded_attention = hops.local_map(
    attention,
    mesh=MESH,
    in_placements=((Shard(0), Replicate()), (Replicate(), Replicate()), (Replicate(), Replicate())),
    out_placements=(Shard(0), Replicate()),
)


def attention_inputs():
    return spread((4, 8), 1), spread((6, 8), 2), spread((6, 8), 3)


class ShardedAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return sharded_attention(q, k, v)


def matmul(x, w):
    return x @ w


def scale_in_place(x):
    x.mul_(3)
    return x + 1


def view_of(x):
    return x.t()


# --------------------------------------------------------------------------- 1. numerics


class TestSimulationMatchesReference(TestCase):
    def test_shard_in_shard_out_on_1d_meshes(self):
        def sin_twice(x):
            return x.sin() * 2

        x = spread((8, 16))
        for shape in ONE_D_SHAPES:
            for dim in (0, 1):
                f = hops.local_map(
                    sin_twice, mesh=mesh_of(shape), in_placements=((Shard(dim),),), out_placements=(Shard(dim),)
                )
                self.assertEqual(f(x), sin_twice(x))

    def test_shard_in_shard_out_on_2d_meshes(self):
        def sin_twice(x):
            return x.sin() * 2

        x = spread((8, 16))
        for shape in TWO_D_SHAPES:
            for placements in ((Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Replicate())):
                f = hops.local_map(
                    sin_twice, mesh=mesh_of(shape), in_placements=(placements,), out_placements=placements
                )
                self.assertEqual(f(x), sin_twice(x))

    def test_replicate_in_replicate_out(self):
        def softmax_rows(x):
            return x.softmax(-1)

        x = spread((4, 6))
        for shape in ONE_D_SHAPES + TWO_D_SHAPES:
            replicated = (Replicate(),) * len(shape)
            f = hops.local_map(
                softmax_rows, mesh=mesh_of(shape), in_placements=(replicated,), out_placements=replicated
            )
            self.assertEqual(f(x), softmax_rows(x))

    def test_row_sharded_attention_with_replicated_keys(self):
        q, k, v = attention_inputs()
        self.assertEqual(sharded_attention(q, k, v), attention(q, k, v))

    def test_matmul_over_a_sharded_contracted_dim_is_a_partial_sum(self):
        x, w = spread((8, 16), 1), spread((16, 4), 2)
        for shape in ONE_D_SHAPES:
            f = hops.local_map(
                matmul, mesh=mesh_of(shape), in_placements=((Shard(1),), (Shard(0),)), out_placements=(Partial(),)
            )
            self.assertEqual(f(x, w), x @ w)
        for shape in TWO_D_SHAPES:
            # Rows over "data", the contracted dim over "model".
            f = hops.local_map(
                matmul,
                mesh=mesh_of(shape),
                in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),
                out_placements=(Shard(0), Partial()),
            )
            self.assertEqual(f(x, w), x @ w)

    def test_local_max_min_mean_reductions_are_partial_max_min_avg(self):
        def column_stats(x):
            return x.amax(0), x.amin(0), x.mean(0), x.sum(0)

        x = spread((16, 5))
        expected = (x.amax(0), x.amin(0), x.mean(0), x.sum(0))
        for shape in ONE_D_SHAPES + TWO_D_SHAPES:
            rows = (Shard(0),) * len(shape)
            f = hops.local_map(
                column_stats,
                mesh=mesh_of(shape),
                in_placements=(rows,),
                out_placements=tuple((Partial(op),) * len(shape) for op in ("max", "min", "avg", "sum")),
            )
            self.assertEqual(f(x), expected)

    def test_partial_inputs_reduce_like_their_op(self):
        def triple(x):
            return 3 * x

        x = spread((4, 6))
        for op in ("sum", "avg", "max", "min"):
            for shape in ((4,), (2, 2)):
                pending = (Partial(op),) * len(shape)
                f = hops.local_map(triple, mesh=mesh_of(shape), in_placements=(pending,), out_placements=pending)
                self.assertEqual(f(x), 3 * x)

    def test_mesh_axes_sharding_one_dim_take_chunks_axis_0_major(self):
        seen = []

        def record(x):
            if not isinstance(x, torch._subclasses.FakeTensor):  # the inspection run sees fakes
                seen.append(x.clone())
            return x * 1

        x = torch.arange(16.0).reshape(8, 2)
        rows = (Shard(0), Shard(0))
        f = hops.local_map(record, mesh=Mesh((2, 4), ("a", "b")), in_placements=(rows,), out_placements=rows)
        self.assertEqual(f(x), x)
        # Device (i, j) runs in row-major order and holds chunk i * 4 + j.
        self.assertEqual(seen, list(x.chunk(8)))

    def test_mesh_axes_sharding_one_dim_in_either_role(self):
        def identity(x):
            return x.clone()

        x = torch.arange(32.0).reshape(8, 4)
        f = hops.local_map(identity, mesh=MESH, in_placements=((Shard(0), Shard(0)),), out_placements=(Shard(0), Shard(0)))
        self.assertEqual(f(x), x)

        def corner(t):
            return t[:1, :1].clone()

        # Axis 0 splits dim 1 and axis 1 splits dim 0: device (i, j) holds row block j, column block i.
        crossed = (Shard(1), Shard(0))
        g = hops.local_map(corner, mesh=MESH, in_placements=(crossed,), out_placements=crossed)
        self.assertEqual(g(x), x[::4, ::2])

    def test_pytree_argument_with_a_placements_prefix(self):
        def weighted(inputs, pair):
            return inputs["a"] * inputs["b"] + pair[0] - pair[1]

        inputs = {"a": spread((4, 6), 1), "b": spread((4, 6), 2)}
        pair = (spread((4, 6), 3), spread((4, 6), 4))
        for shape in ((4,), (2, 2)):
            rows = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
            f = hops.local_map(weighted, mesh=mesh_of(shape), in_placements=(rows, rows), out_placements=rows)
            self.assertEqual(f(inputs, pair), weighted(inputs, pair))

    def test_pytree_argument_with_a_full_placements_tree(self):
        def combine(inputs, pair):
            return inputs["rows"] * inputs["bias"] + pair[0] @ pair[1]

        inputs = {"rows": spread((4, 6), 1), "bias": spread((6,), 2)}
        pair = (spread((4, 3), 3), spread((3, 6), 4))
        f = hops.local_map(
            combine,
            mesh=MESH,
            in_placements=(
                {"rows": (Shard(0), Replicate()), "bias": (Replicate(), Replicate())},
                ((Shard(0), Replicate()), (Replicate(), Replicate())),
            ),
            out_placements=(Shard(0), Replicate()),
        )
        self.assertEqual(f(inputs, pair), combine(inputs, pair))

    def test_non_tensor_arguments_take_none_placements(self):
        def affine(x, scale, options):
            return x * scale + options["shift"]

        x = spread((4, 6))
        f = hops.local_map(affine, mesh=LINE, in_placements=((Shard(1),), None, None), out_placements=(Shard(1),))
        self.assertEqual(f(x, 2.5, {"shift": 1}), affine(x, 2.5, {"shift": 1}))

    def test_pytree_outputs_tuple_and_dict(self):
        def stats(x):
            return x * 2, (x.sum(0), x.amax(0))

        def named_stats(x):
            return {"doubled": x * 2, "total": x.sum(0)}

        x = spread((8, 3))
        rows = ((Shard(0),),)
        f = hops.local_map(
            stats, mesh=LINE, in_placements=rows, out_placements=((Shard(0),), ((Partial(),), (Partial("max"),)))
        )
        self.assertEqual(f(x), (x * 2, (x.sum(0), x.amax(0))))
        g = hops.local_map(
            named_stats, mesh=LINE, in_placements=rows, out_placements={"doubled": (Shard(0),), "total": (Partial(),)}
        )
        out = g(x)
        self.assertEqual(list(out), ["doubled", "total"])
        self.assertEqual(out["doubled"], x * 2)
        self.assertEqual(out["total"], x.sum(0))

    def test_dtensor_placements_are_accepted(self):
        from torch.distributed.tensor import Replicate as DReplicate
        from torch.distributed.tensor import Shard as DShard

        def double(x):
            return x * 2

        x = spread((4, 6))
        rows = (DShard(0), DReplicate())
        f = hops.local_map(double, mesh=MESH, in_placements=(rows,), out_placements=rows)
        self.assertEqual(f(x), x * 2)
        (node,) = local_map_nodes(make_fx(f)(x))
        self.assertEqual(node.args[-1].in_placements, ((Shard(0), Replicate()),))

    def test_inputs_are_not_modified_and_outputs_are_fresh(self):
        def double(x):
            return x * 2

        x = spread((4, 6))
        before = x.clone()
        out = hops.local_map(double, mesh=LINE, in_placements=((Replicate(),),), out_placements=(Replicate(),))(x)
        out.add_(1)
        self.assertEqual(x, before)

    def test_replicate_output_that_differs_across_devices_raises_naming_it(self):
        def row_sums(x):
            return x * 2, x.sum(0)

        f = hops.local_map(
            row_sums,
            mesh=MESH,
            in_placements=((Replicate(), Shard(0)),),
            out_placements=((Replicate(), Shard(0)), (Replicate(), Replicate())),
        )
        with self.assertRaisesRegex(
            ValueError,
            r"^local_map\(row_sums\): output\[1\] is declared Replicate on mesh axis 'model', but device 1 along "
            r"that axis produced a different value than device 0 .*declare it Partial or Shard",
        ):
            f(spread((4, 6)))


# --------------------------------------------------------------------------- 2. gradients


def reference_grads(fn, inputs, cotangent_seed=7):
    inputs = requiring_grad(*inputs)
    out = fn(*inputs)
    cotangent = spread(out.shape, cotangent_seed)
    grads = torch.autograd.grad(out, inputs, cotangent)
    return out.detach(), cotangent, grads


def simulated_grads(fn, inputs, cotangent):
    inputs = requiring_grad(*inputs)
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, cotangent)
    return out.detach(), grads


class TestGradients(TestCase):
    def test_replicate_shard_and_partial_inputs(self):
        def body(x, w, scale, bias):
            return (x @ w) * scale - bias

        inputs = (spread((4, 8), 1), spread((8, 6), 2), spread((4, 6), 3), spread((4, 6), 4))
        expected_out, cotangent, expected = reference_grads(body, inputs)
        layouts = {
            (4,): ((Shard(1),), (Shard(0),), (Replicate(),), (Partial(),)),
            (2, 2): ((Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(0), Replicate()), (Shard(0), Partial())),
        }
        out_placements = {(4,): (Partial(),), (2, 2): (Shard(0), Partial())}
        for shape, in_placements in layouts.items():
            f = hops.local_map(
                body, mesh=mesh_of(shape), in_placements=in_placements, out_placements=out_placements[shape]
            )
            out, grads = simulated_grads(f, inputs, cotangent)
            self.assertEqual(out, expected_out)
            self.assertEqual(grads, expected)

    def test_autoparallel_515_replicated_weight_gets_partial_gradient_over_data(self):
        # https://github.com/meta-pytorch/autoparallel/issues/515
        f = hops.local_map(
            matmul,
            mesh=MESH,
            in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),
            out_placements=(Shard(0), Partial()),
        )
        x, w = requiring_grad(spread((4, 6), 1), spread((6, 4), 2))
        forward, backward, out = aot_graphs(f, x, w)
        ref_x, ref_w = requiring_grad(x, w)
        (ref_x @ ref_w).sum().backward()
        self.assertEqual(out, ref_x @ ref_w)
        self.assertEqual(x.grad, ref_x.grad)
        self.assertEqual(w.grad, ref_w.grad)
        (node,) = local_map_nodes(backward)
        spec = node.args[-1]
        self.assertIsInstance(spec, LocalMapSpec)
        self.assertEqual(spec.out_placements, ((Shard(0), Shard(1)), (Partial(), Shard(0))))
        # Inputs of the backward region: the primals, then the cotangent (transpose of the output).
        self.assertEqual(
            spec.in_placements, ((Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(0), Replicate()))
        )
        # The eager path gives the same gradients.
        x2, w2 = requiring_grad(x, w)
        f(x2, w2).sum().backward()
        self.assertEqual((x2.grad, w2.grad), (ref_x.grad, ref_w.grad))

    def test_gradcheck_on_double_inputs(self):
        def body(x, w):
            return torch.tanh(x @ w)

        x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
        w = torch.randn(6, 2, dtype=torch.double, requires_grad=True)
        for in_placements, out_placements in (
            (((Shard(0), Replicate()), (Replicate(), Replicate())), (Shard(0), Replicate())),
            (((Shard(0), Shard(0)), (Replicate(), Replicate())), (Shard(0), Shard(0))),
            (((Replicate(), Replicate()), (Replicate(), Shard(1))), (Replicate(), Shard(1))),
        ):
            f = hops.local_map(body, mesh=MESH, in_placements=in_placements, out_placements=out_placements)
            self.assertTrue(torch.autograd.gradcheck(f, (x, w)))
        linear = hops.local_map(
            matmul, mesh=LINE, in_placements=((Shard(1),), (Shard(0),)), out_placements=(Partial(),)
        )
        self.assertTrue(torch.autograd.gradcheck(linear, (x, w)))

    def test_explicit_in_grad_placements_are_honored(self):
        # Every device holds the whole of a Partial("avg") input, which has no derived
        # gradient layout. Given in_grad_placements, gradients follow torch's convention:
        # every device receives the replicated output's whole cotangent, so each computes
        # the whole gradient (Replicate).
        def triple(x):
            return 3 * x

        f = hops.local_map(
            triple,
            mesh=LINE,
            in_placements=((Partial("avg"),),),
            out_placements=(Replicate(),),
            in_grad_placements=((Replicate(),),),
        )
        x = requiring_grad(spread((4, 6)))[0]
        forward, backward, out = aot_graphs(f, x)
        self.assertEqual(out, 3 * x)
        self.assertEqual(x.grad, torch.full_like(x, 3.0))
        (node,) = local_map_nodes(backward)
        self.assertEqual(node.args[-1].out_placements, ((Replicate(),),))
        x2 = requiring_grad(x)[0]
        f(x2).sum().backward()
        self.assertEqual(x2.grad, torch.full_like(x, 3.0))

    def test_derived_gradient_of_a_partial_avg_input_raises(self):
        def triple(x):
            return 3 * x

        f = hops.local_map(triple, mesh=LINE, in_placements=((Partial("avg"),),), out_placements=(Replicate(),))
        x = requiring_grad(spread((4, 6)))[0]
        with self.assertRaisesRegex(ValueError, r"in_placements\[0\]: Partial\('avg'\) is not linear"):
            f(x).sum().backward()

    def test_wrong_explicit_replicate_gradient_raises(self):
        # Each row shard contributes a different local gradient to the replicated weight.
        f = hops.local_map(
            matmul,
            mesh=LINE,
            in_placements=((Shard(0),), (Replicate(),)),
            out_placements=(Shard(0),),
            in_grad_placements=((Shard(0),), (Replicate(),)),
        )
        x, w = requiring_grad(spread((4, 6), 1), spread((6, 3), 2))
        with self.assertRaisesRegex(
            ValueError, r"^local_map\(matmul\): tensors\[1\].grad is declared Replicate on mesh axis 'x', but device 1"
        ):
            f(x, w).sum().backward()


# --------------------------------------------------------------------------- 3. properties

MESH_SHAPES = [(1,), (2,), (4,), (8,), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 8), (8, 1)]
PROPERTY_SETTINGS = settings(
    max_examples=500, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def layouts(draw, partial_ops):
    """A mesh, one input placement per axis, and a global shape that splits evenly."""
    mesh = mesh_of(draw(st.sampled_from(MESH_SHAPES)))
    rank = draw(st.integers(1, 3))
    choices = [Shard(d) for d in range(rank)] + [Replicate()] + [Partial(op) for op in partial_ops]
    placements = tuple(draw(st.sampled_from(choices)) for _ in mesh.shape)
    shape = []
    for dim in range(rank):
        ways = 1
        for size, p in zip(mesh.shape, placements):
            ways *= size if p == Shard(dim) else 1
        shape.append(ways * draw(st.integers(1, 3)))
    return mesh, placements, tuple(shape)


def reduced(placements, dim, pending):
    """Output placements of a reduction over ``dim``: a shard of ``dim`` becomes ``pending``."""
    out = []
    for p in placements:
        if p == Shard(dim):
            out.append(Partial(pending))
        elif isinstance(p, Shard) and p.dim > dim:
            out.append(Shard(p.dim - 1))
        else:
            out.append(p)
    return tuple(out)


class TestTraceReuse(TestCase):
    def test_equal_calls_share_one_plan_and_return_their_non_tensor_outputs(self):
        # Two calls with the same body, Python arguments and tensor metadata, in both of
        # AOTAutograd's passes, trace the region's joint once; each still returns what its
        # body returns besides tensors (a call that reuses the plan does not run its body).
        # Other Python arguments are another plan.
        import importlib
        import unittest.mock

        plans = importlib.import_module("hops._body_hop.region")
        built = []
        make_plan = plans.RegionPlan.__init__

        def counted(plan, *args, **kwargs):
            built.append(1)
            make_plan(plan, *args, **kwargs)

        def scaled(x, factor):
            return torch.tanh(x * factor), factor + 1

        f = hops.local_map(scaled, out_placements=((Shard(0),), None), in_placements=((Shard(0),), None), mesh=LINE)

        def program(x, y):
            a, one = f(x, 3)
            b, two = f(y, 3)
            c, three = f(x, 5)
            return a * one + b * two + c * three

        def reference(x, y):
            return torch.tanh(x * 3) * 4 + torch.tanh(y * 3) * 4 + torch.tanh(x * 5) * 6

        x, y = spread((4, 6), 1).requires_grad_(), spread((4, 6), 2).requires_grad_()
        with unittest.mock.patch.object(plans.RegionPlan, "__init__", counted):
            _, _, out = aot_trace(program, x, y)
        self.assertEqual(len(built), 2)
        self.assertEqual(out, reference(x, y))
        self.assertEqual((x.grad, y.grad), torch.autograd.grad(reference(x, y).sum(), (x, y)))

    def test_python_arguments_equal_but_of_other_types_are_other_calls(self):
        # 2 == 2.0 and 0.0 == -0.0 in Python, yet they trace differently: each call returns
        # its own body's results, values, signs of zero and Python types alike.
        def scaled(x, factor):
            return x * factor, factor + 1

        f = hops.local_map(scaled, out_placements=((Shard(0),), None), in_placements=((Shard(0),), None), mesh=LINE)

        def program(x):
            (a, two), (b, two_point_oh), (c, _), (d, _) = f(x, 2), f(x, 2.0), f(x, 0.0), f(x, -0.0)
            self.assertIs(type(two), int)
            self.assertIs(type(two_point_oh), float)
            return a + b, c, d

        x = spread((4, 6), 1).requires_grad_()
        _, _, (summed, zero, negative_zero) = aot_trace(program, x)
        self.assertEqual(summed, 4 * x)
        self.assertFalse(torch.signbit(zero[x > 0]).any())
        self.assertTrue(torch.signbit(negative_zero[x > 0]).all())


class TestProperties(TestCase):
    @PROPERTY_SETTINGS
    @given(
        layout=layouts(partial_ops=("sum",)),
        body=st.sampled_from(["scale", "sum"]),
        dim=st.integers(0, 2),
        seed=st.integers(0, 2**16),
    )
    def test_linear_bodies_match_reference_forward_and_backward(self, layout, body, dim, seed):
        mesh, placements, shape = layout
        dim = dim % len(shape)
        if body == "scale":
            fn, out_placements = (lambda x: 3 * x), placements
        else:
            # A bare sum: its local gradient is a view of the cotangent (an expand).
            fn, out_placements = (lambda x: x.sum(dim)), reduced(placements, dim, "sum")
        f = hops.local_map(fn, mesh=mesh, in_placements=(placements,), out_placements=out_placements)
        x = spread(shape, seed)
        expected_out, cotangent, expected = reference_grads(fn, (x,), seed + 1)
        out, grads = simulated_grads(f, (x,), cotangent)
        self.assertEqual(out, expected_out)
        self.assertEqual(grads, expected)

    @PROPERTY_SETTINGS
    @given(
        layout=layouts(partial_ops=("avg", "max", "min")),
        body=st.sampled_from(["scale", "sum", "mean", "amax", "amin"]),
        dim=st.integers(0, 2),
        seed=st.integers(0, 2**16),
    )
    def test_reductions_of_shards_become_partial_outputs(self, layout, body, dim, seed):
        # Partial("avg"/"max"/"min") inputs: every device holds the whole value.
        mesh, placements, shape = layout
        dim = dim % len(shape)
        fn = {
            "scale": lambda x: 3 * x,
            "sum": lambda x: x.sum(dim),
            "mean": lambda x: x.mean(dim),
            "amax": lambda x: x.amax(dim),
            "amin": lambda x: x.amin(dim),
        }[body]
        pending = {"scale": None, "sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}[body]
        out_placements = placements if pending is None else reduced(placements, dim, pending)
        f = hops.local_map(fn, mesh=mesh, in_placements=(placements,), out_placements=out_placements)
        x = spread(shape, seed)
        self.assertEqual(f(x), fn(x))


# --------------------------------------------------------------------------- 4. errors


def double(x):
    return x * 2


def _named_double(x):
    return (x * 2,)


_named_double.__name__ = "double"

ROWS = ((Shard(0),),)


class TestErrors(TestCase):
    def test_placement_count_must_match_mesh_rank(self):
        one = ((Shard(0),),)
        with self.assertRaisesRegex(
            ValueError, r"in_placements\[0\] has 1 placements but the mesh has 2 axes \('data', 'model'\)"
        ):
            hops.local_map(double, mesh=MESH, in_placements=one, out_placements=(Shard(0), Replicate()))
        three = (Shard(0), Replicate(), Replicate())
        with self.assertRaisesRegex(ValueError, r"has 3 placements but the mesh has 2 axes"):
            hops.local_map(double, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=three)

    def test_placement_count_error_names_out_placements(self):
        # Was a bug: _normalize validates every placements tuple as LocalMapSpec "in_placements[0]",
        # so a bad out_placements / in_grad_placements is reported as in_placements[0].
        three = (Shard(0), Replicate(), Replicate())
        with self.assertRaisesRegex(ValueError, r"out_placements.* has 3 placements but the mesh has 2 axes"):
            hops.local_map(double, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=three)

    def test_placements_must_be_placement_objects_not_axis_names(self):
        with self.assertRaisesRegex(TypeError, r"^local_map\(double\): in_placements\[0\]\[0\] must be placements.*got 'data'"):
            hops.local_map(double, mesh=MESH, in_placements=(("data", None),), out_placements=(Shard(0), Replicate()))
        with self.assertRaisesRegex(TypeError, r"^local_map\(double\): out_placements\[0\] must be placements.*got 'model'"):
            hops.local_map(double, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=("model",))
        with self.assertRaisesRegex(TypeError, r"Shard\(dim\) must be an int, got str 'data'"):
            Shard("data")
        with self.assertRaisesRegex(ValueError, r"Partial\(reduce_op\) must be one of .*got 'prod'"):
            Partial("prod")

    def test_shard_dim_out_of_range_for_the_input(self):
        f = hops.local_map(double, mesh=LINE, in_placements=((Shard(2),),), out_placements=(Shard(0),))
        with self.assertRaisesRegex(
            ValueError,
            r"^local_map\(double\): args\[0\] \(in_placements\[0\]\): placement hops.Shard\(2\) on mesh axis 'x' shards dim 2, "
            r"but the tensor has rank 2",
        ):
            f(spread((4, 6)))

    def test_shard_dim_out_of_range_for_an_output(self):
        def column_sums(x):
            return x.sum(0)

        f = hops.local_map(column_sums, mesh=LINE, in_placements=ROWS, out_placements=(Shard(1),))
        with self.assertRaisesRegex(
            ValueError,
            r"^local_map\(column_sums\): output\[0\]: placement hops.Shard\(1\) on mesh axis 'x' shards dim 1, "
            r"but the tensor has rank 1",
        ):
            f(spread((4, 6)))

    def test_uneven_split_names_the_input_and_dim(self):
        f = hops.local_map(
            matmul,
            mesh=MESH,
            in_placements=((Replicate(), Replicate()), (Shard(1), Shard(1))),
            out_placements=(Shard(1), Shard(1)),
        )
        with self.assertRaisesRegex(
            ValueError,
            r"^local_map\(matmul\): args\[1\] \(in_placements\[1\]\): dim 1 has size 6, which does not split evenly over mesh axes "
            r"\['data', 'model'\] \(4 ways\); local_map needs even shards",
        ):
            f(spread((4, 3)), spread((3, 6)))

    def test_number_of_arguments_must_match_in_placements(self):
        f = hops.local_map(matmul, mesh=LINE, in_placements=((Shard(0),), (Replicate(),)), out_placements=(Shard(0),))
        # torch's local_map raises AssertionError here; ours is also a ValueError.
        for error in (AssertionError, ValueError):
            with self.assertRaisesRegex(
                error, r"^local_map\(matmul\): in_placements length 2 does not match the number of input args 1"
            ):
                f(spread((4, 6)))

    def test_a_tensor_with_none_placements_is_whole_on_every_device(self):
        # As torch's local_map passes a plain tensor as is: every device sees all of it.
        f = hops.local_map(matmul, mesh=LINE, in_placements=((Shard(0),), None), out_placements=(Shard(0),))
        x, w = requiring_grad(spread((4, 6)), spread((6, 2)))
        self.assertEqual(f(x, w), x @ w)
        self.assertEqual(torch.autograd.grad(f(x, w).sum(), w), torch.autograd.grad((x @ w).sum(), w))

    def test_placements_for_a_non_tensor_argument(self):
        def scaled(x, scale):
            return x * scale

        f = hops.local_map(scaled, mesh=LINE, in_placements=((Shard(0),), (Replicate(),)), out_placements=(Shard(0),))
        with self.assertRaisesRegex(
            TypeError,
            r"^local_map\(scaled\): in_placements gives placements for args\[1\], which is a float, not a tensor; use None",
        ):
            f(spread((4, 6)), 2.0)

    def test_placements_tree_must_match_the_argument(self):
        def first(inputs):
            return inputs["a"] * 2

        f = hops.local_map(
            first, mesh=LINE, in_placements=({"a": (Shard(0),), "c": (Shard(0),)},), out_placements=(Shard(0),)
        )
        with self.assertRaisesRegex(ValueError, r"^local_map\(first\): in_placements\[0\] does not match its argument"):
            f({"a": spread((4, 6)), "b": spread((4, 6))})

    def test_body_output_structure_must_match_out_placements(self):
        def pair(x):
            return x * 2, x * 3

        f = hops.local_map(pair, mesh=LINE, in_placements=ROWS, out_placements=(Shard(0),))
        with self.assertRaisesRegex(
            ValueError, r"^local_map\(pair\): returned \('Tensor', 'Tensor'\), which does not match out_placements: 1 placements for 2"
        ):
            f(spread((4, 6)))

    def test_body_must_return_tensors(self):
        def count(x):
            return 3.0

        f = hops.local_map(count, mesh=LINE, in_placements=ROWS, out_placements=(Replicate(),))
        with self.assertRaisesRegex(
            TypeError, r"^local_map\(count\): returned float, which does not match out_placements"
        ):
            f(spread((4, 6)))

    def test_out_placements_need_one_entry_per_flattened_output(self):
        # None is a non-tensor output's entry: double returns one tensor, not two values.
        f = hops.local_map(double, mesh=LINE, in_placements=ROWS, out_placements=((Shard(0),), None))
        with self.assertRaisesRegex(ValueError, r"^local_map\(double\): returned Tensor, which does not match out_placements"):
            f(spread((4, 6)))
        with self.assertRaisesRegex(ValueError, r"local_map\(double\): out_placements gives placements for no tensor output"):
            hops.local_map(double, mesh=LINE, in_placements=ROWS, out_placements=(None,))

    def test_mesh_must_be_a_hops_mesh(self):
        with self.assertRaisesRegex(TypeError, r"local_map\(double\): the mesh must be a hops.Mesh or a DeviceMesh, got tuple"):
            hops.local_map(double, mesh=(2, 2), in_placements=ROWS, out_placements=(Shard(0),))

    def test_in_grad_placements_needs_one_entry_per_argument(self):
        with self.assertRaisesRegex(
            ValueError, r"local_map\(matmul\): in_grad_placements has 1 entries but in_placements has 2"
        ):
            hops.local_map(
                matmul,
                mesh=LINE,
                in_placements=((Shard(0),), (Replicate(),)),
                out_placements=(Shard(0),),
                in_grad_placements=((Shard(0),),),
            )

    def test_hand_built_spec_is_checked_against_its_mesh_and_the_tensors(self):
        with self.assertRaisesRegex(ValueError, r"in_placements\[0\] has 1 placements but the mesh has 2 axes"):
            LocalMapSpec(MESH, ((Shard(0),),), ((Shard(0), Replicate()),))
        with self.assertRaisesRegex(ValueError, r"in_grad_placements has 2 entries but there are 1 tensor inputs"):
            LocalMapSpec(LINE, ((Shard(0),),), ((Shard(0),),), ((Shard(0),), (Shard(0),)))
        spec = LocalMapSpec(LINE, ((Shard(0),),), ((Shard(0),),))
        x = spread((4, 6))
        with self.assertRaisesRegex(ValueError, r"^local_map\(double\): 2 tensor inputs but in_placements has 1 entries"):
            hops.local_map_hop(_named_double, x, x, spec)
        with self.assertRaisesRegex(TypeError, r"^local_map: the last argument of hops_local_map\(body, \*operands, spec\) must be a hops.LocalMapSpec, got Tensor"):
            hops.local_map_hop(_named_double, x)
        with self.assertRaisesRegex(ValueError, r"^local_map\(double\): tensors\[0\]: dim 0 has size 3"):
            hops.local_map_hop(_named_double, spread((3, 6)), spec)
        self.assertEqual(hops.local_map_hop(_named_double, x, spec), (x * 2,))

    def test_body_mutating_an_input_raises_eager_and_traced(self):
        f = hops.local_map(scale_in_place, mesh=LINE, in_placements=ROWS, out_placements=(Shard(0),))
        functional = torch.func.functionalize(f, remove="mutations_and_views")
        x = spread((4, 6))
        for run in (
            lambda: f(x),
            lambda: make_fx(f)(x),
            lambda: make_fx(f, tracing_mode="fake")(x),
            lambda: make_fx(functional)(x),
            lambda: make_fx(functional, tracing_mode="fake")(x),
        ):
            with self.assertRaisesRegex(
                ValueError, r"^local_map\(scale_in_place\): the body writes into its input args\[0\] in place"
            ):
                run()
        self.assertEqual(x, spread((4, 6)))

    def test_body_mutating_a_view_of_an_input_raises(self):
        def zero_first_row(x):
            x[0].zero_()
            return x + 1

        f = hops.local_map(zero_first_row, mesh=LINE, in_placements=ROWS, out_placements=(Shard(0),))
        x = spread((4, 6))
        for run in (lambda: f(x), lambda: make_fx(f, tracing_mode="fake")(x)):
            with self.assertRaisesRegex(ValueError, r"local_map\(zero_first_row\): the body writes into its input"):
                run()

    def test_a_body_returning_a_view_of_its_input_gets_a_copy_eager_and_traced(self):
        f = hops.local_map(view_of, mesh=LINE, in_placements=ROWS, out_placements=(Shard(1),))
        x = spread((4, 6))
        expected = torch.cat([x[:2].t(), x[2:].t()], dim=1)
        out = f(x)
        self.assertEqual(out, expected)
        self.assertNotEqual(out.untyped_storage()._cdata, x.untyped_storage()._cdata)
        for mode in ("real", "fake", "symbolic"):
            self.assertEqual(make_fx(f, tracing_mode=mode)(x)(x), expected)
        functional = torch.func.functionalize(f, remove="mutations_and_views")
        self.assertEqual(make_fx(functional, tracing_mode="fake")(x)(x), expected)

    def test_mutating_a_local_copy_is_fine(self):
        def scaled(x):
            y = x.clone()
            y.mul_(3)
            return y

        f = hops.local_map(scaled, mesh=LINE, in_placements=ROWS, out_placements=(Shard(0),))
        x = spread((4, 6))
        self.assertEqual(f(x), 3 * x)
        self.assertEqual(make_fx(f)(x)(x), 3 * x)


# --------------------------------------------------------------------------- 5. graphs


class TestGraphs(TestCase):
    def test_make_fx_functionalized(self):
        def scaled_softmax(x):
            y = x.clone()
            y.mul_(0.5)
            return y.softmax(-1)

        region = hops.local_map(
            scaled_softmax, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=(Shard(0), Replicate())
        )

        def program(x):
            y = x.clone()
            y.add_(1)
            z = region(y)
            z.mul_(3)
            return z

        x = spread((4, 6))
        gm = make_fx(torch.func.functionalize(program, remove="mutations_and_views"))(x)
        self.assertExpectedInline(readable(gm), """\
class program(torch.nn.Module):
    def forward(self, x_1: "f32[4, 6]"):
        clone: "f32[4, 6]" = torch.ops.aten.clone.default(x_1)
        add: "f32[4, 6]" = torch.ops.aten.add.Tensor(clone, 1)
        scaled_softmax_body_0 = self.scaled_softmax_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(scaled_softmax_body_0, add, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'S(0)R'))
        getitem: "f32[4, 6]" = hops_local_map[0]
        mul: "f32[4, 6]" = torch.ops.aten.mul.Tensor(getitem, 3)
        return mul
    class scaled_softmax_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 6]"):
            clone: "f32[2, 6]" = torch.ops.aten.clone.default(arg0_1)
            mul: "f32[2, 6]" = torch.ops.aten.mul.Tensor(clone, 0.5)
            _softmax: "f32[2, 6]" = torch.ops.aten._softmax.default(mul, -1, False)
            return (_softmax,)
""")
        self.assertEqual(subgraph_names(gm), ["scaled_softmax_body_0"])
        self.assertEqual(gm(x), program(x))

    def test_two_regions_of_one_function_get_numbered_subgraphs(self):
        def program(q, k, v):
            return sharded_attention(sharded_attention(q, k, v), k, v)

        q, k, v = spread((4, 6), 1), spread((6, 6), 2), spread((6, 6), 3)
        gm = make_fx(program)(q, k, v)
        self.assertEqual(subgraph_names(gm), ["attention_body_0", "attention_body_1"])
        self.assertEqual(gm(q, k, v), program(q, k, v))

    def test_spec_is_a_typed_literal_node_arg(self):
        gm = make_fx(sharded_attention)(*attention_inputs())
        (node,) = local_map_nodes(gm)
        self.assertEqual(
            node.args[-1],
            LocalMapSpec(
                MESH,
                ((Shard(0), Replicate()), (Replicate(), Replicate()), (Replicate(), Replicate())),
                ((Shard(0), Replicate()),),
            ),
        )
        self.assertIsInstance(node.args[0], torch.fx.Node)
        self.assertEqual(node.args[0].op, "get_attr")

    def test_generated_code_runs_deep_copies_and_prints(self):
        q, k, v = attention_inputs()
        gm = make_fx(sharded_attention)(q, k, v)
        self.assertEqual(list(generated_code(gm)), ["", "attention_body_0"])
        clone = copy.deepcopy(gm)
        self.assertEqual(clone(q, k, v), gm(q, k, v))
        self.assertEqual(list(generated_code(clone)), ["", "attention_body_0"])
        self.assertIn("class attention_body_0(torch.nn.Module):", readable(clone))
        self.assertIn("hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR, RR', 'S(0)R')", readable(clone))
        (node,) = local_map_nodes(clone)
        self.assertEqual(node.args[-1], local_map_nodes(gm)[0].args[-1])
        # The subgraph alone is the per-device body: device 0's rows in, its rows out.
        self.assertEqual(gm.attention_body_0(q[:2], k, v), (attention(q[:2], k, v),))

    def test_pickled_graph_runs(self):
        q, k, v = attention_inputs()
        gm = make_fx(sharded_attention)(q, k, v)
        clone = pickle.loads(pickle.dumps(gm))
        self.assertEqual(clone(q, k, v), gm(q, k, v))
        (node,) = local_map_nodes(clone)
        self.assertEqual(node.args[-1], local_map_nodes(gm)[0].args[-1])

    def test_retracing_a_traced_graph_keeps_the_user_function_name(self):
        # Was a bug: the subgraph make_fx records is a GraphModule whose class is "<lambda>"
        # (make_fx's varargs wrapper), so tracing the traced graph again names the region
        # "lambda_body_0", and errors raised when running it name "lambda".
        q, k, v = attention_inputs()
        gm = make_fx(sharded_attention)(q, k, v)
        again = make_fx(gm)(q, k, v)
        self.assertEqual(subgraph_names(again), ["attention_body_0"])

    def test_errors_from_a_traced_graph_name_the_user_function(self):
        gm = make_fx(sharded_attention)(*attention_inputs())
        with self.assertRaisesRegex(ValueError, r"^local_map\(attention\): tensors\[0\]: dim 0 has size 5"):
            gm(spread((5, 8)), spread((6, 8)), spread((6, 8)))


# --------------------------------------------------------------------------- 6. meta-free


class TestMetaFree(TestCase):
    def test_graphs_without_meta_run_and_regenerate_the_same_code(self):
        q, k, v = attention_inputs()
        for gm in (make_fx(sharded_attention)(q, k, v), make_fx(sharded_attention, tracing_mode="fake")(q, k, v)):
            expected = gm(q, k, v)
            code = generated_code(gm)
            stripped = copy.deepcopy(gm)
            delete_meta(stripped)
            for module in stripped.modules():
                if isinstance(module, torch.fx.GraphModule):
                    self.assertEqual(module.meta, {})
                    self.assertTrue(all(not n.meta for n in module.graph.nodes))
                    module.recompile()
            self.assertEqual(generated_code(stripped), code)
            self.assertEqual(stripped(q, k, v), expected)
            # Tracing the meta-free graph again gives the same numbers.
            self.assertEqual(make_fx(stripped)(q, k, v)(q, k, v), expected)

    def test_aot_graphs_without_meta_run(self):
        q, k, v = requiring_grad(*attention_inputs())
        forward, backward, out = aot_graphs(sharded_attention, q, k, v)
        primals = [t.detach() for t in (q, k, v)]
        expected_forward = forward(*primals)
        delete_meta(forward)
        forward.recompile()
        self.assertEqual(forward(*primals), expected_forward)


# --------------------------------------------------------------------------- regressions


class TestRegressions(TestCase):
    def test_gradient_of_a_residual_body(self):
        # Was a bug: the local gradient of `x + 1` is the cotangent itself; the backward region
        # returns it and its alias check raises "shift_bwd returns output 0, which aliases".
        def shift(x):
            return x + 1

        f = hops.local_map(shift, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        x = requiring_grad(spread((4, 6)))[0]
        f(x).sum().backward()
        self.assertEqual(x.grad, torch.ones_like(x))

    def test_gradient_of_a_bare_reduction(self):
        # Was a bug: the local gradient of `x.sum(0)` is an expand (a view) of the cotangent.
        def column_sums(x):
            return x.sum(0)

        f = hops.local_map(column_sums, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Partial(),))
        x = requiring_grad(spread((4, 6)))[0]
        aot_graphs(f, x)
        self.assertEqual(x.grad, torch.ones_like(x))

    def test_empty_local_shards_are_not_mistaken_for_aliases(self):
        # Was a bug: simulate() compares storage data_ptr()s, which are all 0 for empty tensors.
        f = hops.local_map(double, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        x = torch.randn(4, 0)
        self.assertEqual(f(x), x * 2)

    def test_dict_outputs_match_out_placements_whatever_their_key_order(self):
        # Was a bug: the body's output tree is compared with out_placements' by TreeSpec, which
        # includes dict key order.
        def split(x):
            return {"b": x * 2, "a": x * 3}

        f = hops.local_map(
            split, mesh=LINE, in_placements=((Shard(0),),), out_placements={"a": (Shard(0),), "b": (Shard(0),)}
        )
        x = spread((4, 6))
        out = f(x)
        self.assertEqual((out["a"], out["b"]), (3 * x, 2 * x))

    def test_an_output_that_gets_no_gradient_needs_no_gradient_layout(self):
        # Was a limitation: backward transposes every output's placements, even outputs the loss
        # does not use (their cotangents are materialized zeros), so a Partial("max") output
        # blocks all gradients; the error's hint, "give in_grad_placements", cannot help.
        def stats(x):
            return x * 2, x.amax(0)

        f = hops.local_map(
            stats, mesh=LINE, in_placements=((Shard(0),),), out_placements=((Shard(0),), (Partial("max"),))
        )
        x = requiring_grad(spread((4, 6)))[0]
        doubled, _ = f(x)
        doubled.sum().backward()
        self.assertEqual(x.grad, torch.full_like(x, 2.0))


if __name__ == "__main__":
    pytest.main([__file__])


# --------------------------------------------------------------------------- alternatives


def row_scale(x, w):  # x (4, 4), w (4,)
    return x * w


ON_MODEL = hops.RegionPlacements("RS(0), RR", "RS(0)", cost_hint=0.5)


def scaled_region(**kwargs):
    # Rows sharded over "data" (option 0) or over "model" (option 1): both give the body a
    # (2, 4) slice of a (4, 4) input, so either option runs the same traced body.
    return hops.local_map(
        row_scale,
        mesh=MESH,
        in_placements=((Shard(0), Replicate()), (Replicate(), Replicate())),
        out_placements=((Shard(0), Replicate()),),
        **kwargs,
    )


def region_spec(gm):
    (node,) = local_map_nodes(gm)
    return node.args[-1]


def choose(gm, index):
    """Make the graph's one region run its alternative ``index``, as ``apply_placements`` does."""
    (node,) = local_map_nodes(gm)
    node.args = (*node.args[:-1], node.args[-1].choose(index))
    gm.recompile()


class TestAlternatives(TestCase):
    def test_spec_records_every_option_and_runs_the_first(self):
        region = hops.local_map(
            row_scale,
            mesh=MESH,
            in_placements=((Shard(0), Replicate()), (Replicate(), Replicate())),
            out_placements=((Shard(0), Replicate()),),
            alternatives=[{"in_placements": "RS(0), RR", "out_placements": "RS(0)", "cost_hint": 2}],
        )
        x, w = spread((4, 4)), spread((4,), seed=1)
        gm = make_fx(region)(x, w)
        spec = region_spec(gm)
        self.assertExpectedInline(repr(spec), """\
hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)R, RR', 'S(0)R', alternatives=(hops.RegionPlacements('S(0)R, RR', 'S(0)R'), hops.RegionPlacements('RS(0), RR', 'RS(0)', cost_hint=2.0)))""")
        self.assertEqual(spec.active, 0)
        self.assertEqual(hops.spec_from_text(repr(spec)), spec)
        self.assertEqual(gm(x, w), x * w)
        self.assertEqual(region(x, w), x * w)

    def test_each_option_runs_its_own_placements(self):
        # Option 1 puts device (i, j)'s block back at block (j, i): an identity body then
        # transposes the blocks, which tells which option ran.
        region = hops.local_map(
            torch.clone,
            mesh=MESH,
            in_placements=((Shard(0), Shard(1)),),
            out_placements=((Shard(0), Shard(1)),),
            alternatives=[hops.RegionPlacements("S(0)S(1)", "S(1)S(0)")],
        )
        x = spread((4, 4))
        gm = make_fx(region)(x)
        self.assertEqual(gm(x), x)
        choose(gm, 1)
        blocks = x.reshape(2, 2, 2, 2).permute(2, 1, 0, 3).reshape(4, 4)
        self.assertEqual(gm(x), blocks)
        self.assertEqual(blocks[:2, 2:], x[2:, :2])

    def test_choose_keeps_alternatives_and_refuses_out_of_range(self):
        region = scaled_region(alternatives=[ON_MODEL])
        spec = region_spec(make_fx(region)(spread((4, 4)), spread((4,), seed=1)))
        chosen = spec.choose(1)
        self.assertEqual(chosen.active, 1)
        self.assertEqual(chosen.alternatives, spec.alternatives)
        self.assertEqual(chosen.in_placements, ((Replicate(), Shard(0)), (Replicate(), Replicate())))
        self.assertEqual(chosen.choose(0), spec)
        with self.assertRaisesRegex(IndexError, r"choose\(2\).*2 alternatives"):
            spec.choose(2)
        with self.assertRaisesRegex(IndexError, r"choose\(True\)"):
            spec.choose(True)

    def test_gradients_match_for_every_option(self):
        region = scaled_region(alternatives=[ON_MODEL])
        x, w = requiring_grad(spread((4, 4)), spread((4,), seed=1))
        expected = torch.autograd.grad((x * w * spread((4, 4), seed=2)).sum(), (x, w))
        gm = make_fx(region)(x.detach(), w.detach())
        for index in (0, 1):
            choose(gm, index)
            got = torch.autograd.grad((gm(x, w) * spread((4, 4), seed=2)).sum(), (x, w))
            self.assertEqual(got, expected)

    def test_backward_regions_carry_the_options_in_order(self):
        region = scaled_region(alternatives=[ON_MODEL])
        x, w = requiring_grad(spread((4, 4)), spread((4,), seed=1))
        forward, backward, _ = aot_graphs(lambda x, w: region(x, w), x, w)
        forward_spec, backward_spec = region_spec(forward), region_spec(backward)
        self.assertEqual(len(forward_spec.alternatives), 2)
        self.assertEqual(len(backward_spec.alternatives), 2)
        self.assertEqual(forward_spec.active, 0)
        self.assertEqual(backward_spec.active, 0)
        self.assertEqual(forward_spec.alternatives[1].cost_hint, 0.5)
        # Each option's backward takes that option's cotangent layout (its last input).
        cotangents = [option.cotangent_placement(0) for option in forward_spec.options()]
        self.assertNotEqual(cotangents[0], cotangents[1])
        self.assertEqual([o.in_placements[-1] for o in backward_spec.alternatives], cotangents)

    def test_closures_lift_into_every_option(self):
        scale = spread((4,), seed=3)

        def scaled(x):
            return x * scale

        region = hops.local_map(
            scaled, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=((Shard(0), Replicate()),),
            alternatives=[hops.RegionPlacements("RS(0)", "RS(0)")],
        )
        x = spread((4, 4))
        spec = region_spec(make_fx(region)(x))
        self.assertEqual([len(o.in_placements) for o in spec.alternatives], [2, 2])
        self.assertEqual(spec.alternatives[1].in_placements[1], (Replicate(), Replicate()))

    def test_dynamo_keeps_the_alternatives(self):
        region = scaled_region(alternatives=[ON_MODEL])
        graphs = []

        def backend(gm, inputs):
            graphs.append(gm)
            return gm

        x, w = spread((4, 4)), spread((4,), seed=1)
        out = torch.compile(lambda x, w: region(x, w), backend=backend, fullgraph=True)(x, w)
        self.assertEqual(out, x * w)
        (spec,) = [a for g in graphs for n in g.graph.nodes for a in n.args if isinstance(a, LocalMapSpec)]
        self.assertEqual(len(spec.alternatives), 2)
        self.assertEqual(spec.alternatives[1].cost_hint, 0.5)

    def test_bad_alternatives_are_refused_by_name(self):
        x, w = spread((4, 4)), spread((4,), seed=1)
        cases = [
            (ON_MODEL, TypeError, r"alternatives must be a list"),
            ([{"in_placements": "RS(1), R"}], TypeError, r"alternative 1 must be .*out_placements required"),
            ([{"out_placements": "S(0)R", "bogus": 1}], TypeError, r"alternative 1 must be"),
            ([hops.RegionPlacements("S(0)R, RR", "S(0)R")], ValueError, r"alternatives 0 and 1 have the same placements"),
            ([hops.RegionPlacements("S(0)R", "S(0)R")], ValueError, r"^local_map\(row_scale, alternative 1\): in_placements length 1 does not match"),
            # Other local shapes are allowed, but the body must run on them: w (4,) does not
            # broadcast against a (2, 2) block.
            ([hops.RegionPlacements("S(0)S(1), RR", "S(0)S(1)")], ValueError, r"alternative 1 .* body fails on that alternative's local shapes"),
            ([hops.RegionPlacements("RS(0), RR", "S(0)S(1)")], ValueError, r"^local_map\(row_scale\): output\[0\]: alternative 1 .* same global shapes"),
        ]
        for alternatives, error, message in cases:
            with self.subTest(alternatives=alternatives), self.assertRaisesRegex(error, message):
                scaled_region(alternatives=alternatives)(x, w)
        with self.assertRaisesRegex(ValueError, r"cost_hint=.*seconds >= 0, got -1"):
            hops.RegionPlacements("R", "R", cost_hint=-1)
        with self.assertRaisesRegex(ValueError, r"own placements must be one of its alternatives"):
            LocalMapSpec(LINE, "S(0)", "S(0)", alternatives=(hops.RegionPlacements("S(1)", "S(1)"),))
        with self.assertRaisesRegex(TypeError, r"alternatives\[0\]\) must be a hops.RegionPlacements"):
            LocalMapSpec(LINE, "S(0)", "S(0)", alternatives=("S(1)",))
