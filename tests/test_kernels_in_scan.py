"""Kernels, einsum and named scopes inside a ``hops.scan`` body: the scan's forward and
backward bodies keep them (their rules are the standard dispatch keys, so any subgraph
tracer records them), and gradients match the unrolled loop."""

import torch

import hops
import passes
from tests.helpers.snapshot import TestCase, readable
from tests.test_kernel import aot_graphs, scaled_tanh


@hops.named_scope("cell")
def cell(h, x, w):
    return scaled_tanh(hops.einsum("bi,oi->bo", h, w) + x, scale=0.5)


def recurrent(h0, xs, w):
    h, ys = hops.scan(lambda h, x: (cell(h, x, w),) * 2, h0, xs)
    return ys.sum(0) + h


def unrolled(h0, xs, w):
    h, ys = h0, []
    for x in xs:
        h = torch.tanh(0.5 * (h @ w.T + x))
        ys.append(h)
    return torch.stack(ys).sum(0) + h


def hops_in(gm):
    """Every HOP node of this package in ``gm`` and its subgraphs: (target name, scope name)."""
    found = []
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.target is hops.named_scope_hop:
                    found.append(("hops_named_scope", node.args[-1].name))
                elif isinstance(node.target, hops.Kernel):
                    found.append((node.target.__name__, None))
    return sorted(found)


class TestInsideScan(TestCase):
    def inputs(self):
        torch.manual_seed(0)
        return [torch.randn(2, 4, requires_grad=True), torch.randn(5, 2, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)]

    def test_forward_and_backward_scan_bodies_keep_kernels_and_scopes(self):
        args = self.inputs()
        forward, backward = aot_graphs(recurrent, *args)
        self.assertEqual(
            hops_in(forward),
            [("hops_kernel_einsum", None), ("hops_kernel_scaled_tanh", None), ("hops_named_scope", "cell")],
        )
        # The backward body: the kernel's backward is plain torch code, einsum's is two einsums.
        self.assertEqual(
            hops_in(backward),
            [("hops_kernel_einsum", None), ("hops_kernel_einsum", None), ("hops_named_scope", "cell/bwd")],
        )
        references = [a.detach().clone().requires_grad_() for a in self.inputs()]
        unrolled(*references).sum().backward()
        for got, expected in zip(args, references):
            self.assertEqual(got.grad, expected.grad)

    def test_passes_reach_into_scan_bodies(self):
        args = [a.detach() for a in self.inputs()]
        from torch.fx.experimental.proxy_tensor import make_fx

        inlined = passes.inline_hops(make_fx(recurrent)(*args))
        self.assertEqual(hops_in(inlined), [])
        self.assertEqual(inlined(*args), unrolled(*args))


class TestInsideScanSnapshots(TestCase):
    def test_make_fx_graph(self):
        from torch.fx.experimental.proxy_tensor import make_fx

        torch.manual_seed(0)
        args = [torch.randn(2, 4), torch.randn(3, 2, 4), torch.randn(4, 4)]
        self.assertExpectedInline(readable(make_fx(recurrent)(*args)), """\
class recurrent(torch.nn.Module):
    def forward(self, h0_1: "f32[2, 4]", xs_1: "f32[3, 2, 4]", w_1: "f32[4, 4]"):
        lambda_body_0 = self.lambda_body_0
        hops_scan = torch.ops.higher_order.hops_scan(lambda_body_0, h0_1, xs_1, w_1, hops.ScanSpec(1, 1, length=3))
        getitem: "f32[2, 4]" = hops_scan[0]
        getitem_1: "f32[3, 2, 4]" = hops_scan[1]
        sum_1: "f32[2, 4]" = torch.ops.aten.sum.dim_IntList(getitem_1, [0])
        add: "f32[2, 4]" = torch.ops.aten.add.Tensor(sum_1, getitem)
        return add
    class lambda_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]"):
            cell_body_0 = self.cell_body_0
            hops_named_scope = torch.ops.higher_order.hops_named_scope(cell_body_0, arg0_1, arg1_1, arg2_1, hops.ScopeSpec('cell'))
            getitem: "f32[2, 4]" = hops_named_scope[0]
            return (getitem, getitem)
        class cell_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]"):
                hops_kernel_einsum: "f32[2, 4]" = torch.ops.higher_order.hops_kernel_einsum(arg0_1, arg2_1, hops.KernelParams.of(equation='bi,oi->bo'))
                add: "f32[2, 4]" = torch.ops.aten.add.Tensor(hops_kernel_einsum, arg1_1)
                hops_kernel_scaled_tanh: "f32[2, 4]" = torch.ops.higher_order.hops_kernel_scaled_tanh(add, hops.KernelParams.of(scale=0.5))
                return (hops_kernel_scaled_tanh,)
""")

    def test_aot_forward_and_backward_graphs(self):
        torch.manual_seed(0)
        args = [torch.randn(2, 4, requires_grad=True), torch.randn(3, 2, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)]
        forward, backward = aot_graphs(recurrent, *args)
        self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 4]", primals_2: "f32[3, 2, 4]", primals_3: "f32[4, 4]"):
        lambda_body_0 = self.lambda_body_0
        hops_scan = torch.ops.higher_order.hops_scan(lambda_body_0, primals_1, primals_2, primals_3, primals_3, hops.ScanSpec(1, 1, length=3))
        getitem: "f32[2, 4]" = hops_scan[0]
        getitem_1: "f32[3, 2, 4]" = hops_scan[1]
        getitem_2: "f32[3, 2, 4]" = hops_scan[2]
        getitem_3: "f32[3, 2, 4]" = hops_scan[3]
        sum_1: "f32[2, 4]" = torch.ops.aten.sum.dim_IntList(getitem_1, [0])
        add: "f32[2, 4]" = torch.ops.aten.add.Tensor(sum_1, getitem)
        return (add, primals_3, getitem_2, getitem_3)
    class lambda_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]", arg3_1: "f32[4, 4]"):
            cell_body_0 = self.cell_body_0
            hops_named_scope = torch.ops.higher_order.hops_named_scope(cell_body_0, arg0_1, arg1_1, arg3_1, hops.ScopeSpec('cell'))
            getitem: "f32[2, 4]" = hops_named_scope[0]
            getitem_1: "f32[2, 4]" = hops_named_scope[1]
            clone: "f32[2, 4]" = torch.ops.aten.clone.default(arg0_1)
            return (getitem, getitem, clone, getitem_1)
        class cell_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]"):
                hops_kernel_einsum: "f32[2, 4]" = torch.ops.higher_order.hops_kernel_einsum(arg0_1, arg2_1, hops.KernelParams.of(equation='bi,oi->bo'))
                add: "f32[2, 4]" = torch.ops.aten.add.Tensor(hops_kernel_einsum, arg1_1)
                hops_kernel_scaled_tanh: "f32[2, 4]" = torch.ops.higher_order.hops_kernel_scaled_tanh(add, hops.KernelParams.of(scale=0.5))
                return (hops_kernel_scaled_tanh, hops_kernel_scaled_tanh)
