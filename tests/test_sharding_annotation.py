"""sharding_annotation_hop: semantics, every dispatch key, and every frontend's graph."""

import copy
import pickle

import pytest
import torch
from snapshot import TestCase, aot_trace, compile_trace, delete_meta, readable, strip_detach
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLS = ShardingSpec(MESH, (Replicate(), Shard(1)))


def scaled_sin(x):
    return hops.annotate_sharding(x * 2, ROWS).sin()


def with_grad_spec(x):
    return hops.annotate_sharding(x * 2, ROWS, grad_spec=COLS).sin()


class ScaledSin(torch.nn.Module):
    def forward(self, x):
        return scaled_sin(x)


def aot_graphs(fn, *args):
    forward, backward, _ = aot_trace(fn, *args)
    return forward, backward


class TestSemantics(TestCase):
    def test_value_is_identity_and_does_not_alias(self):
        x = torch.randn(4, 6)
        out = hops.annotate_sharding(x, ROWS)
        self.assertEqual(out, x)
        self.assertNotEqual(out.data_ptr(), x.data_ptr())
        before = x.clone()
        out.add_(1)
        self.assertEqual(x, before)

    def test_gradient_is_identity_gradcheck(self):
        x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradgradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradcheck(with_grad_spec, (x,)))

    def test_gradient_matches_unannotated_reference(self):
        x = torch.randn(4, 6, requires_grad=True)
        scaled_sin(x).sum().backward()
        reference = x.detach().clone().requires_grad_()
        (reference * 2).sin().sum().backward()
        self.assertEqual(x.grad, reference.grad)

    def test_bad_inputs_raise_early_naming_the_argument(self):
        x = torch.randn(4, 6)
        with self.assertRaisesRegex(TypeError, r"annotate_sharding\(x=...\) must be a Tensor"):
            hops.annotate_sharding([1.0], ROWS)
        with self.assertRaisesRegex(TypeError, r"annotate_sharding\(spec=...\) must be a hops.ShardingSpec"):
            hops.annotate_sharding(x, ("data", None))
        with self.assertRaisesRegex(TypeError, r"annotate_sharding\(grad_spec=...\)"):
            hops.annotate_sharding(x, ROWS, grad_spec="cols")
        with self.assertRaisesRegex(ValueError, r"annotate_sharding\(spec=...\).*shards dim 1.*rank 1"):
            hops.annotate_sharding(torch.randn(4), COLS)
        with self.assertRaisesRegex(ValueError, r"annotate_sharding\(grad_spec=...\).*rank 1"):
            hops.annotate_sharding(torch.randn(4), ROWS, grad_spec=COLS)
        # Under tracing the same checks fire before any graph is built.
        with self.assertRaisesRegex(ValueError, r"annotate_sharding\(spec=...\)"):
            make_fx(lambda t: hops.annotate_sharding(t, COLS), tracing_mode="fake")(torch.randn(4))


