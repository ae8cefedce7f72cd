"""``hops._body_hop.base.BodyHOP`` under Dynamo: torch.compile keeps a body HOP whole.

The HOP under test is a toy defined here, a local_map in miniature: it splits its first
``spec.num_split`` tensors into ``spec.pieces`` pieces along dim 0, runs the body on each
piece (with the other tensors whole) and concatenates the results along dim 0. The body
sees local shapes and the HOP returns global ones, so these tests fail if Dynamo speculates
the body on the wrong shapes (``body_inputs``) or takes the output shapes from the body
instead of the HOP, and a closed-over tensor must become a whole (not split) input.
"""

import dataclasses

import torch
from functorch.compile import make_boxed_func
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, make_fx

from hops import _compat, _dynamo
from hops._body_hop.base import BodyHOP
from hops.specs import _FxLiteral
from tests.helpers.snapshot import TestCase, readable


@dataclasses.dataclass(frozen=True, repr=False)
class ToySpec(_FxLiteral):
    pieces: int
    num_split: int

    def __repr__(self):
        return f"ToySpec({self.pieces}, {self.num_split})"


# Generated code prints the spec as ``ToySpec(...)``: bind the name there.
_compat.register_fx_global("ToySpec", "from tests.test_dynamo_subgraph_hop import ToySpec", ToySpec)


class ToyMap(BodyHOP):
    spec_type = ToySpec

    def __init__(self):
        super().__init__("hops_test_toy_map")

    def check(self, body, operands, spec):
        pass

    def body_inputs(self, operands, spec):
        return tuple(t.chunk(spec.pieces)[0] if i < spec.num_split else t for i, t in enumerate(operands))

    def outputs_from_body(self, outputs, operands, spec):
        return tuple(o.new_empty((o.shape[0] * spec.pieces, *o.shape[1:])) for o in outputs)

    def run(self, body, operands, spec):
        split, whole = operands[: spec.num_split], operands[spec.num_split :]
        results = [body(*pieces, *whole) for pieces in zip(*(t.chunk(spec.pieces) for t in split))]
        return tuple(torch.cat(parts) for parts in zip(*results))

    def fold_lifted(self, operands, spec, lifted):
        return [*operands, *lifted], spec  # lifted tensors go whole to every piece


toy_map = ToyMap()
toy_map.py_impl(DispatchKey.CompositeExplicitAutograd)(lambda body, *args: toy_map.run(body, *toy_map.split_args(args)))
toy_map.py_impl(FakeTensorMode)(toy_map.fake_rule)
toy_map.py_functionalize_impl(toy_map.functionalize_rule)
toy_map.py_impl(ProxyTorchDispatchMode)(toy_map.proxy_rule)
toy_map.py_impl(DispatchKey.Autograd)(toy_map.autograd_rule)
_dynamo.register_subgraph_hop(toy_map)

TWO, FOUR = ToySpec(2, 1), ToySpec(4, 1)


# --------------------------------------------------------------------------- programs


def sum_and_scale(a):
    # Both outputs depend on the local shape: rows of the sum, and a.shape[0] as a constant.
    return a.sum(0, keepdim=True), a * a.shape[0]


def two_outputs(x, spec):
    total, scaled = toy_map(sum_and_scale, x, spec)
    return total.cos(), scaled + 1


def with_closure(x, w):
    def add_weight(a):
        return a * 2 + w  # w: closed over, not an argument of the HOP

    return toy_map(add_weight, x, TWO).sin()


def with_spec_argument(x, spec):
    return toy_map(lambda a: a.sum(0, keepdim=True), x, spec) + 1


