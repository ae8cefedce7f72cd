"""``hops._dynamo.register_subgraph_hop``: torch.compile keeps a subgraph HOP whole.

The HOP under test is a toy defined here, a local_map in miniature: it splits every tensor
argument into ``n = spec.mesh.shape[0]`` pieces along dim 0, runs the body on each piece and
concatenates the results along dim 0. The body sees local shapes and the HOP returns global
ones, so these tests fail if Dynamo speculates the body on the wrong shapes (the
``body_example_args`` hook) or takes the output shapes from the body instead of the HOP.
"""

import pytest
import torch
import torch.utils._pytree as pytree
from functorch.compile import make_boxed_func
from snapshot import TestCase, readable
from torch._C import DispatchKey
from torch._higher_order_ops.utils import _maybe_run_with_interpreter, reenter_make_fx
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)

from hops import Mesh, Shard, ShardingSpec, _dynamo

TWO_SHARDS = ShardingSpec(Mesh((2,), ("x",)), (Shard(0),))
FOUR_SHARDS = ShardingSpec(Mesh((4,), ("x",)), (Shard(0),))


class ToyMap(HigherOrderOperator):
    """``hops_test_toy_map(body, *tensors, spec)``; node form ``(body, *tensors, lifted, spec)``.

    ``lifted`` (what Dynamo adds: tensors the body closes over) goes whole to every call.
    """

    def __init__(self) -> None:
        super().__init__("hops_test_toy_map")

    def __call__(self, body, *args):
        tensors, lifted, spec = split_args(args)
        return super().__call__(body, *tensors, lifted, spec)

    @staticmethod
    def body_example_args(args, specs):
        """The first shard of each arg: what one body call receives."""
        (spec,) = specs
        return tuple(t.chunk(spec.mesh.shape[0])[0] for t in args)


toy_map = ToyMap()


def split_args(args):
    """``(*tensors, [lifted,] spec)`` -> ``(tensors, lifted, spec)``."""
    *operands, spec = args
    if operands and isinstance(operands[-1], tuple):
        return tuple(operands[:-1]), operands[-1], spec
    return tuple(operands), (), spec


def concat_dim0(pieces):
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces)
    return type(pieces[0])(torch.cat(parts) for parts in zip(*pieces))


@toy_map.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body, *args):
    tensors, lifted, spec = split_args(args)
    shards = zip(*(t.chunk(spec.mesh.shape[0]) for t in tensors))
    return concat_dim0([body(*shard, *lifted) for shard in shards])


@toy_map.py_impl(FakeTensorMode)
def _fake(mode, body, *args):
    tensors, lifted, spec = split_args(args)
    num_shards = spec.mesh.shape[0]
    with mode:
        local = body(*ToyMap.body_example_args(tensors, (spec,)), *lifted)
        # Global shape from the local one: dim 0 times the number of shards.
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.new_empty((t.shape[0] * num_shards, *t.shape[1:])), local
        )


@toy_map.py_functionalize_impl
def _functionalize(ctx, body, *args):
    tensors, lifted, spec = split_args(args)
    tensors, lifted = ctx.unwrap_tensors(tensors), ctx.unwrap_tensors(lifted)
    functional_body = ctx.functionalize(_maybe_run_with_interpreter(body))
    with ctx.redispatch_to_next():
        out = toy_map(functional_body, *tensors, tuple(lifted), spec)
    return ctx.wrap_tensors(out)


@toy_map.py_impl(ProxyTorchDispatchMode)
def _proxy(mode, body, *args):
    tensors, lifted, spec = split_args(args)
    with disable_proxy_modes_tracing():
        local = [t.clone() for t in ToyMap.body_example_args(tensors, (spec,))]
    body_gm = reenter_make_fx(body)(*local, *lifted)
    mode.tracer.root.register_module(mode.tracer.get_fresh_qualname("body"), body_gm)
    node_args = pytree.tree_map(mode.tracer.unwrap_proxy, (body_gm, *tensors, lifted, spec))
    out_proxy = mode.tracer.create_proxy("call_function", toy_map, node_args, {})
    out = toy_map(body_gm, *tensors, lifted, spec)
    return track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


@toy_map.py_autograd_impl
def _autograd(body, *args):
    # Only reached when an input requires grad; these tests are forward-only.
    raise RuntimeError("hops_test_toy_map has no autograd rule")


_dynamo.register_subgraph_hop(toy_map)


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

    return toy_map(add_weight, x, TWO_SHARDS).sin()


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
    def test_eager_and_make_fx_agree(self):
        x = torch.randn(8, 3)
        total, scaled = toy_map(sum_and_scale, x, TWO_SHARDS)
        self.assertEqual(total, torch.stack([x[:4].sum(0), x[4:].sum(0)]))
        self.assertEqual(scaled, x * 4)
        traced = make_fx(lambda x: toy_map(sum_and_scale, x, TWO_SHARDS))(x)
        (node,) = toy_nodes(traced)
        self.assertEqual(node.args[-1], TWO_SHARDS)
        self.assertEqual(traced(x), (total, scaled))


