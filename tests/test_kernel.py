"""hops.kernel: opaque kernel calls under every frontend, their gradients, lowering and bad calls."""

import copy
import pickle

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import KernelParams, Mesh, Replicate, Shard, ShardingSpec
from tests.helpers.snapshot import TestCase, aot_trace, hlo_text, readable

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


# --------------------------------------------------------------------------- kernels under test


def scaled_tanh_shapes(x, *, scale):
    return torch.empty_like(x)


def scaled_tanh_backward(x, out, grad, *, scale):
    return grad * scale * (1 - out * out)


@hops.kernel(abstract=scaled_tanh_shapes, backward=scaled_tanh_backward)
def scaled_tanh(x, *, scale=1.0):
    """tanh(scale * x), computed by a "kernel" tracing must not look into."""
    return torch.tanh(x * scale)


def softmax_lse_shapes(x, *, dim):
    return torch.empty_like(x), x.new_empty(x.shape[:-1])


def softmax_lse_backward(x, out, lse, grad_out, grad_lse, *, dim):
    # d softmax: out * (g - sum(g * out)); d logsumexp: softmax * g_lse.
    inner = (grad_out * out).sum(dim, keepdim=True)
    return out * (grad_out - inner) + out * grad_lse.unsqueeze(dim)


@hops.kernel(abstract=softmax_lse_shapes, backward=softmax_lse_backward)
def softmax_lse(x, *, dim=-1):
    """Two outputs, like a flash-attention kernel's (out, logsumexp); its backward reads them."""
    return torch.softmax(x, dim), torch.logsumexp(x, dim)


def layout_scale_shapes(x, y, *, spec, factor):
    return torch.empty_like(x)


def layout_scale_backward(x, y, out, grad, *, spec, factor, needs_input_grad):
    return (grad * factor * y if needs_input_grad[0] else None, grad * factor * x if needs_input_grad[1] else None)


@hops.kernel(abstract=layout_scale_shapes, backward=layout_scale_backward)
def layout_scale(x, y, *, spec, factor=2):
    """A kernel whose parameters include a typed spec value (passed through to the node)."""
    return x * y * factor


@hops.kernel(abstract=lambda x: torch.empty_like(x))
def no_backward(x):
    return x * 3


scaled_tanh_kernel = scaled_tanh


def scaled_sin(x):
    return scaled_tanh(x * 2, scale=0.5).sin()


def two_outputs(x):
    out, lse = softmax_lse(x)
    return out * lse.unsqueeze(-1)


class ScaledSin(torch.nn.Module):
    def forward(self, x):
        return scaled_sin(x)


def aot_graphs(fn, *args):
    forward, backward, _ = aot_trace(fn, *args)
    return forward, backward


def reference_two_outputs(x):
    return torch.softmax(x, -1) * torch.logsumexp(x, -1).unsqueeze(-1)


# --------------------------------------------------------------------------- semantics


class TestSemantics(TestCase):
    def test_eager_runs_the_kernel(self):
        x = torch.randn(4, 6)
        self.assertEqual(scaled_tanh(x, scale=3.0), torch.tanh(3 * x))
        self.assertEqual(scaled_tanh(x), torch.tanh(x))
        self.assertEqual(two_outputs(x), reference_two_outputs(x))

    def test_the_kernel_is_a_hop_named_after_it(self):
        self.assertIsInstance(scaled_tanh, hops.Kernel)
        self.assertIsInstance(scaled_tanh, torch._ops.HigherOrderOperator)
        self.assertEqual(scaled_tanh.__name__, "hops_kernel_scaled_tanh")
        self.assertIs(torch.ops.higher_order.hops_kernel_scaled_tanh, scaled_tanh)
        self.assertIn("tracing must not look into", scaled_tanh.__doc__)

    def test_gradients_use_the_given_backward_gradcheck(self):
        x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
        y = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradgradcheck(scaled_sin, (x,)))
        self.assertTrue(torch.autograd.gradcheck(two_outputs, (x,)))
        self.assertTrue(torch.autograd.gradcheck(lambda a, b: layout_scale(a, b, spec=ROWS), (x, y)))

    def test_backward_is_called_not_autograd_of_the_kernel(self):
        calls = []

        def counting_backward(x, out, grad):
            calls.append(out.shape)
            return grad * 7

        counted = hops.kernel(lambda x: x * 2, abstract=lambda x: torch.empty_like(x), backward=counting_backward, name="counted")
        x = torch.randn(3, requires_grad=True)
        counted(x).sum().backward()
        self.assertEqual(calls, [torch.Size([3])])
        self.assertEqual(x.grad, torch.full((3,), 7.0))

    def test_only_needed_gradients_are_asked_for(self):
        x, y = torch.randn(3, requires_grad=True), torch.randn(3)
        layout_scale(x, y, spec=ROWS).sum().backward()
        self.assertEqual(x.grad, 2 * y)

    def test_params_are_one_typed_hashable_value_with_defaults_filled_in(self):
        self.assertEqual(scaled_tanh.node_args(torch.ones(1))[-1], KernelParams.of(scale=1.0))
        params = layout_scale.node_args(torch.ones(1), torch.ones(1), spec=ROWS)[-1]
        self.assertEqual(params, KernelParams.of(spec=ROWS, factor=2))
        self.assertEqual(params.items, (("factor", 2), ("spec", ROWS)))
        self.assertEqual(hash(params), hash(KernelParams.of(factor=2, spec=ROWS)))
        self.assertEqual(eval(repr(params), {"hops": hops}), params)
        self.assertEqual(pickle.loads(pickle.dumps(params)), params)
        self.assertEqual(copy.deepcopy(params), params)
        self.assertEqual(
            repr(params),
            "hops.KernelParams.of(factor=2, spec=hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))",
        )

    def test_node_form_calls_the_kernel_too(self):
        x = torch.randn(4)
        self.assertEqual(scaled_tanh(x, KernelParams.of(scale=2.0)), torch.tanh(2 * x))