class TestMakeFx(TestCase):
    def test_make_fx_real(self):
        x = torch.randn(4, 4)
        gm = make_fx(scaled_sin)(x)
        self.assertExpectedInline(readable(gm), """\
class scaled_sin(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x_1, 2);  x_1 = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation);  hops_sharding_annotation = None
        return sin
""")
        self.assertEqual(gm(x), scaled_sin(x))

    def test_make_fx_fake(self):
        gm = make_fx(scaled_sin, tracing_mode="fake")(torch.randn(4, 4))
        self.assertExpectedInline(readable(gm), """\
class scaled_sin(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x_1, 2);  x_1 = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation);  hops_sharding_annotation = None
        return sin
""")

    def test_make_fx_symbolic(self):
        gm = make_fx(scaled_sin, tracing_mode="symbolic")(torch.randn(4, 6))
        self.assertExpectedInline(readable(gm), """\
class scaled_sin(torch.nn.Module):
    def forward(self, x_1: "f32[s75, s96]"):
        mul: "f32[s75, s96]" = torch.ops.aten.mul.Tensor(x_1, 2);  x_1 = None
        hops_sharding_annotation: "f32[s75, s96]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[s75, s96]" = torch.ops.aten.sin.default(hops_sharding_annotation);  hops_sharding_annotation = None
        return sin
""")
        x = torch.randn(8, 2)
        self.assertEqual(gm(x), scaled_sin(x))

    def test_make_fx_functionalized(self):
        def mutating(x):
            y = x.clone()
            y.add_(1)
            z = hops.annotate_sharding(y, ROWS)
            z.mul_(3)
            return z

        x = torch.randn(4, 4)
        gm = make_fx(torch.func.functionalize(mutating, remove="mutations_and_views"))(x)
        self.assertExpectedInline(readable(gm), """\
class mutating(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        clone: "f32[4, 4]" = torch.ops.aten.clone.default(x_1);  x_1 = None
        add: "f32[4, 4]" = torch.ops.aten.add.Tensor(clone, 1);  clone = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(add, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  add = None
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation, 3);  hops_sharding_annotation = None
        return mul
""")
        self.assertEqual(gm(x), mutating(x))

    def test_grad_spec_is_a_third_arg_and_swaps_in_backward(self):
        def joint(x):
            x = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(with_grad_spec(x).sum(), x)
            return grad_x

        x = torch.randn(4, 4)
        gm = strip_detach(make_fx(joint)(x))
        self.assertExpectedInline(readable(gm), """\
class joint(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x_1, 2);  x_1 = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())), hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Replicate(), hops.Shard(1))));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        sum_1: "f32[]" = torch.ops.aten.sum.default(sin);  sin = None
        ones_like: "f32[]" = torch.ops.aten.ones_like.default(sum_1, pin_memory = False, memory_format = torch.preserve_format);  sum_1 = None
        expand: "f32[4, 4]" = torch.ops.aten.expand.default(ones_like, [4, 4]);  ones_like = None
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation);  hops_sharding_annotation = None
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(expand, cos);  expand = cos = None
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Replicate(), hops.Shard(1))), hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul_1 = None
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2);  hops_sharding_annotation_1 = None
        return mul_2
""")

    def test_generated_code_runs_deep_copies_and_pickles(self):
        x = torch.randn(4, 4)
        gm = make_fx(scaled_sin)(x)
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
            self.assertEqual(clone(x), scaled_sin(x))
            node = next(n for n in clone.graph.nodes if n.target is hops.sharding_annotation_hop)
            self.assertEqual(node.args[1], ROWS)
            self.assertIsInstance(node.args[1], ShardingSpec)


class TestAOTAutograd(TestCase):
    def test_forward_and_backward_graphs_carry_the_annotation(self):
        x = torch.randn(4, 4, requires_grad=True)
        forward, backward = aot_graphs(scaled_sin, x)
        self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(primals_1, 2);  primals_1 = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return (sin, hops_sharding_annotation)
""")
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, hops_sharding_annotation: "f32[4, 4]", tangents_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation);  hops_sharding_annotation = None
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos);  tangents_1 = cos = None
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul_1 = None
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2);  hops_sharding_annotation_1 = None
        return (mul_2,)
""")

    def test_backward_uses_grad_spec(self):
        x = torch.randn(4, 4, requires_grad=True)
        forward, backward = aot_graphs(with_grad_spec, x)
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, hops_sharding_annotation: "f32[4, 4]", tangents_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation);  hops_sharding_annotation = None
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos);  tangents_1 = cos = None
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Replicate(), hops.Shard(1))), hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul_1 = None
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2);  hops_sharding_annotation_1 = None
        return (mul_2,)
""")


class TestExport(TestCase):
    def test_export_strict(self):
        x = torch.randn(4, 4)
        ep = torch.export.export(ScaledSin(), (x,), strict=True)
        self.assertExpectedInline(readable(ep.graph_module), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation);  hops_sharding_annotation = None
        return (sin,)
""")
        self.assertEqual(ep.module()(x), scaled_sin(x))

    def test_export_non_strict(self):
        x = torch.randn(4, 4)
        ep = torch.export.export(ScaledSin(), (x,), strict=False)
        self.assertExpectedInline(readable(ep.graph_module), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation);  hops_sharding_annotation = None
        return (sin,)
