"""Kernels, einsum and named scopes inside a ``hops.scan`` body: the scan's forward and
backward bodies keep them (their rules are the standard dispatch keys, so any subgraph
tracer records them), and gradients match the unrolled loop."""

import torch
from snapshot import TestCase
from test_kernel import aot_graphs, scaled_tanh

import hops
import passes


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