def capture(fn, *args, backend=None):
    """Compile ``fn`` with ``fullgraph=True``; return (result, Dynamo graphs)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm if backend is None else backend(gm, example_inputs)

    result = torch.compile(fn, backend=record, fullgraph=True)(*args)
    return result, graphs


def toy_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is toy_map]


class TestEager(TestCase):
    def test_eager_and_make_fx_agree_and_return_the_bodys_structure(self):
        x, w = torch.randn(8, 3), torch.randn(3)
        total, scaled = toy_map(sum_and_scale, x, TWO)
        self.assertEqual(total, torch.stack([x[:4].sum(0), x[4:].sum(0)]))
        self.assertEqual(scaled, x * 4)
        self.assertIsInstance(toy_map(lambda a: a * 2, x, TWO), torch.Tensor)  # one tensor, not a tuple
        self.assertEqual(with_closure(x, w), (x * 2 + w).sin())
        traced = make_fx(lambda x: toy_map(sum_and_scale, x, TWO))(x)
        (node,) = toy_nodes(traced)
        self.assertEqual(node.args[-1], TWO)
        self.assertEqual(traced(x), (total, scaled))


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_one_node_with_subgraph_and_typed_spec(self):
        x = torch.randn(8, 3)
        result, graphs = capture(two_outputs, x, TWO)
        self.assertEqual(len(graphs), 1)  # fullgraph=True: no graph break
        (node,) = toy_nodes(graphs[0])
        body, tensor, lifted, spec = node.args
        self.assertIs(type(spec), ToySpec)
        self.assertEqual(spec, TWO)
        self.assertEqual(body.op, "get_attr")
        self.assertIsInstance(getattr(graphs[0], body.target), torch.fx.GraphModule)
        self.assertEqual(lifted, ())
        self.assertEqual(result, two_outputs(x, TWO))

    def test_output_shapes_come_from_the_hop_and_body_sees_local_shapes(self):
        x = torch.randn(8, 3)
        _, graphs = capture(two_outputs, x, FOUR)
        (node,) = toy_nodes(graphs[0])
        body_gm = getattr(graphs[0], node.args[0].target)
        (placeholder,) = body_gm.graph.find_nodes(op="placeholder")
        self.assertEqual(placeholder.meta["example_value"].shape, (2, 3))  # local: 8 / 4 rows
        total, scaled = node.meta["example_value"]
        self.assertEqual(tuple(total.shape), (4, 3))  # the HOP's rule: 1 row per piece
        self.assertEqual(tuple(scaled.shape), (8, 3))

    def test_body_closing_over_a_tensor(self):
        x, w = torch.randn(8, 3), torch.randn(3)
        result, graphs = capture(with_closure, x, w)
        self.assertEqual(result, with_closure(x, w))
        # w is lifted: a trailing input of the body, passed in the tuple before the spec.
        self.assertExpectedInline(readable(graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[8, 3]", L_w_: "f32[3]"):
        l_x_ = L_x_
        l_w_ = L_w_
        add_weight_body_0 = self.add_weight_body_0
        hops_test_toy_map = torch.ops.higher_order.hops_test_toy_map(add_weight_body_0, l_x_, (l_w_,), ToySpec(2, 1))
        getitem: "f32[8, 3]" = hops_test_toy_map[0]
        sin: "f32[8, 3]" = getitem.sin()
        return (sin,)
    class add_weight_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[4, 3]", l_w_: "f32[3]"):
            mul: "f32[4, 3]" = l_x_ * 2
            add: "f32[4, 3]" = mul + l_w_
            return (add,)
""")

    def test_aot_forward_graph_keeps_the_hop(self):
        from torch._dynamo.backends.common import aot_autograd

        forward_graphs = []

        def fw_compiler(gm, example_inputs):
            forward_graphs.append(gm)
            return make_boxed_func(gm)

        # Forward-only (no input requires grad): the toy has no gradient layout.
        backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=fw_compiler)
        x, w = torch.randn(8, 3), torch.randn(3)
        result, _ = capture(two_outputs, x, FOUR, backend=backend)
        self.assertEqual(result, two_outputs(x, FOUR))
        (node,) = toy_nodes(forward_graphs[0])
        self.assertEqual(node.args[-1], FOUR)

        torch._dynamo.reset()
        forward_graphs.clear()
        result, _ = capture(with_closure, x, w, backend=backend)
        self.assertEqual(result, with_closure(x, w))
        (node,) = toy_nodes(forward_graphs[0])
        # The lifted tuple is folded into the operands: w rides whole, after x.
        self.assertEqual(len(node.args), 4)
        self.assertEqual(node.args[-1], TWO)

    def test_a_different_spec_recompiles_an_equal_one_does_not(self):
        seen = []

        def backend(gm, example_inputs):
            seen.append(toy_nodes(gm)[0].args[-1])
            return gm

        compiled = torch.compile(with_spec_argument, backend=backend, fullgraph=True)
        x = torch.randn(8, 3)
        self.assertEqual(compiled(x, TWO), with_spec_argument(x, TWO))
        compiled(x, ToySpec(2, 1))
        self.assertEqual(compiled(x, FOUR), with_spec_argument(x, FOUR))
        compiled(x, TWO)
        self.assertEqual(seen, [TWO, FOUR])

    # 2.9 builds C++ shape guards by first compiling CPU-feature probes (~16 s, once per
    # process); 2.13 defaults to Python guards. Same guards either way.
    @torch._dynamo.config.patch(enable_cpp_symbolic_shape_guards=False)
    def test_list_output_spec_built_in_the_trace_and_dynamic_shapes(self):
        def add_and_scale(x, y):
            spec = ToySpec(2, 2)
            return toy_map(lambda a, b: [a + b, a * b.shape[0]], x, y, spec)

        x, y = torch.randn(8, 3), torch.randn(8, 3)
        for dynamic in (False, True):
            torch._dynamo.reset()
            graphs = []

            def backend(gm, example_inputs):
                graphs.append(gm)
                return gm

            compiled = torch.compile(add_and_scale, backend=backend, fullgraph=True, dynamic=dynamic)
            result = compiled(x, y)
            self.assertIsInstance(result, list)  # the body's structure
            self.assertEqual(result, add_and_scale(x, y))
            (node,) = toy_nodes(graphs[0])
            self.assertEqual(node.args[-1], ToySpec(2, 2))
            # Dynamic: the body's input sizes are symbols of the outer graph, lifted too.
            self.assertEqual(len(node.args[-2]), 2 if dynamic else 0)

    def test_body_returning_its_input_gets_a_copy(self):
        compiled = torch.compile(lambda x: toy_map(lambda a: a, x, TWO), backend="aot_eager", fullgraph=True)
        x = torch.randn(8, 3)
        out = compiled(x)
        self.assertEqual(out, x)
        self.assertNotEqual(out.data_ptr(), x.data_ptr())
