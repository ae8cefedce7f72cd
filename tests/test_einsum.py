"""hops.einsum and hops.patch_linear: einsum nodes in every graph, forward and backward; one
rank-preserving dot in XLA's HLO."""

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops.einsum import canonical_equation, einsum_kernel, einsum_linear_kernel
from tests.helpers.snapshot import TestCase, aot_trace, hlo_text, readable


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 6)
        self.down = torch.nn.Linear(6, 5, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def patched_mlp():
    torch.manual_seed(0)
    return hops.patch_linear(MLP())


def aot_graphs(fn, *args):
    forward, backward, _ = aot_trace(fn, *args)
    return forward, backward


def functional_mlp(module):
    """``module`` as a function of (x, *parameters): AOTAutograd traces parameters as inputs."""
    names = [name for name, _ in module.named_parameters()]

    def call(x, *parameters):
        return torch.func.functional_call(module, dict(zip(names, parameters)), (x,))

    return call, [p.detach().clone().requires_grad_() for _, p in module.named_parameters()]


def targets(gm):
    return {str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes if n.op == "call_function"}


EQUATIONS = [
    ("bsd,fd->bsf", [(2, 3, 4), (5, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...i,oi->...o", [(2, 3, 4), (5, 4)]),
    ("...i,...i->...i", [(3, 1, 4), (2, 4)]),  # broadcast ellipsis dims
    ("ij->i", [(3, 4)]),  # j is summed: its gradient is constant along j
    ("ij->ji", [(3, 4)]),  # a permutation (a view in torch.einsum)
    ("i,i->", [(4,), (4,)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("...i->i", [(2, 3, 4)]),
    ("bi,bj->bij", [(1, 3), (2, 4)]),  # size-1 dim broadcast against another operand
]


class TestSemantics(TestCase):
    def test_canonical_equations(self):
        a, b = torch.randn(3, 4), torch.randn(4, 5)
        self.assertEqual(canonical_equation("ij,jk", (a, b)), "ij,jk->ik")
        self.assertEqual(canonical_equation(" i j , j k -> k i ", (a, b)), "ij,jk->ki")
        self.assertEqual(canonical_equation("...j,jk", (torch.randn(2, 3, 4), b)), "...j,jk->...k")
        self.assertEqual(canonical_equation("Ba,ab", (a, b)), "Ba,ab->Bb")

    def test_values_and_gradients_match_torch_einsum(self):
        for equation, shapes in EQUATIONS:
            with self.subTest(equation=equation):
                operands = [torch.randn(s, dtype=torch.double, requires_grad=True) for s in shapes]
                self.assertEqual(hops.einsum(equation, *operands), torch.einsum(equation, *operands))
                self.assertTrue(torch.autograd.gradcheck(lambda *ops: hops.einsum(equation, *ops), operands))
        operands = [torch.randn(3, 4, dtype=torch.double, requires_grad=True), torch.randn(4, dtype=torch.double, requires_grad=True)]
        self.assertTrue(torch.autograd.gradgradcheck(lambda a, b: hops.einsum("ij,j->i", a, b), operands))

    def test_operands_as_a_list_and_a_fresh_result(self):
        a = torch.randn(3, 4)
        self.assertEqual(hops.einsum("ij,jk->ik", [a, a.T]), a @ a.T)
        permuted = hops.einsum("ij->ji", a)
        self.assertNotEqual(permuted.data_ptr(), a.data_ptr())

    def test_einsum_linear_matches_nn_linear(self):
        x = torch.randn(2, 3, 4, dtype=torch.double, requires_grad=True)
        w = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
        b = torch.randn(5, dtype=torch.double, requires_grad=True)
        self.assertEqual(hops.einsum_linear(x, w, b), torch.nn.functional.linear(x, w, b))
        self.assertEqual(hops.einsum_linear(x, w), torch.nn.functional.linear(x, w))
        self.assertTrue(torch.autograd.gradcheck(hops.einsum_linear, (x, w, b)))
        self.assertTrue(torch.autograd.gradcheck(hops.einsum_linear, (x[0, 0], w, b)))  # no leading dims

    def test_patch_linear_swaps_every_linear_in_place(self):
        torch.manual_seed(0)
        reference = MLP()
        module = copy.deepcopy(reference)
        self.assertIs(hops.patch_linear(module), module)
        self.assertIs(type(module.up), hops.EinsumLinear)
        self.assertIsInstance(module.down, torch.nn.Linear)
        self.assertEqual(module.state_dict().keys(), reference.state_dict().keys())
        x = torch.randn(2, 3, 4)
        self.assertEqual(module(x), reference(x))
        module(x).sum().backward()
        reference(x).sum().backward()
        self.assertEqual(module.up.weight.grad, reference.up.weight.grad)
        self.assertEqual(module.up.bias.grad, reference.up.bias.grad)
        # Off by default; patching a single layer works too; subclasses are left alone.
        self.assertIs(type(MLP().up), torch.nn.Linear)
        self.assertIs(type(hops.patch_linear(torch.nn.Linear(2, 2))), hops.EinsumLinear)

        class Scaled(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x) * 2

        self.assertIs(type(hops.patch_linear(Scaled(2, 2))), Scaled)


class TestBadCalls(TestCase):
    def test_bad_equations_and_operands_are_refused_naming_them(self):
        a, b = torch.randn(3, 4), torch.randn(4, 5)
        with self.assertRaisesRegex(TypeError, r"^einsum: equation must be a str, got list"):
            hops.einsum([0, 1], a)
        with self.assertRaisesRegex(ValueError, r"^einsum\('ij,jk->ik'\): the equation has 2 operand subscripts but 1 operands were given"):
            hops.einsum("ij,jk->ik", a)
        with self.assertRaisesRegex(ValueError, r"^einsum\('ijk,jk->ik'\): operands\[0\] has rank 2, but its subscripts 'ijk' name 3 dims"):
            hops.einsum("ijk,jk->ik", a, b)
        with self.assertRaisesRegex(ValueError, r"operands\[0\]: 'ii' repeats 'i' \(a diagonal\)"):
            hops.einsum("ii->i", torch.randn(3, 3))
        with self.assertRaisesRegex(ValueError, r"^einsum\('ij,jk->iz'\): output subscript 'z' is in no input"):
            hops.einsum("ij,jk->iz", a, b)
        with self.assertRaisesRegex(ValueError, r"operands\[0\]: 'i1' has '1'; subscripts are letters"):
            hops.einsum("i1->i", a)
        with self.assertRaisesRegex(TypeError, r"^einsum\('ij->i'\): operands\[0\] must be a Tensor, got float"):
            hops.einsum("ij->i", 1.0)

    def test_mismatched_sizes_and_dtypes_are_refused_naming_operand_and_subscript(self):
        a = torch.randn(3, 4)
        with self.assertRaisesRegex(
            ValueError, r"^einsum\('ij,jk->ik'\): subscript 'j' has size 4 in operands\[0\] but 5 in operands\[1\] \(dim 0 of shape \(5, 6\)\)"
        ):
            hops.einsum("ij,jk->ik", a, torch.randn(5, 6))
        with self.assertRaisesRegex(ValueError, r"dim 1 from the right under '...' has size 2 in operands\[0\] but 3 in operands\[1\]"):
            hops.einsum("...ij,...jk->...ik", torch.randn(2, 3, 4), torch.randn(3, 4, 5))
        with self.assertRaisesRegex(TypeError, r"^einsum\('ij,jk->ik'\): operands\[1\] is torch.float64 but operands\[0\] is torch.float32"):
            hops.einsum("ij,jk->ik", a, torch.randn(4, 5, dtype=torch.double))
        with self.assertRaisesRegex(TypeError, r"^einsum_linear: x is torch.float32 but weight is torch.float64"):
            hops.einsum_linear(a, torch.randn(5, 4, dtype=torch.double))
        # A size-1 dim broadcasts, as in torch.einsum.
        self.assertEqual(hops.einsum("ij,jk->ik", torch.randn(3, 1), torch.randn(4, 6)).shape, (3, 6))

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.integers(1, 3), min_size=3, max_size=3),
        st.lists(st.integers(1, 3), min_size=5, max_size=5),
        st.sampled_from(["ij,jk->ik", "bij,bjk->bik", "...ij,...jk->...ik", "ij,ij->", "i,j,ij->"]),
        st.booleans(),
    )
    def test_refuses_exactly_what_torch_einsum_refuses(self, left, right, equation, same_dtype):
        # Property: on random sizes (1 broadcasts), hops.einsum raises a typed error where
        # torch.einsum fails and gives torch.einsum's value where it does not. Mixed dtypes are
        # always refused (torch.einsum promotes them only when a product degenerates to mul).
        lhs = equation.split("->")[0].split(",")
        sizes = iter(left + right)
        operands = []
        for k, subscripts in enumerate(lhs):
            rank = len(subscripts.replace("...", "")) + (1 if "..." in subscripts else 0)
            dtype = torch.float32 if same_dtype or k == 0 else torch.float64
            operands.append(torch.randn([next(sizes) for _ in range(rank)], dtype=dtype))
        if not same_dtype:
            with self.assertRaisesRegex(TypeError, r"operands\[1\] is torch.float64 but operands\[0\] is torch.float32"):
                hops.einsum(equation, *operands)
            return
        # opt_einsum (where installed) refuses some broadcasts torch.einsum itself computes.
        with torch.backends.opt_einsum.flags(enabled=False):
            try:
                expected = torch.einsum(equation, *operands)
            except RuntimeError:
                with self.assertRaises((ValueError, TypeError)):
                    hops.einsum(equation, *operands)
            else:
                self.assertEqual(hops.einsum(equation, *operands), expected)

    def test_bad_linear_arguments_are_refused(self):
        x, w = torch.randn(2, 4), torch.randn(5, 4)
        with self.assertRaisesRegex(ValueError, r"^einsum_linear: weight must be 2-D"):
            hops.einsum_linear(x, torch.randn(5))
        with self.assertRaisesRegex(ValueError, r"^einsum_linear: x has shape \(2, 3\), but weight \(5, 4\) takes 4 input features"):
            hops.einsum_linear(torch.randn(2, 3), w)
        with self.assertRaisesRegex(ValueError, r"^einsum_linear: bias must have shape \(5,\), got \(4,\)"):
            hops.einsum_linear(x, w, torch.randn(4))
        with self.assertRaisesRegex(TypeError, r"^patch_linear: module must be a torch.nn.Module, got function"):
            hops.patch_linear(lambda x: x)


# --------------------------------------------------------------------------- graphs


def bsd(x, w):
    return torch.nn.functional.gelu(hops.einsum("bsd,fd->bsf", x, w))


class TestGraphs(TestCase):
    def test_make_fx_fake_and_symbolic_keep_leading_dims(self):
        # Parameters are inputs: make_fx's fake modes refuse real tensors (as for any nn.Linear).
        module = patched_mlp()
        fn, parameters = functional_mlp(module)
        parameters = [p.detach() for p in parameters]
        fake = make_fx(fn, tracing_mode="fake")(torch.randn(2, 3, 4), *parameters)
        self.assertExpectedInline(readable(fake), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 3, 4]", arg1_1: "f32[6, 4]", arg2_1: "f32[6]", arg3_1: "f32[5, 6]"):
        hops_kernel_einsum_linear: "f32[2, 3, 6]" = torch.ops.higher_order.hops_kernel_einsum_linear(arg0_1, arg1_1, arg2_1, hops.KernelParams.of())
        gelu: "f32[2, 3, 6]" = torch.ops.aten.gelu.default(hops_kernel_einsum_linear)
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(gelu, arg3_1, hops.KernelParams.of(equation='...i,oi->...o'))
        return hops_kernel_einsum
""")
        symbolic = make_fx(fn, tracing_mode="symbolic")(torch.randn(2, 3, 4), *parameters)
        self.assertExpectedInline(readable(symbolic), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[s75, s96, s7]", arg1_1: "f32[s57, s7]", arg2_1: "f32[s57]", arg3_1: "f32[s67, s57]"):
        hops_kernel_einsum_linear: "f32[s75, s96, s57]" = torch.ops.higher_order.hops_kernel_einsum_linear(arg0_1, arg1_1, arg2_1, hops.KernelParams.of())
        gelu: "f32[s75, s96, s57]" = torch.ops.aten.gelu.default(hops_kernel_einsum_linear)
        hops_kernel_einsum: "f32[s75, s96, s67]" = torch.ops.higher_order.hops_kernel_einsum(gelu, arg3_1, hops.KernelParams.of(equation='...i,oi->...o'))
        return hops_kernel_einsum
""")
        x = torch.randn(7, 1, 4)
        self.assertEqual(symbolic(x, *parameters), module(x))

    def test_aot_forward_and_backward_hold_einsum_not_view_mm_view(self):
        fn, parameters = functional_mlp(patched_mlp())
        x = torch.randn(2, 3, 4, requires_grad=True)
        forward, backward = aot_graphs(fn, x, *parameters)
        self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[6, 4]", primals_3: "f32[6]", primals_4: "f32[5, 6]"):
        hops_kernel_einsum_linear: "f32[2, 3, 6]" = torch.ops.higher_order.hops_kernel_einsum_linear(primals_1, primals_2, primals_3, hops.KernelParams.of())
        gelu: "f32[2, 3, 6]" = torch.ops.aten.gelu.default(hops_kernel_einsum_linear)
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.higher_order.hops_kernel_einsum(gelu, primals_4, hops.KernelParams.of(equation='...i,oi->...o'))
        return (hops_kernel_einsum, primals_1, primals_2, primals_4, hops_kernel_einsum_linear, gelu)
""")
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 3, 4]", primals_2: "f32[6, 4]", primals_4: "f32[5, 6]", hops_kernel_einsum_linear: "f32[2, 3, 6]", gelu: "f32[2, 3, 6]", tangents_1: "f32[2, 3, 5]"):
        hops_kernel_einsum_1: "f32[2, 3, 6]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, primals_4, hops.KernelParams.of(equation='...o,oi->...i'))
        hops_kernel_einsum_2: "f32[5, 6]" = torch.ops.higher_order.hops_kernel_einsum(tangents_1, gelu, hops.KernelParams.of(equation='...o,...i->oi'))
        gelu_backward: "f32[2, 3, 6]" = torch.ops.aten.gelu_backward.default(hops_kernel_einsum_1, hops_kernel_einsum_linear)
        hops_kernel_einsum_3: "f32[2, 3, 4]" = torch.ops.higher_order.hops_kernel_einsum(gelu_backward, primals_2, hops.KernelParams.of(equation='...o,oi->...i'))
        hops_kernel_einsum_4: "f32[6, 4]" = torch.ops.higher_order.hops_kernel_einsum(gelu_backward, primals_1, hops.KernelParams.of(equation='...o,...i->oi'))
        hops_kernel_einsum_5: "f32[6]" = torch.ops.higher_order.hops_kernel_einsum(gelu_backward, hops.KernelParams.of(equation='...o->o'))
        return (hops_kernel_einsum_3, hops_kernel_einsum_4, hops_kernel_einsum_5, hops_kernel_einsum_2)
""")
        for graph in (forward, backward):
            self.assertFalse({"aten.mm.default", "aten.view.default", "aten._unsafe_view.default", "aten.bmm.default"} & targets(graph))
        # Without the patch the same module's graphs flatten the leading dims.
        plain_fn, plain_parameters = functional_mlp(MLP())
        plain_forward, plain_backward = aot_graphs(plain_fn, x, *plain_parameters)
        self.assertIn("aten.mm.default", targets(plain_forward))
        self.assertIn("aten.view.default", targets(plain_forward))

    def test_gradients_through_aot_match_eager(self):
        module = patched_mlp()
        fn, parameters = functional_mlp(module)
        x = torch.randn(2, 3, 4, requires_grad=True)
        aot_graphs(fn, x, *parameters)
        reference = MLP()
        reference.load_state_dict(module.state_dict())
        x_reference = x.detach().clone().requires_grad_()
        reference(x_reference).sum().backward()
        self.assertEqual(x.grad, x_reference.grad)
        self.assertEqual([p.grad for p in parameters], [p.grad for p in reference.parameters()])


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_patched_module_compiles_without_graph_breaks(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        module, x = patched_mlp(), torch.randn(2, 3, 4)
        self.assertEqual(torch.compile(module, backend=backend, fullgraph=True)(x), module(x))
        self.assertEqual(
            [n.target for n in graphs[0].graph.nodes if isinstance(n.target, hops.Kernel)],
            [einsum_linear_kernel, einsum_kernel],
        )


class TestPasses(TestCase):
    def test_inline_and_lowering_give_aten_einsum(self):
        module, x = patched_mlp(), torch.randn(2, 3, 4)
        fn, parameters = functional_mlp(module)
        parameters = [p.detach() for p in parameters]
        inlined = passes.inline_hops(make_fx(fn)(x, *parameters))
        self.assertExpectedInline(readable(inlined), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 3, 4]", arg1_1: "f32[6, 4]", arg2_1: "f32[6]", arg3_1: "f32[5, 6]"):
        einsum_default = torch.ops.aten.einsum.default('...i,oi->...o', [arg0_1, arg1_1])
        hops_kernel_einsum_linear: "f32[2, 3, 6]" = torch.ops.aten.add.Tensor(einsum_default, arg2_1)
        gelu: "f32[2, 3, 6]" = torch.ops.aten.gelu.default(hops_kernel_einsum_linear)
        hops_kernel_einsum: "f32[2, 3, 5]" = torch.ops.aten.einsum.default('...i,oi->...o', [gelu, arg3_1])
        return hops_kernel_einsum
""")
        lowered = passes.lower_to_xla(make_fx(fn)(x, *parameters))
        self.assertEqual(lowered.code, inlined.code)
        self.assertEqual(inlined(x, *parameters), module(x))


# --------------------------------------------------------------------------- XLA


def dots(hlo):
    return re.findall(r"dot\(([^)]*)\)", hlo)


def reshapes(hlo):
    return re.findall(r"= (\S+) reshape\((\S+)", hlo)


def lowered_on_xla(module, x):
    """Lowered AOT forward and backward of ``module`` on XLA: (out, grads, forward HLO, backward HLO)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    fn, parameters = functional_mlp(module)
    forward, backward = aot_graphs(fn, x.detach().requires_grad_(), *parameters)
    forward, backward = passes.lower_to_xla(forward), passes.lower_to_xla(backward)
    device = torch_xla.device()
    out, *saved = forward(x.to(device), *(p.detach().to(device) for p in parameters))
    forward_hlo = hlo_text(out)
    torch_xla.sync()
    xm.wait_device_ops()
    grads = backward(*saved, torch.ones(out.shape, device=device))
    return out, grads, forward_hlo, hlo_text(*grads)


@pytest.mark.xla
def test_xla_dots_keep_the_batch_dims_forward_and_backward():
    x = torch.randn(2, 3, 4)
    module = patched_mlp()
    out, grads, forward_hlo, backward_hlo = lowered_on_xla(module, x)
    # Forward: x [2,3,4] . up^T -> [2,3,6]; relu; . down^T -> [2,3,5]: rank-3 operands, no reshape.
    assert all(d.startswith("f32[2,3,") for d in dots(forward_hlo)), dots(forward_hlo)
    assert len(dots(forward_hlo)) == 2
    assert not [r for r in reshapes(forward_hlo) if r[0].startswith("f32[6,")], reshapes(forward_hlo)
    # Backward: grad_x and grad_w dots read rank-3 operands; nothing is flattened to [6, ...].
    assert all(d.startswith("f32[2,3,") for d in dots(backward_hlo)), dots(backward_hlo)
    assert not [r for r in reshapes(backward_hlo) if r[0].startswith("f32[6,")], reshapes(backward_hlo)
    reference = MLP()
    reference.load_state_dict(module.state_dict())
    x_reference = x.clone().requires_grad_()
    expected = reference(x_reference)
    expected.sum().backward()
    torch.testing.assert_close(out.cpu(), expected.detach())
    torch.testing.assert_close(grads[0].cpu(), x_reference.grad)
    for grad, parameter in zip(grads[1:], reference.parameters()):
        torch.testing.assert_close(grad.cpu(), parameter.grad)


@pytest.mark.xla
def test_xla_without_the_patch_the_batch_dims_are_merged():
    # The contrast that makes the test above meaningful: nn.Linear's view/mm/view.
    torch.manual_seed(0)
    _, _, forward_hlo, _ = lowered_on_xla(MLP(), torch.randn(2, 3, 4))
    assert [r for r in reshapes(forward_hlo) if r[0].startswith("f32[6,4]")], reshapes(forward_hlo)
    assert any(d.startswith("f32[6,") for d in dots(forward_hlo)), dots(forward_hlo)


if __name__ == "__main__":
    pytest.main([__file__])
