"""scan_hop: jax.lax.scan semantics, gradients, errors, and every frontend's graph."""

import importlib
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import Mesh, Replicate, Shard, ShardingSpec
from hops._body_hop.subgraph import body_name
from tests.helpers.snapshot import TestCase, aot_trace, readable

MESH = Mesh((2, 2), ("data", "model"))
ROWS = ShardingSpec(MESH, (Shard(0), Replicate()))


def rnn_step(h, x, w):
    h = torch.tanh(h @ w + x)
    return h, h.sum(-1)


def python_loop(fn, init, xs, *additional, reverse=False):
    """The reference: a Python loop with jax.lax.scan's contract."""
    carry, ys = init, [None] * xs.shape[0]
    order = range(xs.shape[0] - 1, -1, -1) if reverse else range(xs.shape[0])
    for i in order:
        carry, ys[i] = fn(carry, xs[i], *additional)
    return carry, torch.stack(ys)


def rnn_inputs(dtype=torch.float32, requires_grad=False, small=False):
    torch.manual_seed(0)
    batch, length, width = (1, 3, 2) if small else (2, 5, 4)
    h = torch.randn(batch, width, dtype=dtype)
    xs = torch.randn(length, batch, width, dtype=dtype)
    w = torch.randn(width, width, dtype=dtype) / 2
    return [t.requires_grad_(requires_grad) for t in (h, xs, w)]


def aot_graphs(fn, *args):
    forward, backward, _ = aot_trace(fn, *args)
    return forward, backward


class TestSemantics(TestCase):
    def test_matches_a_python_loop(self):
        h, xs, w = rnn_inputs()
        for reverse in (False, True):
            expected = python_loop(rnn_step, h, xs, w, reverse=reverse)
            self.assertEqual(hops.scan(rnn_step, h, xs, additional_inputs=(w,), reverse=reverse), expected)

    def test_pytree_carries_xs_and_ys(self):
        def step(carry, x):
            total = carry["total"] + x["a"] * x["b"]
            return {"total": total, "count": carry["count"] + 1}, (total.sum(), {"max": x["a"].amax()})

        init = {"total": torch.zeros(3), "count": torch.zeros((), dtype=torch.int64)}
        xs = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}
        carry, (sums, stats) = hops.scan(step, init, xs)
        self.assertEqual(carry["total"], (xs["a"] * xs["b"]).sum(0))
        self.assertEqual(int(carry["count"]), 4)
        self.assertEqual(sums, (xs["a"] * xs["b"]).cumsum(0).sum(-1))
        self.assertEqual(stats["max"], xs["a"].amax(-1))

    def test_closed_over_tensors_are_lifted_and_get_gradients(self):
        h, xs, w = rnn_inputs(torch.double, requires_grad=True, small=True)

        def step(carry, x):
            return rnn_step(carry, x, w)

        self.assertTrue(torch.autograd.gradcheck(lambda h, xs, w: hops.scan(step, h, xs), (h, xs, w)))

    def test_a_step_may_return_no_y(self):
        h, xs, w = rnn_inputs(torch.double, requires_grad=True, small=True)
        last, ys = hops.scan(lambda c, x: (rnn_step(c, x, w)[0], None), h, xs)
        self.assertIsNone(ys)
        self.assertEqual(last, python_loop(rnn_step, h, xs, w)[0])
        last.sum().backward()
        self.assertEqual(w.grad.shape, w.shape)

    def test_length_without_xs_and_length_zero(self):
        carry, ys = hops.scan(lambda c, x: (c * 2, c), torch.ones(3), None, length=4)
        self.assertEqual(carry, torch.full((3,), 16.0))
        self.assertEqual(ys, torch.tensor([1.0, 2, 4, 8]).unsqueeze(-1).expand(4, 3))
        carry, ys = hops.scan(lambda c, x: (c + x, c * x), torch.ones(3), torch.empty(0, 3))
        self.assertEqual(carry, torch.ones(3))
        self.assertEqual(ys.shape, (0, 3))

    def test_gradients_match_the_loop_in_both_remat_modes(self):
        for remat in (False, True):
            for reverse in (False, True):
                h, xs, w = rnn_inputs(torch.double, requires_grad=True, small=True)

                def scanned(h, xs, w):
                    return hops.scan(rnn_step, h, xs, additional_inputs=(w,), reverse=reverse, remat=remat)

                self.assertTrue(torch.autograd.gradcheck(scanned, (h, xs, w)), f"remat={remat} reverse={reverse}")
                got = torch.autograd.grad(sum(o.sum() for o in scanned(h, xs, w)), (h, xs, w))
                expected = torch.autograd.grad(
                    sum(o.sum() for o in python_loop(rnn_step, h, xs, w, reverse=reverse)), (h, xs, w)
                )
                self.assertEqual(got, expected)