""")
        self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_3: "f32[4, 4]", getitem_2: "f32[3, 2, 4]", getitem_3: "f32[3, 2, 4]", tangents_1: "f32[2, 4]"):
        unsqueeze: "f32[1, 2, 4]" = torch.ops.aten.unsqueeze.default(tangents_1, 0)
        expand: "f32[3, 2, 4]" = torch.ops.aten.expand.default(unsqueeze, [3, 2, 4])
        new_zeros: "f32[4, 4]" = torch.ops.aten.new_zeros.default(tangents_1, [4, 4], dtype = torch.float32, pin_memory = False)
        lambda_bwd_body_0 = self.lambda_bwd_body_0
        hops_scan_1 = torch.ops.higher_order.hops_scan(lambda_bwd_body_0, tangents_1, new_zeros, getitem_2, getitem_3, expand, primals_3, hops.ScanSpec(2, 3, length=3, reverse=True))
        getitem_4: "f32[2, 4]" = hops_scan_1[0]
        getitem_5: "f32[4, 4]" = hops_scan_1[1]
        getitem_6: "f32[3, 2, 4]" = hops_scan_1[2]
        return (getitem_4, getitem_6, getitem_5)
    class lambda_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[4, 4]", arg2_1: "f32[2, 4]", arg3_1: "f32[2, 4]", arg4_1: "f32[2, 4]", arg5_1: "f32[4, 4]"):
            add: "f32[2, 4]" = torch.ops.aten.add.Tensor(arg0_1, arg4_1)
            cell_bwd_body_0 = self.cell_bwd_body_0
            hops_named_scope = torch.ops.higher_order.hops_named_scope(cell_bwd_body_0, arg2_1, arg5_1, arg3_1, add, hops.ScopeSpec('cell/bwd'))
            getitem: "f32[2, 4]" = hops_named_scope[0]
            getitem_1: "f32[2, 4]" = hops_named_scope[1]
            getitem_2: "f32[4, 4]" = hops_named_scope[2]
            add_1: "f32[4, 4]" = torch.ops.aten.add.Tensor(arg1_1, getitem_2)
            return (getitem, add_1, getitem_1)
        class cell_bwd_body_0(torch.nn.Module):
            def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[4, 4]", arg2_1: "f32[2, 4]", arg3_1: "f32[2, 4]"):
                mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(arg3_1, 0.5)
                mul_1: "f32[2, 4]" = torch.ops.aten.mul.Tensor(arg2_1, arg2_1)
                rsub: "f32[2, 4]" = torch.ops.aten.rsub.Scalar(mul_1, 1)
                mul_2: "f32[2, 4]" = torch.ops.aten.mul.Tensor(mul, rsub)
                hops_kernel_einsum: "f32[2, 4]" = torch.ops.higher_order.hops_kernel_einsum(mul_2, arg1_1, hops.KernelParams.of(equation='bo,oi->bi'))
                hops_kernel_einsum_1: "f32[4, 4]" = torch.ops.higher_order.hops_kernel_einsum(mul_2, arg0_1, hops.KernelParams.of(equation='bo,bi->oi'))
                return (hops_kernel_einsum, mul_2, hops_kernel_einsum_1)
""")