# --------------------------------------------------------------------------- bad calls


class TestBadCalls(TestCase):
    def test_abstract_returning_a_non_tensor_is_refused_naming_the_kernel(self):
        bad = hops.kernel(lambda x: x + 1, abstract=lambda x: [x.shape[0]], name="shape_list_kernel")
        with self.assertRaisesRegex(
            TypeError, r"^kernel\(shape_list_kernel\): abstract returned \['int'\], expected a Tensor or a non-empty tuple"
        ):
            make_fx(bad, tracing_mode="fake")(torch.randn(3))

    def test_abstract_returning_a_real_tensor_is_refused(self):
        real = torch.zeros(3)
        bad = hops.kernel(lambda x: x + 1, abstract=lambda x: real, name="real_output_kernel")
        with self.assertRaisesRegex(TypeError, r"^kernel\(real_output_kernel\): abstract returned a real tensor as output\[0\]"):
            make_fx(bad, tracing_mode="fake")(torch.randn(3))

    def test_a_kernel_or_abstract_returning_its_input_gives_a_new_tensor(self):
        def passthrough(x):
            return x

        returns_input = hops.kernel(passthrough, abstract=lambda x: x, name="passthrough")
        x = torch.randn(3)
        out = returns_input(x)
        self.assertEqual(out, x)
        self.assertNotEqual(out.data_ptr(), x.data_ptr())
        gm = make_fx(returns_input, tracing_mode="fake")(x)
        self.assertEqual(gm(x), x)

    def test_kernel_mutating_its_input_is_refused(self):
        def increment(x):
            x.add_(1)
            return x * 1

        mutates = hops.kernel(increment, abstract=torch.empty_like)
        with self.assertRaisesRegex(ValueError, r"^kernel\(increment\): the kernel wrote into its input x in place"):
            mutates(torch.randn(3))

    def test_an_abstract_rule_that_disagrees_with_the_kernel_is_refused_naming_it(self):
        wrong_shape = hops.kernel(lambda x: x * 2, abstract=lambda x: x.new_empty(x.shape[0], 1), name="wrong_shape")
        wrong_dtype = hops.kernel(lambda x: x * 2, abstract=lambda x: x.new_empty(x.shape, dtype=torch.float64), name="wrong_dtype")
        x = torch.randn(4, 4)
        with self.assertRaisesRegex(
            RuntimeError, r"^kernel\(wrong_shape\): the kernel returned \[4, 4\] float32 but its abstract rule promises \[4, 1\] float32"
        ):
            wrong_shape(x)
        with self.assertRaisesRegex(RuntimeError, r"^kernel\(wrong_dtype\): .* promises \[4, 4\] float64"):
            wrong_dtype(x)

    def test_backward_returning_the_wrong_number_of_gradients(self):
        bad = hops.kernel(
            lambda x, y: x * y, abstract=lambda x, y: torch.empty_like(x), backward=lambda x, y, out, g: g, name="one_grad_for_two"
        )
        x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        with self.assertRaisesRegex(
            ValueError, r"^kernel\(one_grad_for_two\): backward returned 1 gradients, expected 2 \(one per tensor input: x, y\)"
        ):
            bad(x, y).sum().backward()

    def test_backward_returning_a_wrong_shape_or_type(self):
        wrong_shape = hops.kernel(
            lambda x: x * 2, abstract=torch.empty_like, backward=lambda x, out, g: g.sum(), name="scalar_grad"
        )
        wrong_type = hops.kernel(
            lambda x: x * 2, abstract=torch.empty_like, backward=lambda x, out, g: (2.0,), name="float_grad"
        )
        x = torch.randn(3, requires_grad=True)
        with self.assertRaisesRegex(
            ValueError, r"^kernel\(scalar_grad\): backward returned a gradient of shape \(\) for x, whose shape is \(3,\)"
        ):
            wrong_shape(x).sum().backward()
        with self.assertRaisesRegex(TypeError, r"^kernel\(float_grad\): backward returned a float as the gradient of x"):
            wrong_type(x).sum().backward()

    @pytest.mark.filterwarnings("ignore:Error detected in _KernelFunctionBackward")
    def test_a_gradient_without_backward_is_a_clear_error(self):
        x = torch.randn(3, requires_grad=True)
        out = no_backward(x)  # the forward is fine: the gradient may never be asked for
        with self.assertRaisesRegex(
            RuntimeError, r"^kernel\(no_backward\): no backward, but a gradient is needed for x: pass backward= to hops.kernel"
        ):
            out.sum().backward()
        with self.assertRaisesRegex(RuntimeError, r"^kernel\(no_backward\): no backward"):
            aot_graphs(no_backward, x)

    def test_non_hashable_or_untyped_params_are_refused(self):
        x = torch.randn(3)
        with self.assertRaisesRegex(
            TypeError, r"^kernel\(scaled_tanh\): param scale is a list \(\[1.0\]\), which is not hashable; pass a tuple"
        ):
            scaled_tanh(x, scale=[1.0])
        with self.assertRaisesRegex(TypeError, r"^kernel\(scaled_tanh\): param scale is a object .*kernel params must be None, bool"):
            scaled_tanh(x, scale=object())
        with self.assertRaisesRegex(TypeError, r"^kernel\(layout_scale\): param spec is a dict"):
            layout_scale(x, x, spec={"rows": 0})
        with self.assertRaisesRegex(TypeError, "KernelParams: param scale is a list"):
            KernelParams.of(scale=[1])

    def test_tensors_go_positionally_and_params_by_keyword(self):
        x = torch.randn(3)
        with self.assertRaisesRegex(TypeError, r"^kernel\(layout_scale\): param y is a Tensor: pass tensors positionally"):
            layout_scale(x, y=x, spec=ROWS)
        with self.assertRaisesRegex(
            TypeError, r"^kernel\(scaled_tanh\): positional argument #1 must be a Tensor, got float 2.0; pass non-tensor parameters by keyword"
        ):
            scaled_tanh(x, 2.0)
        with self.assertRaisesRegex(TypeError, r"^kernel\(scaled_tanh\): got an unexpected keyword argument 'block_size'"):
            scaled_tanh(x, block_size=128)
        with self.assertRaisesRegex(TypeError, r"^kernel\(layout_scale\): missing a required argument: 'spec'"):
            layout_scale(x, x)

    def test_symbolic_params_are_refused_under_tracing(self):
        with self.assertRaisesRegex(TypeError, r"^kernel\(scaled_tanh\): param scale is symbolic"):
            make_fx(lambda x: scaled_tanh(x, scale=x.shape[0]), tracing_mode="symbolic")(torch.randn(3))

    def test_bad_definitions(self):
        with self.assertRaisesRegex(TypeError, r"^kernel: abstract= is required"):
            hops.kernel(lambda x: x)
        with self.assertRaisesRegex(TypeError, r"^kernel: backward must be callable, got str"):
            hops.kernel(abstract=torch.empty_like, backward="grad")
        with self.assertRaisesRegex(ValueError, r"^kernel: .*<lambda> has no usable name \('<lambda>'\); pass name="):
            hops.kernel(lambda x: x * 1, abstract=torch.empty_like)
        with self.assertRaisesRegex(ValueError, r"^kernel: name must be a Python identifier, got 'flash attention'"):
            hops.kernel(abstract=torch.empty_like, name="flash attention")

    def test_a_second_kernel_under_a_taken_name_is_refused(self):
        def scaled_tanh(x, *, scale=1.0):
            return torch.tanh(x)

        with self.assertRaisesRegex(
            ValueError,
            r"^kernel\(scaled_tanh\): a kernel named 'scaled_tanh' is already defined \(by tests.test_kernel.scaled_tanh\); "
            r".*scaled_tanh needs another name: pass name=",
        ):
            hops.kernel(scaled_tanh, abstract=torch.empty_like)
        # The kernel that owns the name is untouched.
        self.assertIs(torch.ops.higher_order.hops_kernel_scaled_tanh, scaled_tanh_kernel)