class TestTraceReuse(TestCase):
    """AOTAutograd runs a program twice in one fake mode: a step's joint is traced once."""

    def test_both_aot_passes_and_equal_scans_share_one_trace_of_a_step(self):
        # Each distinct step is inspected once and its joint traced once: a second scan of it
        # and AOTAutograd's second pass reuse them (the steps read no tensor but their inputs,
        # so their code keys are equal in both passes).
        call_module = importlib.import_module("hops._body_hop.call")
        scan_module = importlib.import_module("hops.scan")  # (hops.scan is the function)
        inspected, plans = [], []
        inspect_body, make_plan = call_module.inspect_body, scan_module._ScanPlan.__init__

        def counted_inspection(body, *args, **kwargs):
            inspected.append(body_name(body))
            return inspect_body(body, *args, **kwargs)

        def counted_plan(plan, body, inputs, spec):
            plans.append(body_name(body))
            make_plan(plan, body, inputs, spec)

        def other(h, x, w):
            return torch.sin(h @ w - x), torch.sin(h @ w - x).sum(-1)

        def program(h, xs, w):
            first, _ = hops.scan(rnn_step, h, xs, additional_inputs=(w,))
            second, _ = hops.scan(rnn_step, first, xs, additional_inputs=(w,))
            return hops.scan(other, second, xs, additional_inputs=(w,))[0].sum()

        def reference(h, xs, w):
            first, _ = python_loop(rnn_step, h, xs, w)
            second, _ = python_loop(rnn_step, first, xs, w)
            return python_loop(other, second, xs, w)[0].sum()

        args = rnn_inputs(requires_grad=True)
        with unittest.mock.patch.object(call_module, "inspect_body", counted_inspection), unittest.mock.patch.object(
            scan_module._ScanPlan, "__init__", counted_plan
        ):
            _, _, out = aot_trace(program, *args)
            self.assertEqual(sorted(inspected), ["other", "rnn_step"])
            self.assertEqual(sorted(plans), ["other", "rnn_step"])
            # A new trace (a new fake mode) traces again rather than reusing.
            aot_trace(program, *rnn_inputs(requires_grad=True))
            self.assertEqual(len(plans), 4)
        self.assertEqual(out, reference(*args))
        self.assertEqual(tuple(a.grad for a in args), torch.autograd.grad(reference(*args), args))

    def test_a_body_reading_module_parameters_gets_their_gradients_under_functional_call(self):
        # A bound method is the same key in both of AOTAutograd's passes, but reads the
        # parameters functional_call swapped in for that pass: what a body closes over is
        # inspected per pass (reusing the first pass's wrappers lost the gradient, silently).
        line = Mesh((2,), ("data",))

        class Cell(torch.nn.Module):
            def __init__(self, hop):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(4, 4) / 2)
                self.hop = hop

            def step(self, c, x):
                return torch.tanh(c @ self.w + x), c.sum(-1)

            def forward(self, h, xs):
                if self.hop == "scan":
                    return hops.scan(self.step, h, xs)[0].square().sum()
                if self.hop == "named_scope":
                    return hops.named_scope("cell")(self.step)(h, xs[0])[0].square().sum()
                region = hops.local_map(self.step, mesh=line, in_placements=((Shard(0),), (Shard(0),)), out_placements=((Shard(0),), (Shard(0),)))
                return region(h, xs[0])[0].square().sum()

        for hop in ("scan", "named_scope", "local_map"):
            with self.subTest(hop=hop):
                cell = Cell(hop)
                h, xs, _ = rnn_inputs()
                params = {name: p.detach().requires_grad_() for name, p in cell.named_parameters()}
                _, _, out = aot_trace(lambda params, h, xs: torch.func.functional_call(cell, params, (h, xs)), params, h, xs)
                expected = cell(h, xs)
                self.assertEqual(out, expected)
                self.assertIsNotNone(params["w"].grad)
                self.assertEqual(params["w"].grad, torch.autograd.grad(expected, cell.w)[0])

    def test_a_new_closure_per_pass_shares_one_plan_with_equal_code_and_state(self):
        # A step written as a lambda inside the program is a new function object in each of
        # AOTAutograd's passes, over new wrappers of the same tensors: its joint is traced
        # once. The same code over other Python values is another plan; over other tensors in
        # the same places (same metadata) the same plan, each call reading its own tensors.
        scan_module = importlib.import_module("hops.scan")  # (hops.scan is the function)

        def program(h, xs, w, v):
            outputs = []
            for weight, scale in ((w, 2.0), (v, 2.0), (w, 3.0)):
                outputs.append(hops.scan(lambda c, x: (torch.tanh(c @ weight * scale + x), c.sum(-1)), h, xs)[0])
            return sum(o.square().sum() for o in outputs)

        def reference(h, xs, w, v):
            return sum(
                python_loop(lambda c, x, _: (torch.tanh(c @ weight * scale + x), c.sum(-1)), h, xs, None)[0].square().sum()
                for weight, scale in ((w, 2.0), (v, 2.0), (w, 3.0))
            )

        plans = []
        make_plan = scan_module._ScanPlan.__init__

        def counted(plan, body, inputs, spec):
            plans.append(body)
            make_plan(plan, body, inputs, spec)

        h, xs, w = rnn_inputs(requires_grad=True)
        v = torch.randn_like(w).requires_grad_()
        args = (h, xs, w, v)
        with unittest.mock.patch.object(scan_module._ScanPlan, "__init__", counted):
            _, _, out = aot_trace(program, *args)
        self.assertEqual(len(plans), 2)  # scale 2.0 and 3.0, over both passes and both weights
        self.assertEqual(out, reference(*args))
        self.assertEqual(tuple(a.grad for a in args), torch.autograd.grad(reference(*args), args))

    def test_gradients_traced_with_symbolic_shapes_run_at_other_sizes(self):
        # Symbolic sizes in the step are recomputed by the backward step, not saved per step.
        def program(h, xs, w):
            return hops.scan(rnn_step, h, xs, additional_inputs=(w,))[0].sum()

        gm = make_fx(lambda *a: torch.autograd.grad(program(*a), a), tracing_mode="symbolic")(*rnn_inputs(requires_grad=True))
        h, xs, w = rnn_inputs(requires_grad=True)
        h, xs = h.detach().repeat(3, 1).requires_grad_(), xs.detach().repeat(1, 3, 1).requires_grad_()  # batch 2 -> 6
        expected = torch.autograd.grad(python_loop(rnn_step, h, xs, w)[0].sum(), (h, xs, w))
        self.assertEqual(gm(h, xs, w), expected)


