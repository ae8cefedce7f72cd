"""sharding_annotation_hop: semantics, gradient layouts, errors, and Dynamo's guards.

Every frontend's graph of an annotation is in ``tests.helpers.hop_db.Annotation`` (``test_frontends.py``)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import TestCase, readable, strip_detach

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))
COLS = ShardingSpec(MESH, (Replicate(), Shard(1)))


def scaled_sin(x):
    return hops.annotate_sharding(x * 2, ROWS).sin()


def with_grad_spec(x):
    return hops.annotate_sharding(x * 2, ROWS, grad_spec=COLS).sin()


class TestSemantics(TestCase):
    def test_value_is_identity_and_does_not_alias(self):
        x = torch.randn(4, 6)
        out = hops.annotate_sharding(x, ROWS)
        self.assertEqual(out, x)
        self.assertNotEqual(out.data_ptr(), x.data_ptr())
        before = x.clone()
        out.add_(1)
        self.assertEqual(x, before)

    def test_gradient_is_identity_to_second_order(self):
        x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradgradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradcheck(with_grad_spec, (x,)))
        self.assertTrue(torch.autograd.gradgradcheck(with_grad_spec, (x,)))

    def test_gradient_matches_unannotated_reference(self):
        x = torch.randn(4, 6, requires_grad=True)
        scaled_sin(x).sum().backward()
        reference = x.detach().clone().requires_grad_()
        (reference * 2).sin().sum().backward()
        self.assertEqual(x.grad, reference.grad)

    def test_the_gradient_layout_is_part_of_the_spec_and_its_transpose_swaps_back(self):
        spec = ShardingSpec(MESH, (Shard(0), Replicate()), (Replicate(), Shard(1)))
        self.assertEqual(spec.grad, ShardingSpec(MESH, "RS(1)", "S(0)R"))
        self.assertEqual(spec.grad.grad, spec)
        self.assertEqual(spec.layout, ROWS)
        self.assertEqual(ROWS.grad, ROWS)  # no gradient layout: the gradient is laid out like the value

    def test_backward_annotates_the_gradient_with_the_transposed_spec(self):
        def joint(x):
            x = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(with_grad_spec(x).sum(), x)
            return grad_x

        gm = strip_detach(make_fx(joint)(torch.randn(4, 4)))
        self.assertExpectedInline(readable(gm), """\
class joint(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(x_1, 2)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R', 'RS(1)'))
        sin: "f32[4, 4]" = torch.ops.aten.sin.default(hops_sharding_annotation)
        sum_1: "f32[]" = torch.ops.aten.sum.default(sin)
        ones_like: "f32[]" = torch.ops.aten.ones_like.default(sum_1, pin_memory = False, memory_format = torch.preserve_format)
        expand: "f32[4, 4]" = torch.ops.aten.expand.default(ones_like, [4, 4])
        cos: "f32[4, 4]" = torch.ops.aten.cos.default(hops_sharding_annotation)
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(expand, cos)
        hops_sharding_annotation_1: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(mul_1, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'RS(1)', 'S(0)R'))
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation_1, 2)
        return mul_2
""")

    def test_functionalization_keeps_the_annotation_between_rewritten_mutations(self):
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
        clone: "f32[4, 4]" = torch.ops.aten.clone.default(x_1)
        add: "f32[4, 4]" = torch.ops.aten.add.Tensor(clone, 1)
        hops_sharding_annotation: "f32[4, 4]" = torch.ops.higher_order.hops_sharding_annotation(add, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(hops_sharding_annotation, 3)
        return mul
""")
        self.assertEqual(gm(x), mutating(x))


class TestBadCalls(TestCase):
    def test_bad_inputs_raise_early_naming_the_argument(self):
        x = torch.randn(4, 6)
        with self.assertRaisesRegex(TypeError, r"^annotate_sharding: x must be a Tensor"):
            hops.annotate_sharding([1.0], ROWS)
        with self.assertRaisesRegex(TypeError, r"^annotate_sharding: spec must be a hops.ShardingSpec"):
            hops.annotate_sharding(x, ("data", None))
        with self.assertRaisesRegex(TypeError, r"^annotate_sharding: grad_spec must be a hops.ShardingSpec"):
            hops.annotate_sharding(x, ROWS, grad_spec="cols")
        with self.assertRaisesRegex(ValueError, r"^annotate_sharding: spec: .*shards dim 1.*rank 1"):
            hops.annotate_sharding(torch.randn(4), COLS)
        with self.assertRaisesRegex(ValueError, r"^annotate_sharding: grad_spec: .*rank 1"):
            hops.annotate_sharding(torch.randn(4), ROWS, grad_spec=COLS)
        with self.assertRaisesRegex(ValueError, r"^annotate_sharding: grad_spec is on .* but spec on"):
            hops.annotate_sharding(x, ROWS, grad_spec=ShardingSpec(Mesh((4,), ("x",)), (Shard(0),)))
        # Under tracing the same checks fire before any graph is built.
        with self.assertRaisesRegex(ValueError, r"^annotate_sharding: spec"):
            make_fx(lambda t: hops.annotate_sharding(t, COLS), tracing_mode="fake")(torch.randn(4))

    def test_placements_text_errors_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, r"ShardingSpec\(placements=...\): cannot read placements 'S\(0\)X'"):
            ShardingSpec(MESH, "S(0)X")
        with self.assertRaisesRegex(ValueError, r"ShardingSpec\(grad_placements=...\) has 1 placements but the mesh has 2"):
            ShardingSpec(MESH, "S(0)R", "R")


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_a_different_spec_recompiles_an_equal_one_does_not(self):
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
        compiled(x, ShardingSpec(MESH, ROWS.placements, COLS.placements))
        # An equal spec built anew reuses the graph; a different spec (or gradient layout) never does.
        self.assertEqual(seen, [ROWS, COLS, ShardingSpec(MESH, ROWS.placements, COLS.placements)])

    def test_spec_built_inside_the_compiled_function(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        def annotate_inline(x):
            spec = ShardingSpec(Mesh((4,), ("x",)), (Shard(1),), (Replicate(),))
            return hops.annotate_sharding(x, spec) * 2

        x = torch.randn(4, 4)
        compiled = torch.compile(annotate_inline, backend=backend, fullgraph=True)
        self.assertEqual(compiled(x), annotate_inline(x))
        (node,) = [n for n in graphs[0].graph.nodes if n.target is hops.sharding_annotation_hop]
        self.assertEqual(node.args[1], ShardingSpec(Mesh((4,), ("x",)), (Shard(1),), (Replicate(),)))