# --------------------------------------------------------------------------- make_fx


class TestMakeFx(TestCase):
    def test_make_fx_fake(self):
        gm = make_fx(two_outputs, tracing_mode="fake")(torch.randn(4, 4))
        self.assertExpectedInline(readable(gm), """\
class two_outputs(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        hops_kernel_softmax_lse = torch.ops.higher_order.hops_kernel_softmax_lse(x_1, hops.KernelParams.of(dim=-1))
        getitem: "f32[4, 4]" = hops_kernel_softmax_lse[0]
        getitem_1: "f32[4]" = hops_kernel_softmax_lse[1]
        unsqueeze: "f32[4, 1]" = torch.ops.aten.unsqueeze.default(getitem_1, -1)
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(getitem, unsqueeze)
        return mul
""")

    def test_generated_code_runs_deep_copies_and_pickles(self):
        x = torch.randn(4, 4)
        gm = make_fx(two_outputs)(x)
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
            self.assertEqual(clone(x), two_outputs(x))
            (node,) = [n for n in clone.graph.nodes if n.target is softmax_lse]
            self.assertEqual(node.args[-1], KernelParams.of(dim=-1))


# --------------------------------------------------------------------------- AOTAutograd


class TestAOTAutograd(TestCase):
    def test_multi_output_kernel_backward_reads_its_outputs(self):
        x = torch.randn(4, 4, requires_grad=True)
        forward, backward = aot_graphs(two_outputs, x)
        self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 4]"):
        hops_kernel_softmax_lse = torch.ops.higher_order.hops_kernel_softmax_lse(primals_1, hops.KernelParams.of(dim=-1))
        getitem: "f32[4, 4]" = hops_kernel_softmax_lse[0]
        getitem_1: "f32[4]" = hops_kernel_softmax_lse[1]
        unsqueeze: "f32[4, 1]" = torch.ops.aten.unsqueeze.default(getitem_1, -1)
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(getitem, unsqueeze)
        return (mul, getitem, unsqueeze)