class TestBadCalls(TestCase):
    def test_errors_name_the_leaf(self):
        h, xs, w = rnn_inputs()
        cases = [
            (lambda: hops.scan(lambda c, x: (c.sum(), x), h, xs), TypeError, r"^scan\(lambda\): the carry at init changes from \(2, 4\)"),
            (lambda: hops.scan(lambda c, x: (c.double(), x), h, xs), TypeError, r"^scan\(lambda\): the carry at init changes .* torch.float64"),
            (lambda: hops.scan(lambda c, x: ((c, c), x), h, xs), TypeError, "carry changes structure"),
            (lambda: hops.scan(lambda c, x: (c, x), h, (xs, xs[:3])), ValueError, r"^scan\(lambda\): xs\[1\] has length 3 but xs\[0\] has 5"),
            (lambda: hops.scan(lambda c, x: (c, x), h, None), ValueError, "no xs to scan over and no length"),
            (lambda: hops.scan(lambda c, x: (c, "y"), h, xs), TypeError, r"^scan\(lambda\): y is a str, not a tensor or a Python number"),
            (lambda: hops.scan(lambda c, x: c, h, xs), TypeError, r"must return \(new_carry, y\)"),
            (
                lambda: make_fx(lambda h, xs: hops.scan(lambda c, x: (c if x.sum() > 0 else -c, x), h, xs), tracing_mode="fake")(h, xs),
                ValueError,
                "the body reads a tensor's value in Python",
            ),
            (lambda: hops.scan(lambda c, x: (c, x), h, torch.tensor(1.0)), ValueError, r"^scan\(lambda\): xs is a 0-d tensor"),
            (lambda: hops.scan(lambda c, x: (c, x), ["one"], xs), TypeError, r"^scan\(lambda\): init\[0\] is a str, not a tensor or a Python number"),
            (lambda: hops.scan(lambda c, x: (c, x), h, xs, length=3), ValueError, "length=3 but xs have length 5"),
            (lambda: hops.scan_hop(lambda c, x: (c, x), h, xs, "spec"), TypeError, "must be a hops.ScanSpec"),
        ]
        # Raised as JAX and torch (TypeError) and torch_xla (ValueError) raise them.
        for error in (TypeError, ValueError):
            cases += [
                (lambda: hops.scan(1, h, xs), error, r"^scan: fn must be callable, got int"),
                (lambda: hops.scan(lambda c, x: (c, x), h, 1), error, r"^scan\(lambda\): xs is a int, not a tensor"),
            ]
        for call, error, message in cases:
            with self.subTest(message=message), self.assertRaisesRegex(error, message):
                call()

    def test_body_mutating_its_input_is_refused(self):
        def step(c, x):
            c.add_(x)
            return c * 1, x * 1

        h, xs, _ = rnn_inputs()
        before = h.clone()
        for run in (
            lambda: hops.scan(step, h, xs),
            lambda: make_fx(lambda h, xs: hops.scan(step, h, xs))(h, xs),
            lambda: aot_trace(lambda h, xs: hops.scan(step, h * 1, xs), h.requires_grad_(), xs),
        ):
            with self.assertRaisesRegex(ValueError, r"^scan\(step\): the body writes into its input init in place"):
                run()
        self.assertEqual(h, before)


