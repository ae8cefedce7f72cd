"""hops.named_scope: a named region in every frontend's graph, forward and backward, inlined by
inline_hops and lowered to HLO op_name metadata by lower_to_xla."""

import copy
import pickle
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import ScopeSpec
from tests.helpers.snapshot import TestCase, aot_trace, hlo_text, readable


@hops.named_scope("attention")
def attention(q, k, v):
    scores = (q @ k.transpose(-1, -2)).softmax(-1)
    return scores @ v


def block(q, k, v):
    return attention(q, k, v).sin() + 1


@hops.named_scope("layer0")
def layer(x, w):
    # A scope inside a scope, and a kernel call inside both.
    inner = hops.named_scope("mlp")(lambda t: hops.einsum("bi,oi->bo", t, w).tanh())
    return inner(x * 2) + x.sum()


def split_in_two(x, *, parts=2):
    return tuple(x.chunk(parts, -1)[i] * (i + 1) for i in range(parts))


class Block(torch.nn.Module):
    def forward(self, q, k, v):
        return block(q, k, v)


def reference_block(q, k, v):
    return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sin() + 1


def qkv(requires_grad=False, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(2, 3, 4, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def aot_graphs(fn, *args):
    forward, backward, _ = aot_trace(fn, *args)
    return forward, backward


def scope_nodes(gm):
    return [
        (name, node.args[-1].name)
        for name, module in gm.named_modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target is hops.named_scope_hop
    ]


class TestSemantics(TestCase):
    def test_values_are_the_function_s(self):
        q, k, v = qkv()
        self.assertEqual(block(q, k, v), reference_block(q, k, v))
        self.assertEqual(attention.__name__, "attention")
        wrapped = hops.named_scope("parts")(split_in_two)
        x = torch.randn(3, 4)
        self.assertEqual(wrapped(x, parts=2), split_in_two(x, parts=2))
        self.assertIsInstance(wrapped(x), tuple)

    def test_gradients_gradcheck_eager_and_through_aot(self):
        q, k, v = qkv(requires_grad=True, dtype=torch.double)
        self.assertTrue(torch.autograd.gradcheck(block, (q, k, v)))
        self.assertTrue(torch.autograd.gradgradcheck(block, (q, k, v)))
        x, w = torch.randn(3, 4, dtype=torch.double, requires_grad=True), torch.randn(5, 4, dtype=torch.double, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(layer, (x, w)))
        # Through AOTAutograd the backward is the split joint (a second region).
        for fn, args in ((block, qkv(requires_grad=True)), (layer, (x.detach().float().requires_grad_(), w.detach().float().requires_grad_()))):
            aot_graphs(fn, *args)
            references = [a.detach().clone().requires_grad_() for a in args]
            fn(*references).sum().backward()
            for got, expected in zip(args, references):
                self.assertEqual(got.grad, expected.grad)

    def test_names_and_specs(self):
        self.assertEqual(ScopeSpec("attention").backward(), ScopeSpec("attention/bwd"))
        self.assertEqual(eval(repr(ScopeSpec("layer0/mlp")), {"hops": hops}), ScopeSpec("layer0/mlp"))
        self.assertEqual(hash(ScopeSpec("a")), hash(ScopeSpec("a")))


class TestBadCalls(TestCase):
    def test_bad_names_are_refused(self):
        with self.assertRaisesRegex(ValueError, r"ScopeSpec\(name=...\) must be a non-empty str, got ''"):
            hops.named_scope("")
        with self.assertRaisesRegex(TypeError, r"ScopeSpec\(name=...\) must be a str, got int 3"):
            hops.named_scope(3)
        with self.assertRaisesRegex(ValueError, r"'/'-separated non-empty parts .* got 'layer0//mlp'"):
            hops.named_scope("layer0//mlp")
        with self.assertRaisesRegex(ValueError, r"without surrounding whitespace .* got ' attention'"):
            hops.named_scope(" attention")

    def test_a_with_block_is_refused_saying_what_to_write(self):
        # JAX's named_scope is a context manager; a region here is a function.
        with self.assertRaisesRegex(TypeError, r"is a decorator, not a context manager.*@hops.named_scope\('mlp'\)"):
            with hops.named_scope("mlp"):
                pass

    def test_bad_functions_are_refused_naming_them(self):
        with self.assertRaisesRegex(TypeError, r"^named_scope: hops.named_scope\('s'\) must wrap a callable, got str"):
            hops.named_scope("s")("not a function")

        def returns_a_number(x):
            return x.sum().item()

        def returns_a_dict(x):
            return {"y": x * 2}

        def returns_its_input(x):
            return x

        def writes_its_input(x):
            x.mul_(2)
            return x * 1

        x = torch.randn(3)
        with self.assertRaisesRegex(TypeError, r"^named_scope\(returns_a_number\): returned float, expected a Tensor or a pytree of Tensors \(scope 's'\)"):
            hops.named_scope("s")(returns_a_number)(x)
        self.assertEqual(hops.named_scope("s")(returns_a_dict)(x), {"y": x * 2})
        out = hops.named_scope("s")(returns_its_input)(x)
        self.assertEqual(out, x)
        self.assertNotEqual(out.data_ptr(), x.data_ptr())
        self.assertEqual(make_fx(hops.named_scope("s")(returns_its_input))(x)(x), x)
        message = r"^named_scope\(writes_its_input\): the body writes into its input args\[0\] in place"
        for run in (
            lambda: hops.named_scope("s")(writes_its_input)(x),
            lambda: make_fx(hops.named_scope("s")(writes_its_input))(x),
            lambda: make_fx(torch.func.functionalize(hops.named_scope("s")(writes_its_input)))(x),
        ):
            with self.assertRaisesRegex(ValueError, message):
                run()
        self.assertEqual(x, x.clone())

    def test_the_hop_needs_a_scope_spec(self):
        with self.assertRaisesRegex(TypeError, r"^named_scope: the last argument of hops_named_scope\(body, \*operands, spec\) must be a hops.ScopeSpec, got str"):
            hops.named_scope_hop(lambda t: t * 2, torch.randn(2), "attention")


# --------------------------------------------------------------------------- graphs


class TestMakeFx(TestCase):
    def test_make_fx_functionalized(self):
        @hops.named_scope("scaled")
        def scaled(x):
            y = x.clone()
            y.mul_(2)
            return y.relu()

        def mutating(x):
            z = scaled(x)
            z.add_(1)
            return z

        x = torch.randn(4, 4)
        gm = make_fx(torch.func.functionalize(mutating, remove="mutations_and_views"))(x)
        self.assertExpectedInline(readable(gm), """\
class mutating(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        scaled_body_0 = self.scaled_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(scaled_body_0, x_1, hops.ScopeSpec('scaled'))
        getitem: "f32[4, 4]" = hops_named_scope[0]
        add: "f32[4, 4]" = torch.ops.aten.add.Tensor(getitem, 1)
        return add
    class scaled_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[4, 4]"):
            clone: "f32[4, 4]" = torch.ops.aten.clone.default(arg0_1)
            mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(clone, 2)
            relu: "f32[4, 4]" = torch.ops.aten.relu.default(mul)
            return (relu,)
""")
        self.assertEqual(gm(x), mutating(x))


class TestGeneratedCode(TestCase):
    def test_generated_code_runs_deep_copies_and_pickles(self):
        x, w = torch.randn(3, 4), torch.randn(5, 4)
        gm = make_fx(layer)(x, w)
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
            self.assertEqual(clone(x, w), layer(x, w))
            self.assertEqual(scope_nodes(clone), [("", "layer0"), ("layer_body_0", "mlp")])


class TestAOTAutograd(TestCase):
    def test_backward_is_a_region_named_bwd_and_nothing_is_recomputed(self):
        forward, backward = aot_graphs(block, *qkv(requires_grad=True))
        self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[2, 3, 4]", primals_3: "f32[2, 3, 4]"):
        attention_body_0 = self.attention_body_0
        hops_named_scope = torch.ops.higher_order.hops_named_scope(attention_body_0, primals_1, primals_2, primals_3, hops.ScopeSpec('attention'))
        getitem: "f32[2, 3, 4]" = hops_named_scope[0]
        getitem_1: "f32[2, 3, 3]" = hops_named_scope[1]
        sin: "f32[2, 3, 4]" = torch.ops.aten.sin.default(getitem)
        add: "f32[2, 3, 4]" = torch.ops.aten.add.Tensor(sin, 1)
        return (add, primals_1, primals_2, primals_3, getitem, getitem_1)
    class attention_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3, 4]", arg1_1: "f32[2, 3, 4]", arg2_1: "f32[2, 3, 4]"):
            transpose: "f32[2, 4, 3]" = torch.ops.aten.transpose.int(arg1_1, -1, -2)
            expand: "f32[2, 3, 4]" = torch.ops.aten.expand.default(arg0_1, [2, 3, 4])
            view: "f32[2, 3, 4]" = torch.ops.aten.view.default(expand, [2, 3, 4])
            expand_1: "f32[2, 4, 3]" = torch.ops.aten.expand.default(transpose, [2, 4, 3])
            view_1: "f32[2, 4, 3]" = torch.ops.aten.view.default(expand_1, [2, 4, 3])
            bmm: "f32[2, 3, 3]" = torch.ops.aten.bmm.default(view, view_1)
            view_2: "f32[2, 3, 3]" = torch.ops.aten.view.default(bmm, [2, 3, 3])
            _softmax: "f32[2, 3, 3]" = torch.ops.aten._softmax.default(view_2, -1, False)
            expand_2: "f32[2, 3, 3]" = torch.ops.aten.expand.default(_softmax, [2, 3, 3])
            view_3: "f32[2, 3, 3]" = torch.ops.aten.view.default(expand_2, [2, 3, 3])
            expand_3: "f32[2, 3, 4]" = torch.ops.aten.expand.default(arg2_1, [2, 3, 4])
            view_4: "f32[2, 3, 4]" = torch.ops.aten.view.default(expand_3, [2, 3, 4])
            bmm_1: "f32[2, 3, 4]" = torch.ops.aten.bmm.default(view_3, view_4)
            view_5: "f32[2, 3, 4]" = torch.ops.aten.view.default(bmm_1, [2, 3, 4])
            return (view_5, _softmax)
""")
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[2, 3, 4]", primals_3: "f32[2, 3, 4]", getitem: "f32[2, 3, 4]", getitem_1: "f32[2, 3, 3]", tangents_1: "f32[2, 3, 4]"):
        cos: "f32[2, 3, 4]" = torch.ops.aten.cos.default(getitem)
        mul: "f32[2, 3, 4]" = torch.ops.aten.mul.Tensor(tangents_1, cos)
        attention_bwd_body_0 = self.attention_bwd_body_0
        hops_named_scope_1 = torch.ops.higher_order.hops_named_scope(attention_bwd_body_0, primals_1, primals_2, primals_3, getitem_1, mul, hops.ScopeSpec('attention/bwd'))
        getitem_2: "f32[2, 3, 4]" = hops_named_scope_1[0]
        getitem_3: "f32[2, 3, 4]" = hops_named_scope_1[1]
        getitem_4: "f32[2, 3, 4]" = hops_named_scope_1[2]
        return (getitem_2, getitem_3, getitem_4)
    class attention_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 3, 4]", arg1_1: "f32[2, 3, 4]", arg2_1: "f32[2, 3, 4]", arg3_1: "f32[2, 3, 3]", arg4_1: "f32[2, 3, 4]"):
            transpose: "f32[2, 4, 3]" = torch.ops.aten.transpose.int(arg1_1, -1, -2)
            expand: "f32[2, 3, 4]" = torch.ops.aten.expand.default(arg0_1, [2, 3, 4])
            view: "f32[2, 3, 4]" = torch.ops.aten.view.default(expand, [2, 3, 4])
            expand_1: "f32[2, 4, 3]" = torch.ops.aten.expand.default(transpose, [2, 4, 3])
            view_1: "f32[2, 4, 3]" = torch.ops.aten.view.default(expand_1, [2, 4, 3])
            expand_2: "f32[2, 3, 3]" = torch.ops.aten.expand.default(arg3_1, [2, 3, 3])
            view_2: "f32[2, 3, 3]" = torch.ops.aten.view.default(expand_2, [2, 3, 3])
            expand_3: "f32[2, 3, 4]" = torch.ops.aten.expand.default(arg2_1, [2, 3, 4])
            view_3: "f32[2, 3, 4]" = torch.ops.aten.view.default(expand_3, [2, 3, 4])
            view_4: "f32[2, 3, 4]" = torch.ops.aten.view.default(arg4_1, [2, 3, 4])
            transpose_1: "f32[2, 3, 3]" = torch.ops.aten.transpose.int(view_2, 1, 2)
            bmm: "f32[2, 3, 4]" = torch.ops.aten.bmm.default(transpose_1, view_4)
            transpose_2: "f32[2, 4, 3]" = torch.ops.aten.transpose.int(view_3, 1, 2)
            bmm_1: "f32[2, 3, 3]" = torch.ops.aten.bmm.default(view_4, transpose_2)
            view_5: "f32[2, 3, 4]" = torch.ops.aten.view.default(bmm, [2, 3, 4])
            view_6: "f32[2, 3, 3]" = torch.ops.aten.view.default(bmm_1, [2, 3, 3])
            _softmax_backward_data: "f32[2, 3, 3]" = torch.ops.aten._softmax_backward_data.default(view_6, arg3_1, -1, torch.float32)
            view_7: "f32[2, 3, 3]" = torch.ops.aten.view.default(_softmax_backward_data, [2, 3, 3])
            transpose_3: "f32[2, 4, 3]" = torch.ops.aten.transpose.int(view, 1, 2)
            bmm_2: "f32[2, 4, 3]" = torch.ops.aten.bmm.default(transpose_3, view_7)
            transpose_4: "f32[2, 3, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2)
            bmm_3: "f32[2, 3, 4]" = torch.ops.aten.bmm.default(view_7, transpose_4)
            view_8: "f32[2, 4, 3]" = torch.ops.aten.view.default(bmm_2, [2, 4, 3])
            view_9: "f32[2, 3, 4]" = torch.ops.aten.view.default(bmm_3, [2, 3, 4])
            transpose_5: "f32[2, 3, 4]" = torch.ops.aten.transpose.int(view_8, -1, -2)
            return (view_9, transpose_5, view_5)
""")
        self.assertEqual(scope_nodes(forward), [("", "attention")])
        self.assertEqual(scope_nodes(backward), [("", "attention/bwd")])
        # The forward's softmax is a residual: the backward region does not compute it again.
        backward_body = backward.get_submodule("attention_bwd_body_0")
        self.assertNotIn("aten._softmax.default", {str(n.target) for n in backward_body.graph.nodes})

    def test_nested_scopes_and_kernels_keep_their_regions_in_both_graphs(self):
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
        forward, backward = aot_graphs(layer, x, w)
        self.assertEqual(scope_nodes(forward), [("", "layer0"), ("layer_body_0", "mlp")])
        self.assertEqual(scope_nodes(backward), [("", "layer0/bwd"), ("layer_bwd_body_0", "mlp/bwd")])
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_2: "f32[5, 4]", getitem_1: "f32[3, 4]", getitem_2: "f32[3, 5]", tangents_1: "f32[3, 5]"):
        layer_bwd_body_0 = self.layer_bwd_body_0
        hops_named_scope_1 = torch.ops.higher_order.hops_named_scope(layer_bwd_body_0, primals_2, getitem_1, getitem_2, tangents_1, hops.ScopeSpec('layer0/bwd'))
        getitem_3: "f32[3, 4]" = hops_named_scope_1[0]
        getitem_4: "f32[5, 4]" = hops_named_scope_1[1]
        return (getitem_3, getitem_4)
    class layer_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[5, 4]", arg1_1: "f32[3, 4]", arg2_1: "f32[3, 5]", arg3_1: "f32[3, 5]"):
            sum_1: "f32[]" = torch.ops.aten.sum.default(arg3_1)
            expand: "f32[3, 4]" = torch.ops.aten.expand.default(sum_1, [3, 4])
            lambda_bwd_body_0 = self.lambda_bwd_body_0
            hops_named_scope = torch.ops.higher_order.hops_named_scope(lambda_bwd_body_0, arg1_1, arg0_1, arg2_1, arg3_1, hops.ScopeSpec('mlp/bwd'))
            getitem: "f32[3, 4]" = hops_named_scope[0]
            getitem_1: "f32[5, 4]" = hops_named_scope[1]
            mul: "f32[3, 4]" = torch.ops.aten.mul.Tensor(getitem, 2)
            add: "f32[3, 4]" = torch.ops.aten.add.Tensor(expand, mul)
            return (add, getitem_1)
        class lambda_bwd_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[3, 4]", arg1_1: "f32[5, 4]", arg2_1: "f32[3, 5]", arg3_1: "f32[3, 5]"):
                tanh_backward: "f32[3, 5]" = torch.ops.aten.tanh_backward.default(arg3_1, arg2_1)
                hops_kernel_einsum: "f32[3, 4]" = torch.ops.higher_order.hops_kernel_einsum(tanh_backward, arg1_1, hops.KernelParams.of(equation='bo,oi->bi'))
                hops_kernel_einsum_1: "f32[5, 4]" = torch.ops.higher_order.hops_kernel_einsum(tanh_backward, arg0_1, hops.KernelParams.of(equation='bo,bi->oi'))
                return (hops_kernel_einsum, hops_kernel_einsum_1)