""")
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, getitem: "f32[4, 4]", unsqueeze: "f32[4, 1]", tangents_1: "f32[4, 4]"):
        mul_1: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, getitem)
        mul_2: "f32[4, 4]" = torch.ops.aten.mul.Tensor(tangents_1, unsqueeze)
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(mul_1, [1], True)
        squeeze: "f32[4]" = torch.ops.aten.squeeze.dim(sum_1, -1)
        mul_3: "f32[4, 4]" = torch.ops.aten.mul.Tensor(mul_2, getitem)
        sum_2: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(mul_3, [-1], True)
        sub: "f32[4, 4]" = torch.ops.aten.sub.Tensor(mul_2, sum_2)
        mul_4: "f32[4, 4]" = torch.ops.aten.mul.Tensor(getitem, sub)
        unsqueeze_1: "f32[4, 1]" = torch.ops.aten.unsqueeze.default(squeeze, -1)
        mul_5: "f32[4, 4]" = torch.ops.aten.mul.Tensor(getitem, unsqueeze_1)
        add: "f32[4, 4]" = torch.ops.aten.add.Tensor(mul_4, mul_5)
        return (add,)
""")
        reference = x.detach().clone().requires_grad_()
        reference_two_outputs(reference).sum().backward()
        self.assertEqual(x.grad, reference.grad)


# --------------------------------------------------------------------------- export



# --------------------------------------------------------------------------- Dynamo


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_a_different_param_recompiles_an_equal_one_does_not(self):
        seen = []

        def backend(gm, example_inputs):
            seen.append(next(n.args[-1] for n in gm.graph.nodes if n.target is layout_scale))
            return gm

        def scale(x, spec, factor):
            return layout_scale(x, x, spec=spec, factor=factor) + 1

        compiled = torch.compile(scale, backend=backend, fullgraph=True)
        x = torch.randn(4, 4)
        cols = ShardingSpec(MESH, (Replicate(), Shard(1)))
        compiled(x, ROWS, 2)
        compiled(x, ShardingSpec(Mesh((2, 2), ("data", "model")), (Shard(0), Replicate())), 2)
        compiled(x, cols, 2)
        compiled(x, ROWS, 2)
        self.assertEqual(seen, [KernelParams.of(factor=2, spec=ROWS), KernelParams.of(factor=2, spec=cols)])


# --------------------------------------------------------------------------- passes