def annotated_step(h, x, w):
    h = hops.annotate_sharding(torch.tanh(h @ w + x), ROWS)
    return h, h.sum(-1)


class TestGraphs(TestCase):
    def test_make_fx_fake_and_functionalized(self):
        h, xs, w = rnn_inputs()

        def mutating_outside(h, xs, w):
            h = h.clone()
            h.mul_(2)
            return hops.scan(annotated_step, h, xs, additional_inputs=(w,))

        fake = make_fx(mutating_outside, tracing_mode="fake")(h, xs, w)
        functional = make_fx(torch.func.functionalize(mutating_outside, remove="mutations_and_views"))(h, xs, w)
        self.assertExpectedInline(readable(functional), """\
class mutating_outside(torch.nn.Module):
    def forward(self, h_1: "f32[2, 4]", xs_1: "f32[5, 2, 4]", w_1: "f32[4, 4]"):
        clone: "f32[2, 4]" = torch.ops.aten.clone.default(h_1)
        mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(clone, 2)
        annotated_step_body_0 = self.annotated_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(annotated_step_body_0, mul, xs_1, w_1, hops.ScanSpec(1, 1, length=5))
        getitem: "f32[2, 4]" = hops_scan[0]
        getitem_1: "f32[5, 2]" = hops_scan[1]
        return (getitem, getitem_1)
    class annotated_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]"):
            mm: "f32[2, 4]" = torch.ops.aten.mm.default(arg0_1, arg2_1)
            add: "f32[2, 4]" = torch.ops.aten.add.Tensor(mm, arg1_1)
            tanh: "f32[2, 4]" = torch.ops.aten.tanh.default(add)
            hops_sharding_annotation: "f32[2, 4]" = torch.ops.higher_order.hops_sharding_annotation(tanh, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(hops_sharding_annotation, [-1])
            return (hops_sharding_annotation, sum_1)
""")
        self.assertEqual(readable(fake).count("hops_scan("), 1)
        self.assertEqual(functional(h, xs, w), mutating_outside(h, xs, w))

    def test_aot_forward_and_backward_bodies_keep_the_annotation(self):
        for remat in (False, True):
            h, xs, w = rnn_inputs(requires_grad=True)
            forward, backward = aot_graphs(
                lambda h, xs, w: hops.scan(annotated_step, h, xs, additional_inputs=(w,), remat=remat), h, xs, w
            )
            for graph in (forward, backward):
                body = next(m for name, m in graph.named_modules() if name.endswith("body_0"))
                self.assertIn("torch.ops.higher_order.hops_sharding_annotation", body.code)
            if remat:
                self.assertExpectedInline(readable(backward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_2: "f32[5, 2, 4]", primals_3: "f32[4, 4]", getitem_2: "f32[5, 2, 4]", tangents_1: "f32[2, 4]", tangents_2: "f32[5, 2]"):
        new_zeros: "f32[4, 4]" = torch.ops.aten.new_zeros.default(tangents_1, [4, 4], dtype = torch.float32, pin_memory = False)
        annotated_step_bwd_body_0 = self.annotated_step_bwd_body_0
        hops_scan_1 = torch.ops.higher_order.hops_scan(annotated_step_bwd_body_0, tangents_1, new_zeros, getitem_2, primals_2, tangents_2, primals_3, hops.ScanSpec(2, 3, length=5, reverse=True))
        getitem_3: "f32[2, 4]" = hops_scan_1[0]
        getitem_4: "f32[4, 4]" = hops_scan_1[1]
        getitem_5: "f32[5, 2, 4]" = hops_scan_1[2]
        return (getitem_3, getitem_5, getitem_4)
    class annotated_step_bwd_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[4, 4]", arg2_1: "f32[2, 4]", arg3_1: "f32[2, 4]", arg4_1: "f32[2]", arg5_1: "f32[4, 4]"):
            mm: "f32[2, 4]" = torch.ops.aten.mm.default(arg2_1, arg5_1)
            add: "f32[2, 4]" = torch.ops.aten.add.Tensor(mm, arg3_1)
            tanh: "f32[2, 4]" = torch.ops.aten.tanh.default(add)
            unsqueeze: "f32[2, 1]" = torch.ops.aten.unsqueeze.default(arg4_1, -1)
            expand: "f32[2, 4]" = torch.ops.aten.expand.default(unsqueeze, [2, 4])
            add_1: "f32[2, 4]" = torch.ops.aten.add.Tensor(arg0_1, expand)
            hops_sharding_annotation: "f32[2, 4]" = torch.ops.higher_order.hops_sharding_annotation(add_1, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))
            tanh_backward: "f32[2, 4]" = torch.ops.aten.tanh_backward.default(hops_sharding_annotation, tanh)
            t: "f32[4, 2]" = torch.ops.aten.t.default(arg2_1)
            mm_1: "f32[4, 4]" = torch.ops.aten.mm.default(t, tanh_backward)
            t_1: "f32[4, 4]" = torch.ops.aten.t.default(arg5_1)
            mm_2: "f32[2, 4]" = torch.ops.aten.mm.default(tanh_backward, t_1)
            add_2: "f32[4, 4]" = torch.ops.aten.add.Tensor(arg1_1, mm_1)
            return (mm_2, add_2, tanh_backward)