""")
        self.assertEqual(ep.module()(x), scaled_sin(x))


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_dynamo_graph_keeps_the_hop(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        x = torch.randn(4, 4)
        compiled = torch.compile(scaled_sin, backend=backend, fullgraph=True)
        self.assertEqual(compiled(x), scaled_sin(x))
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(readable(graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 4]"):
        l_x_ = L_x_
        mul: "f32[4, 4]" = l_x_ * 2;  l_x_ = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul = None
        sin: "f32[4, 4]" = hops_sharding_annotation.sin();  hops_sharding_annotation = None
        return (sin,)
""")

    def test_aot_graphs_under_torch_compile(self):
        x = torch.randn(4, 4, requires_grad=True)
        graphs, _ = compile_trace(with_grad_spec, x)
        reference = x.detach().clone().requires_grad_()
        with_grad_spec(reference).sum().backward()
        self.assertEqual(x.grad, reference.grad)
        self.assertExpectedInline(readable(graphs["forward"]), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(primals_1, 2);  primals_1 = None
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())), hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Replicate(), hops.Shard(1))));  mul = None
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        return (sin, hops_sharding_annotation)
""")
        self.assertExpectedInline(readable(graphs["backward"]), """\
class GraphModule(torch.nn.Module):
    def forward(self, hops_sharding_annotation: "f32[4, 4]", tangents_1: "f32[4, 4]"):
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation);  hops_sharding_annotation = None
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos);  tangents_1 = cos = None
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Replicate(), hops.Shard(1))), hops.ShardingSpec(mesh=hops.Mesh(shape=(2, 2), axis_names=('data', 'model')), placements=(hops.Shard(0), hops.Replicate())));  mul_1 = None
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2);  hops_sharding_annotation_1 = None
        return (mul_2,)
""")

    def test_a_different_spec_recompiles(self):
        seen = []

        def backend(gm, example_inputs):
            seen.append(next(n.args[1] for n in gm.graph.nodes if n.target is hops.sharding_annotation_hop))
            return gm

        def annotate(x, spec):
            return hops.annotate_sharding(x, spec) + 1

        compiled = torch.compile(annotate, backend=backend, fullgraph=True)
        x = torch.randn(4, 4)
        compiled(x, ROWS)
        compiled(x, ShardingSpec(Mesh((2, 2), ("data", "model")), (Shard(0), Replicate())))
        compiled(x, COLS)
        compiled(x, ROWS)
        # An equal spec built anew reuses the graph; a different spec never does.
        self.assertEqual(seen, [ROWS, COLS])

    def test_spec_built_inside_the_compiled_function(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        def annotate_inline(x):
            spec = ShardingSpec(Mesh((4,), ("x",)), (Shard(1),))
            return hops.annotate_sharding(x, spec) * 2

        x = torch.randn(4, 4)
        compiled = torch.compile(annotate_inline, backend=backend, fullgraph=True)
        self.assertEqual(compiled(x), annotate_inline(x))
        (node,) = [n for n in graphs[0].graph.nodes if n.target is hops.sharding_annotation_hop]
        self.assertEqual(node.args[1], ShardingSpec(Mesh((4,), ("x",)), (Shard(1),)))


class TestMetaFree(TestCase):
    """Meaning lives in node args: deleting every meta dict changes no pass's result."""

    def test_passes_ignore_meta(self):
        x = torch.randn(4, 4, requires_grad=True)
        forward, backward = aot_graphs(with_grad_spec, x)
        for graph in (make_fx(scaled_sin)(x.detach()), forward, backward):
            for run_pass in (passes.inline_hops, passes.lower_to_xla):
                with_meta = run_pass(copy.deepcopy(graph))
                stripped = copy.deepcopy(graph)
                delete_meta(stripped)
                without_meta = run_pass(stripped)
                self.assertEqual(without_meta.code, with_meta.code)


if __name__ == "__main__":
    pytest.main([__file__])