class TestDynamo(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_one_node_with_subgraph_and_typed_spec(self):
        x = torch.randn(8, 3)
        result, graphs = capture(two_outputs, x, TWO_SHARDS)
        self.assertEqual(len(graphs), 1)  # fullgraph=True: no graph break
        (node,) = toy_nodes(graphs[0])
        body, tensor, lifted, spec = node.args
        self.assertIs(type(spec), ShardingSpec)
        self.assertEqual(spec, TWO_SHARDS)
        self.assertEqual(body.op, "get_attr")
        self.assertIsInstance(getattr(graphs[0], body.target), torch.fx.GraphModule)
        self.assertEqual(lifted, ())
        self.assertEqual(result, two_outputs(x, TWO_SHARDS))

    def test_output_shapes_come_from_the_hop_and_body_sees_local_shapes(self):
        x = torch.randn(8, 3)
        _, graphs = capture(two_outputs, x, FOUR_SHARDS)
        (node,) = toy_nodes(graphs[0])
        body_gm = getattr(graphs[0], node.args[0].target)
        (placeholder,) = body_gm.graph.find_nodes(op="placeholder")
        self.assertEqual(placeholder.meta["example_value"].shape, (2, 3))  # local: 8 / 4 rows
        total, scaled = node.meta["example_value"]
        self.assertEqual(tuple(total.shape), (4, 3))  # the HOP's rule: 1 row per shard
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
        hops_test_toy_map: "f32[8, 3]" = torch.ops.higher_order.hops_test_toy_map(add_weight_body_0, l_x_, (l_w_,), hops.ShardingSpec(mesh=hops.Mesh(shape=(2,), axis_names=('x',)), placements=(hops.Shard(0),)));  add_weight_body_0 = l_x_ = l_w_ = None
        sin: "f32[8, 3]" = hops_test_toy_map.sin();  hops_test_toy_map = None
        return (sin,)
    class add_weight_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[4, 3]", l_w_: "f32[3]"):
            mul: "f32[4, 3]" = l_x_ * 2;  l_x_ = None
            add: "f32[4, 3]" = mul + l_w_;  mul = l_w_ = None
            return add
""")

    def test_aot_forward_graph_keeps_the_hop(self):
        from torch._dynamo.backends.common import aot_autograd

        forward_graphs = []

        def fw_compiler(gm, example_inputs):
            forward_graphs.append(gm)
            return make_boxed_func(gm)

        # Forward-only (no input requires grad): the toy has no autograd rule.
        backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=fw_compiler)
        x, w = torch.randn(8, 3), torch.randn(3)
        result, _ = capture(two_outputs, x, FOUR_SHARDS, backend=backend)
        self.assertEqual(result, two_outputs(x, FOUR_SHARDS))
        (node,) = toy_nodes(forward_graphs[0])
        self.assertEqual(node.args[-1], FOUR_SHARDS)

        torch._dynamo.reset()
        forward_graphs.clear()
        result, _ = capture(with_closure, x, w, backend=backend)
        self.assertEqual(result, with_closure(x, w))
        self.assertExpectedInline(readable(forward_graphs[0]), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 3]", arg1_1: "f32[3]"):
        body0 = self.body0
        hops_test_toy_map: "f32[8, 3]" = torch.ops.higher_order.hops_test_toy_map(body0, arg0_1, (arg1_1,), hops.ShardingSpec(mesh=hops.Mesh(shape=(2,), axis_names=('x',)), placements=(hops.Shard(0),)));  body0 = arg0_1 = arg1_1 = None
        sin: "f32[8, 3]" = torch.ops.aten.sin.default(hops_test_toy_map);  hops_test_toy_map = None
        return (sin,)
    class body0(torch.nn.Module):
        def forward(self, arg0_1: "f32[4, 3]", arg1_1: "f32[3]"):
            mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(arg0_1, 2);  arg0_1 = None
            add: "f32[4, 3]" = torch.ops.aten.add.Tensor(mul, arg1_1);  mul = arg1_1 = None
            return add
""")

    def test_a_different_spec_recompiles_an_equal_one_does_not(self):
        seen = []

        def backend(gm, example_inputs):
            seen.append(toy_nodes(gm)[0].args[-1])
            return gm

        compiled = torch.compile(with_spec_argument, backend=backend, fullgraph=True)
        x = torch.randn(8, 3)
        self.assertEqual(compiled(x, TWO_SHARDS), with_spec_argument(x, TWO_SHARDS))
        compiled(x, ShardingSpec(Mesh((2,), ("x",)), (Shard(0),)))
        self.assertEqual(compiled(x, FOUR_SHARDS), with_spec_argument(x, FOUR_SHARDS))
        compiled(x, TWO_SHARDS)
        self.assertEqual(seen, [TWO_SHARDS, FOUR_SHARDS])


    # 2.9 builds C++ shape guards by first compiling CPU-feature probes (~16 s, once per
    # process); 2.13 defaults to Python guards. Same guards either way.
    @torch._dynamo.config.patch(enable_cpp_symbolic_shape_guards=False)
    def test_list_output_spec_built_in_the_trace_and_dynamic_shapes(self):
        def add_and_scale(x, y):
            spec = ShardingSpec(Mesh((2,), ("x",)), (Shard(0),))
            return toy_map(lambda a, b: [a + b, a * b.shape[0]], x, y, spec)

        x, y = torch.randn(8, 3), torch.randn(8, 3)
        for dynamic in (False, True):
            torch._dynamo.reset()
            graphs = []

            def backend(gm, example_inputs):
                graphs.append(gm)
                return gm

            compiled = torch.compile(
                add_and_scale, backend=backend, fullgraph=True, dynamic=dynamic
            )
            self.assertEqual(compiled(x, y), add_and_scale(x, y))
            (node,) = toy_nodes(graphs[0])
            self.assertEqual(node.args[-1], TWO_SHARDS)
            # Dynamic: the body's input sizes are symbols of the outer graph, lifted too.
            self.assertEqual(len(node.args[-2]), 2 if dynamic else 0)

    def test_body_returning_its_input_is_rejected(self):
        # The body's outputs must not alias its inputs (the HOP returns new tensors).
        compiled = torch.compile(
            lambda x: toy_map(lambda a: a, x, TWO_SHARDS), backend="eager", fullgraph=True
        )
        with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, "aliasing"):
            compiled(torch.randn(8, 3))


if __name__ == "__main__":
    pytest.main([__file__])