""")



class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_a_different_scope_name_recompiles(self):
        seen = []

        def backend(gm, example_inputs):
            seen.extend(n.args[-1].name for n in gm.graph.nodes if n.target is hops.named_scope_hop)
            return gm

        def fn(x, name):
            return hops.named_scope_hop(lambda t: t * 2, x, ScopeSpec(name))

        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        x = torch.randn(3)
        for name in ("a", "a", "b"):
            self.assertEqual(compiled(x, name), x * 2)
        self.assertEqual(seen, ["a", "b"])


class TestPasses(TestCase):
    def test_inline_replaces_regions_by_their_bodies(self):
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
        forward, backward = aot_graphs(layer, x, w)
        inlined = passes.inline_hops(copy.deepcopy(backward))
        self.assertEqual(scope_nodes(inlined), [])
        self.assertExpectedInline(readable(inlined), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_2: "f32[5, 4]", getitem_1: "f32[3, 4]", getitem_2: "f32[3, 5]", tangents_1: "f32[3, 5]"):
        sum_1: "f32[]" = torch.ops.aten.sum.default(tangents_1)
        expand: "f32[3, 4]" = torch.ops.aten.expand.default(sum_1, [3, 4])
        tanh_backward: "f32[3, 5]" = torch.ops.aten.tanh_backward.default(tangents_1, getitem_2)
        hops_kernel_einsum: "f32[3, 4]" = torch.ops.aten.einsum.default('bo,oi->bi', [tanh_backward, primals_2])
        hops_kernel_einsum_1: "f32[5, 4]" = torch.ops.aten.einsum.default('bo,bi->oi', [tanh_backward, getitem_1])
        mul: "f32[3, 4]" = torch.ops.aten.mul.Tensor(hops_kernel_einsum, 2)
        add: "f32[3, 4]" = torch.ops.aten.add.Tensor(expand, mul)
        return (add, hops_kernel_einsum_1)
""")
        q, k, v = qkv()
        gm = passes.inline_hops(make_fx(block)(q, k, v))
        self.assertEqual(gm(q, k, v), block(q, k, v))
        self.assertEqual([n for n in gm.graph.nodes if n.op == "get_attr"], [])

    def test_lowering_runs_the_body_in_a_scope(self):
        x, w = torch.randn(3, 4), torch.randn(5, 4)
        gm = passes.lower_to_xla(make_fx(layer)(x, w))
        self.assertExpectedInline(readable(gm), """\
class layer(torch.nn.Module):
    def forward(self, x_1: "f32[3, 4]", w_1: "f32[5, 4]"):
        layer_body_0 = self.layer_body_0
        hops_named_scope = passes_xla_rules_run_in_named_scope(layer_body_0, x_1, w_1, hops.ScopeSpec('layer0'))
        getitem: "f32[3, 5]" = hops_named_scope[0]
        return getitem
    class layer_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[3, 4]", arg1_1: "f32[5, 4]"):
            mul: "f32[3, 4]" = torch.ops.aten.mul.Tensor(arg0_1, 2)
            lambda_body_0 = self.lambda_body_0
            hops_named_scope = passes_xla_rules_run_in_named_scope(lambda_body_0, mul, arg1_1, hops.ScopeSpec('mlp'))
            getitem: "f32[3, 5]" = hops_named_scope[0]
            sum_1: "f32[]" = torch.ops.aten.sum.default(arg0_1)
            add: "f32[3, 5]" = torch.ops.aten.add.Tensor(getitem, sum_1)
            return (add,)
        class lambda_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[3, 4]", arg1_1: "f32[5, 4]"):
                hops_kernel_einsum: "f32[3, 5]" = torch.ops.aten.einsum.default('bi,oi->bo', [arg0_1, arg1_1])
                tanh: "f32[3, 5]" = torch.ops.aten.tanh.default(hops_kernel_einsum)
                return (tanh,)
""")
        self.assertEqual(gm(x, w), layer(x, w))  # off XLA the scope is just the body