class TestPasses(TestCase):
    def test_inline_calls_the_kernel_function(self):
        x = torch.randn(4, 4)
        gm = passes.inline_hops(make_fx(two_outputs)(x))
        self.assertExpectedInline(readable(gm), """\
class two_outputs(torch.nn.Module):
    def forward(self, x_1: "f32[4, 4]"):
        hops_kernel_softmax_lse = torch.ops.hops_kernels.softmax_lse.default([x_1], 'hops.KernelParams.of(dim=-1)')
        getitem: "f32[4, 4]" = hops_kernel_softmax_lse[0]
        getitem_1: "f32[4]" = hops_kernel_softmax_lse[1]
        unsqueeze: "f32[4, 1]" = torch.ops.aten.unsqueeze.default(getitem_1, -1)
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(getitem, unsqueeze)
        return mul
""")
        self.assertEqual(gm(x), two_outputs(x))

    def test_lowering_calls_the_kernel_op(self):
        # Lowered, a kernel call is a call of its torch.library op: opaque to every backend,
        # with the kernel's params as their text.
        x = torch.randn(4, 4)
        gm = passes.lower_to_xla(make_fx(scaled_sin)(x))
        (node,) = [n for n in gm.graph.nodes if n.target is scaled_tanh.op]
        self.assertEqual(node.args[1], repr(KernelParams.of(scale=0.5)))
        self.assertEqual(gm(x), scaled_sin(x))


# --------------------------------------------------------------------------- XLA


def scaled_tanh_with_xla_builder(x, *, scale):
    """The XLA implementation: the same math written with torch_xla's XLA builder, so the HLO
    calls a computation named after the kernel (what a Pallas or JAX-lowered kernel looks like
    to the program around it)."""
    import torch_xla.core.xla_op_registry as xor

    op = _XLA_OPS.get("scaled_tanh_xla")
    if op is None:
        op = _XLA_OPS["scaled_tanh_xla"] = xor.register(
            "scaled_tanh_xla", lambda a, scale: (a * a.scalar_like(scale)).tanh()
        )
    return op(x, scale=scale)


_XLA_OPS = {}

xla_scaled_tanh = hops.kernel(
    scaled_tanh.implementation,
    abstract=scaled_tanh_shapes,
    backward=scaled_tanh_backward,
    xla=scaled_tanh_with_xla_builder,
    name="xla_scaled_tanh",
)


def xla_device():
    import torch_xla

    return torch_xla.device()


@pytest.mark.xla
def test_lowered_graph_calls_the_xla_implementation():
    def fn(x):
        return xla_scaled_tanh(x * 2, scale=0.5).sin()

    x = torch.randn(4, 4)
    gm = passes.lower_to_xla(make_fx(fn)(x))
    (node,) = [n for n in gm.graph.nodes if n.name == "hops_kernel_xla_scaled_tanh"]
    # The kernel's op, whose XLA kernel is the kernel's xla= implementation.
    assert node.target is xla_scaled_tanh.op
    out = gm(x.to(xla_device()))
    hlo = hlo_text(out)
    # The eager implementation would be multiply + tanh inline; the XLA one is a call.
    assert "to_apply=%scaled_tanh_xla" in hlo
    torch.testing.assert_close(out.cpu(), fn(x))


@pytest.mark.xla
def test_unlowered_kernel_on_xla_tensors_uses_the_xla_implementation_too():
    x = torch.randn(4, 4)
    x_xla = x.to(xla_device()).requires_grad_()
    out = xla_scaled_tanh(x_xla, scale=3.0)
    assert "to_apply=%scaled_tanh_xla" in hlo_text(out)
    torch.testing.assert_close(out.cpu(), torch.tanh(3 * x))
    # The gradient comes from the kernel's backward (the builder computation has none).
    out.sum().backward()
    reference = x.clone().requires_grad_()
    torch.tanh(3 * reference).sum().backward()
    torch.testing.assert_close(x_xla.grad.cpu(), reference.grad)


@pytest.mark.xla
def test_kernel_without_xla_implementation_runs_its_torch_code_on_xla():
    x = torch.randn(4, 4, requires_grad=True)
    forward, backward = aot_graphs(two_outputs, x)
    forward, backward = passes.lower_to_xla(forward), passes.lower_to_xla(backward)
    device = xla_device()
    out, *saved = forward(x.detach().to(device))
    torch.testing.assert_close(out.cpu(), reference_two_outputs(x.detach()))
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()
    (grad,) = backward(*saved, torch.ones(4, 4, device=device))
    reference = x.detach().clone().requires_grad_()
    reference_two_outputs(reference).sum().backward()
    torch.testing.assert_close(grad.cpu(), reference.grad)


if __name__ == "__main__":
    pytest.main([__file__])