""")
            else:
                self.assertExpectedInline(readable(forward), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 4]", primals_2: "f32[5, 2, 4]", primals_3: "f32[4, 4]"):
        annotated_step_body_0 = self.annotated_step_body_0
        hops_scan = torch.ops.higher_order.hops_scan(annotated_step_body_0, primals_1, primals_2, primals_3, hops.ScanSpec(1, 1, length=5))
        getitem: "f32[2, 4]" = hops_scan[0]
        getitem_1: "f32[5, 2]" = hops_scan[1]
        getitem_2: "f32[5, 2, 4]" = hops_scan[2]
        getitem_3: "f32[5, 2, 4]" = hops_scan[3]
        return (getitem, getitem_1, primals_3, getitem_2, getitem_3)
    class annotated_step_body_0(torch.nn.Module):
        def forward(self, arg0_1: "f32[2, 4]", arg1_1: "f32[2, 4]", arg2_1: "f32[4, 4]"):
            mm: "f32[2, 4]" = torch.ops.aten.mm.default(arg0_1, arg2_1)
            add: "f32[2, 4]" = torch.ops.aten.add.Tensor(mm, arg1_1)
            tanh: "f32[2, 4]" = torch.ops.aten.tanh.default(add)
            hops_sharding_annotation: "f32[2, 4]" = torch.ops.higher_order.hops_sharding_annotation(tanh, hops.ShardingSpec(hops.Mesh.of(data=2, model=2), 'S(0)R'))
            sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(hops_sharding_annotation, [-1])
            clone: "f32[2, 4]" = torch.ops.aten.clone.default(arg0_1)
            return (hops_sharding_annotation, sum_1, clone, tanh)
""")

    def test_local_map_region_in_the_body_survives_forward_and_backward(self):
        def scale(h):
            return h * 2

        region = hops.local_map(scale, mesh=MESH, in_placements=((Shard(0), Replicate()),), out_placements=(Shard(0), Replicate()))

        def step(h, x, w):
            h = region(torch.tanh(h @ w + x))
            return h, h.sum(-1)

        h, xs, w = rnn_inputs(requires_grad=True)
        forward, backward = aot_graphs(lambda h, xs, w: hops.scan(step, h, xs, additional_inputs=(w,)), h, xs, w)
        self.assertIn("hops_local_map(scale_body", forward.step_body_0.code)
        backward_body = next(m for n, m in backward.named_modules() if n.endswith("bwd_body_0"))
        self.assertIn("torch.ops.higher_order.hops_local_map", backward_body.code)

    def test_export_strict_and_non_strict(self):
        class Rnn(torch.nn.Module):
            def forward(self, h, xs, w):
                return hops.scan(annotated_step, h, xs, additional_inputs=(w,))

        h, xs, w = rnn_inputs()
        for strict in (True, False):
            ep = torch.export.export(Rnn(), (h, xs, w), strict=strict)
            self.assertEqual(ep.module()(h, xs, w), python_loop(rnn_step, h, xs, w))
            text = readable(ep.graph_module)
            self.assertEqual(text.count("torch.ops.higher_order.hops_scan("), 1)
            self.assertIn("hops.ScanSpec(1, 1, length=5)", text)
            self.assertIn("hops_sharding_annotation", text)

    def test_dynamo_names_the_body_after_the_users_step(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        h, xs, w = rnn_inputs()
        compiled = torch.compile(lambda h, xs, w: hops.scan(rnn_step, h, xs, additional_inputs=(w,)), backend=backend, fullgraph=True)
        self.assertEqual(compiled(h, xs, w), python_loop(rnn_step, h, xs, w))
        self.assertEqual([name for name, _ in graphs[0].named_children()], ["rnn_step_body_0"])



class TestScanPasses(TestCase):
    def test_unroll_scan_gives_a_loop_free_graph_with_the_same_values(self):
        h, xs, w = rnn_inputs()
        gm = make_fx(lambda h, xs, w: hops.scan(annotated_step, h, xs, additional_inputs=(w,)))(h, xs, w)
        unrolled = passes.unroll_scan(gm)
        code = unrolled.code
        self.assertNotIn("hops_scan", code)
        self.assertEqual(code.count("hops_sharding_annotation("), 5)  # one per step
        self.assertEqual(unrolled(h, xs, w), python_loop(rnn_step, h, xs, w))
        inlined = passes.inline_hops(unrolled)
        self.assertNotIn("hops_", inlined.code)
        self.assertEqual(inlined(h, xs, w), python_loop(rnn_step, h, xs, w))

    def test_inline_hops_recurses_into_scan_bodies_and_keeps_the_scan(self):
        h, xs, w = rnn_inputs()
        gm = passes.inline_hops(make_fx(lambda h, xs, w: hops.scan(annotated_step, h, xs, additional_inputs=(w,)))(h, xs, w))
        self.assertIn("hops_scan", gm.code)
        self.assertNotIn("hops_sharding_annotation", gm.annotated_step_body_0.code)
        self.assertEqual(gm(h, xs, w), python_loop(rnn_step, h, xs, w))

    def test_lowered_scan_runs_off_xla_as_a_loop(self):
        h, xs, w = rnn_inputs()
        gm = passes.lower_to_xla(make_fx(lambda h, xs, w: hops.scan(annotated_step, h, xs, additional_inputs=(w,)))(h, xs, w))
        self.assertIn("run_scan", gm.code)
        self.assertEqual(gm(h, xs, w), python_loop(rnn_step, h, xs, w))


WEAK_STEPS = {
    "add": lambda c, x: (c + x, x),
    "scale and add": lambda c, x: (c * 0.5 + x, x - c),
    "max": lambda c, x: (torch.maximum(c + x, x), x * 2),
}


@settings(max_examples=40, deadline=None)
@given(
    init=st.one_of(st.integers(-3, 3), st.floats(-2, 2, allow_nan=False, width=32)),
    dtype=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float32, torch.float64]),
    step=st.sampled_from(sorted(WEAK_STEPS)),
)
def test_a_python_number_init_takes_the_dtype_the_python_loop_gives_it(init, dtype, step):
    # JAX's weak types: a Python number init behaves as the number itself does in a Python
    # loop, where the first step's result (number op tensor) decides the carry's dtype.
    fn = WEAK_STEPS[step]
    xs = torch.arange(1, 5).to(dtype)
    c, ys = init, []
    for x in xs:
        c, y = fn(c, x)
        ys.append(y)
    if not isinstance(c, torch.Tensor) or any(y.dtype != ys[0].dtype for y in ys):
        return  # the loop's own dtypes drift: no consistent carry to compare with
    carry, stacked = hops.scan(fn, init, xs)
    assert carry.dtype == c.dtype, (carry.dtype, c.dtype)
    torch.testing.assert_close(carry, c)
    torch.testing.assert_close(stacked, torch.stack(ys))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_torch_compile_with_dynamic_shapes_runs_any_length_and_batch(remat, reverse):
    # dynamic=True makes the scan length symbolic: the spec then holds no length, and one
    # compiled graph serves every length and batch.
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(c, x):
        return torch.tanh(c + x), c.sum(-1)

    def program(x):
        last, ys = hops.scan(step, torch.zeros(x.shape[1], x.shape[2], dtype=x.dtype), x, remat=remat, reverse=reverse)
        return last * 2 + ys.sum(0).unsqueeze(-1)

    def reference(x):
        c, ys = torch.zeros(x.shape[1], x.shape[2], dtype=x.dtype), [None] * x.shape[0]
        for i in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
            c, ys[i] = step(c, x[i])
        return c * 2 + torch.stack(ys).sum(0).unsqueeze(-1)

    # dynamic=None (torch.compile's default) compiles static shapes first, then recompiles
    # with symbolic sizes when they change (how often is torch's policy, not checked).
    for dynamic, frames in ((True, 1), (None, None)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(program, backend=counter, dynamic=dynamic, fullgraph=True)
        for shape in ((4, 5, 3), (6, 8, 3), (7, 2, 3)):  # no two sizes equal: Dynamo would duck-size them
            x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            out = compiled(x)
            torch.testing.assert_close(out, reference(x))
            (grad,) = torch.autograd.grad(out.sum(), x)
            torch.testing.assert_close(grad, torch.autograd.grad(reference(x).sum(), x)[0])
        assert frames is None or counter.frame_count == frames


COMPILE_A_SCAN_IN_A_FRESH_PROCESS = """
import torch, hops
def layer(h, x):
    return h + x, h.sum()
compiled = torch.compile(lambda h, xs: hops.scan(layer, h, xs), backend="eager", fullgraph=True)
print(compiled(torch.zeros(3), torch.ones(2, 3))[0].tolist())
"""


def test_torch_compile_of_a_scan_in_a_fresh_process():
    # Regression: naming the body used `re`, which Dynamo 2.9 fails to trace when the
    # pattern is not yet in re's cache (a fresh process), so whether it worked depended on
    # what ran before.
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", COMPILE_A_SCAN_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[2.0, 2.0, 2.0]"


if __name__ == "__main__":
    pytest.main([__file__])
