"""local_map under torch.compile(fullgraph=True) and strict torch.export."""

import torch

import hops
from hops import LocalMapSpec, Mesh, Partial, Replicate, Shard
from hops.local_map import LocalMapArgumentError
from tests.helpers.snapshot import TestCase, compile_trace, readable

MESH = Mesh((2, 2), ("data", "model"))


def matmul(x, w):
    return x @ w


sharded_matmul = hops.local_map(
    matmul,
    mesh=MESH,
    in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),
    out_placements=(Shard(0), Partial()),
)

BIAS = torch.randn(4)


def with_bias(x, w):
    return x @ w + BIAS


biased_matmul = hops.local_map(
    with_bias,
    mesh=MESH,
    in_placements=((Shard(0), Replicate()), (Replicate(), Replicate())),
    out_placements=(Shard(0), Replicate()),
)


def block(x, w):
    return sharded_matmul(x, w) * 2


class Block(torch.nn.Module):
    def forward(self, x, w):
        return block(x, w)


def capture():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    return graphs, backend


class TestLocalMapDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_dynamo_graph_keeps_one_region_with_its_typed_spec(self):
        graphs, backend = capture()
        x, w = torch.randn(8, 6), torch.randn(6, 4)
        self.assertEqual(torch.compile(block, backend=backend, fullgraph=True)(x, w), block(x, w))
        self.assertEqual(len(graphs), 1)
        (node,) = [n for n in graphs[0].graph.nodes if n.target is hops.local_map_hop]
        self.assertIsInstance(node.args[-1], LocalMapSpec)
        self.assertExpectedInline(readable(graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[8, 6]", L_w_: "f32[6, 4]"):
        l_x_ = L_x_
        l_w_ = L_w_
        matmul_body_0 = self.matmul_body_0
        hops_local_map = torch.ops.higher_order.hops_local_map(matmul_body_0, l_x_, l_w_, (), hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)S(1), RS(0)', 'S(0)P'))
        outputs: "f32[8, 4]" = hops_local_map[0]
        mul: "f32[8, 4]" = outputs * 2
        return (mul,)
    class matmul_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[4, 3]", l_w_: "f32[3, 4]"):
            result: "f32[4, 4]" = l_x_ @ l_w_
            return (result,)
""")

    def test_closed_over_tensor_is_lifted_as_a_replicated_input(self):
        graphs, backend = capture()
        x, w = torch.randn(8, 6), torch.randn(6, 4)
        compiled = torch.compile(biased_matmul, backend=backend, fullgraph=True)
        self.assertEqual(compiled(x, w), x @ w + BIAS)
        (node,) = [n for n in graphs[0].graph.nodes if n.target is hops.local_map_hop]
        self.assertEqual(len(node.args[-2]), 1)  # the lifted tuple: BIAS

    def test_aot_graphs_under_torch_compile_and_gradients(self):
        x, w = torch.randn(8, 6, requires_grad=True), torch.randn(6, 4, requires_grad=True)
        graphs, _ = compile_trace(block, x, w)
        reference_x, reference_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ((reference_x @ reference_w) * 2).sum().backward()
        self.assertEqual(x.grad, reference_x.grad)
        self.assertEqual(w.grad, reference_w.grad)
        self.assertExpectedInline(readable(graphs["backward"]), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[8, 6]", primals_2: "f32[6, 4]", tangents_1: "f32[8, 4]"):
        mul_1: "f32[8, 4]" = torch.ops.aten.mul.Tensor(tangents_1, 2)
        matmul_bwd_body_0 = self.matmul_bwd_body_0
        hops_local_map_1 = torch.ops.higher_order.hops_local_map(matmul_bwd_body_0, primals_1, primals_2, mul_1, hops.LocalMapSpec(hops.Mesh.of(data=2, model=2), 'S(0)S(1), RS(0), S(0)R', 'S(0)S(1), PS(0)'))
        getitem_1: "f32[8, 6]" = hops_local_map_1[0]
        getitem_2: "f32[6, 4]" = hops_local_map_1[1]
        return (getitem_1, getitem_2)
    class matmul_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[4, 3]", arg1_1: "f32[3, 4]", arg2_1: "f32[4, 4]"):
            t: "f32[3, 4]" = torch.ops.aten.t.default(arg0_1)
            mm: "f32[3, 4]" = torch.ops.aten.mm.default(t, arg2_1)
            t_1: "f32[4, 3]" = torch.ops.aten.t.default(arg1_1)
            mm_1: "f32[4, 3]" = torch.ops.aten.mm.default(arg2_1, t_1)
            return (mm_1, mm)
""")

    def test_a_different_placement_recompiles(self):
        graphs, backend = capture()

        def run(x, placements):
            region = hops.local_map(matmul, mesh=MESH, in_placements=(placements, (Replicate(), Replicate())),
                                    out_placements=placements)
            return region(x, torch.eye(4))

        compiled = torch.compile(run, backend=backend, fullgraph=True)
        x = torch.randn(8, 4)
        for placements in ((Shard(0), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(0))):
            self.assertEqual(compiled(x, placements), x)
        specs = [next(n.args[-1] for n in g.graph.nodes if n.target is hops.local_map_hop) for g in graphs]
        self.assertEqual([s.in_placements[0] for s in specs], [(Shard(0), Replicate()), (Replicate(), Shard(0))])


    def test_a_body_error_reaches_a_fullgraph_caller_as_its_cause(self):
        # As in eager: the typed error (an AssertionError, as torch's local_map raises). Under
        # fullgraph, Dynamo's Unsupported carries it as its cause.
        from torch._dynamo.exc import Unsupported

        region = hops.local_map(lambda x: (x + 1, x + 2), mesh=MESH, in_placements=((Shard(0), Replicate()),),
                                out_placements=((Shard(0), Replicate()),))
        message = r"returned \('Tensor', 'Tensor'\), which does not match out_placements: 1 placements for 2 outputs"
        x = torch.randn(8, 4)
        with self.assertRaisesRegex(LocalMapArgumentError, message):
            region(x)
        self.assertTrue(issubclass(LocalMapArgumentError, AssertionError))
        torch._dynamo.reset()
        with self.assertRaisesRegex(Unsupported, message) as compiled:
            torch.compile(region, backend="eager", fullgraph=True)(x)
        self.assertIsInstance(compiled.exception.__cause__, LocalMapArgumentError)