# --------------------------------------------------------------------------- XLA


@pytest.fixture
def xla_ir_debug():
    """torch_xla records op_name scopes only with IR debug info on (XLA_HLO_DEBUG=1)."""
    import torch_xla

    before = torch_xla._XLAC._get_ir_debug()
    torch_xla._XLAC._set_ir_debug(True)
    yield
    torch_xla._XLAC._set_ir_debug(before)


def op_names(hlo, opcode):
    """The op_name metadata of every HLO instruction with this opcode."""
    return re.findall(rf"= \S+ {opcode}\(.*op_name=\"([^\"]*)\"", hlo)


def sync():
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


@pytest.mark.xla
def test_lowered_regions_carry_their_scope_in_hlo_op_names_forward_and_backward(xla_ir_debug):
    import torch_xla

    q, k, v = qkv(requires_grad=True)
    forward, backward = aot_graphs(block, q, k, v)
    forward, backward = passes.lower_to_xla(forward), passes.lower_to_xla(backward)
    device = torch_xla.device()
    out, *saved = forward(*(t.detach().to(device) for t in (q, k, v)))
    forward_hlo = hlo_text(out)
    # The region's ops (softmax's exponential, the dots) carry the scope; the sine after it does not.
    assert op_names(forward_hlo, "exponential") and all(re.match(r"attention\.\d+/", n) for n in op_names(forward_hlo, "exponential"))
    assert op_names(forward_hlo, "dot") and all(re.match(r"attention\.\d+/", n) for n in op_names(forward_hlo, "dot"))
    assert op_names(forward_hlo, "sine") and not any("attention" in n for n in op_names(forward_hlo, "sine"))
    sync()
    grads = backward(*saved, torch.ones(out.shape, device=device))
    backward_hlo = hlo_text(*grads)
    assert op_names(backward_hlo, "dot") and all(re.match(r"attention/bwd\.\d+/", n) for n in op_names(backward_hlo, "dot"))
    assert op_names(backward_hlo, "cosine") and not any("attention" in n for n in op_names(backward_hlo, "cosine"))
    torch.testing.assert_close(out.cpu(), reference_block(q, k, v).detach())
    references = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference_block(*references).sum().backward()
    for grad, reference in zip(grads, references):
        torch.testing.assert_close(grad.cpu(), reference.grad)


@pytest.mark.xla
def test_nested_scopes_nest_in_op_names(xla_ir_debug):
    import torch_xla

    x, w = torch.randn(3, 4), torch.randn(5, 4)
    gm = passes.lower_to_xla(make_fx(layer)(x, w))
    device = torch_xla.device()
    out = gm(x.to(device), w.to(device))
    hlo = hlo_text(out)
    assert [n for n in op_names(hlo, "tanh")] and all(re.match(r"layer0\.\d+/mlp\.\d+/", n) for n in op_names(hlo, "tanh"))
    assert all(re.match(r"layer0\.\d+/mlp\.\d+/", n) for n in op_names(hlo, "dot"))
    torch.testing.assert_close(out.cpu(), layer(x, w))


@pytest.mark.xla
def test_eager_regions_on_xla_tensors_are_scoped_too(xla_ir_debug):
    import torch_xla

    q, k, v = (t.to(torch_xla.device()) for t in qkv())
    out = block(q, k, v)
    assert all(re.match(r"attention\.\d+/", n) for n in op_names(hlo_text(out), "dot"))


@pytest.mark.xla
def test_without_ir_debug_info_a_warning_says_how_to_see_scopes():
    import torch_xla

    if torch_xla._XLAC._get_ir_debug():
        pytest.skip("IR debug info is on in this process (XLA_HLO_DEBUG/XLA_IR_DEBUG)")
    import sys

    sys.modules["hops.named_scope"]._warn_ir_debug_off.cache_clear()  # the module, not hops.named_scope()
    with pytest.warns(UserWarning, match=r"records HLO op_name scopes only with IR debug info on \(XLA_HLO_DEBUG=1"):
        out = block(*(t.to(torch_xla.device()) for t in qkv()))
    assert "attention" not in hlo_text(out)


if __name__ == "__main__":
    pytest.main([__file__])
