"""No HOP returns a result that differs from its reference without raising.

One test class per way a HOP used to go silently wrong or refuse a valid program: closures,
random numbers, higher-order gradients, mutation, aliasing, factories, nesting, lying
kernels. Each compares with the plain-torch reference (a Python loop, a single-device
computation) with the same seed, eager and traced, with gradcheck where differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from functorch.compile import aot_function, nop
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Mesh, Replicate, Shard
from tests.helpers.snapshot import TestCase, aot_trace

LINE = Mesh((2,), ("a",))
GRID = Mesh((2, 2), ("data", "model"))


def python_loop(fn, init, xs, *additional):
    carry, ys = init, []
    for x in xs:
        carry, y = fn(carry, x, *additional)
        ys.append(y)
    return carry, torch.stack(ys)


def grads_of(fn, inputs):
    outputs = fn(*inputs)
    leaves = [o for o in torch.utils._pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)]
    return torch.autograd.grad(sum(o.sum() for o in leaves), inputs, allow_unused=True)


class TestClosedOverTensorsGetGradients(TestCase):
    def test_local_map_of_a_linear_module_updates_its_weight_eager_and_compiled(self):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        f = hops.local_map(lin, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        x = torch.randn(4, 4)
        f(x).sum().backward()
        weight_grad, bias_grad = lin.weight.grad.clone(), lin.bias.grad.clone()
        lin.zero_grad()
        lin(x).sum().backward()  # the reference: rows are independent, so one device would do
        self.assertEqual(weight_grad, lin.weight.grad)
        self.assertEqual(bias_grad, lin.bias.grad)
        lin.zero_grad()
        torch.compile(f, backend="aot_eager", fullgraph=True)(x).sum().backward()
        self.assertEqual(weight_grad, lin.weight.grad)

    def test_a_real_parameter_inside_a_fake_trace_is_refused_naming_it(self):
        lin = torch.nn.Linear(4, 4)
        f = hops.local_map(lin, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        with self.assertRaisesRegex(TypeError, r"local_map\(Linear\): the body reads Linear parameter 'weight'.*functional_call"):
            aot_function(f, nop)(torch.randn(4, 4, requires_grad=True))

    def test_parameters_passed_by_functional_call_are_traced_inputs_with_gradients(self):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)

        def program(x, params):
            body = lambda t: torch.func.functional_call(lin, params, (t,))  # noqa: E731  (closes over traced params)
            return hops.local_map(body, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))(x)

        params = {k: v.detach().clone().requires_grad_() for k, v in lin.named_parameters()}
        x = torch.randn(4, 4, requires_grad=True)
        aot_function(program, nop)(x, params).sum().backward()
        lin(x.detach()).sum().backward()
        self.assertEqual(params["weight"].grad, lin.weight.grad)
        self.assertEqual(params["bias"].grad, lin.bias.grad)

    def test_scan_and_named_scope_closures_get_gradients_in_every_mode(self):
        w = torch.randn(3, 3, dtype=torch.double, requires_grad=True)

        def step(c, x):
            return torch.tanh(c @ w + x), c.sum()

        scope = hops.named_scope("s")(lambda x: (x @ w).sin())
        c0, xs = torch.randn(2, 3, dtype=torch.double), torch.randn(4, 2, 3, dtype=torch.double)
        for fn in (lambda w: hops.scan(step, c0, xs), lambda w: scope(c0)):
            self.assertTrue(torch.autograd.gradcheck(fn, (w,)))
        expected = grads_of(lambda w: python_loop(step, c0, xs)[0], (w,))
        self.assertEqual(grads_of(lambda w: hops.scan(step, c0, xs)[0], (w,)), expected)
        # Traced, a closure over a traced value is lifted: the weight is an input of the program.
        def traced(c0, xs, w):
            return hops.scan(lambda c, x: (torch.tanh(c @ w + x), c.sum()), c0, xs)[0]

        traced_w = w.detach().clone().requires_grad_()
        _, _, out = aot_trace(traced, c0, xs, traced_w)
        self.assertEqual(out, python_loop(step, c0, xs)[0])
        self.assertEqual(traced_w.grad, expected[0])


class TestRandomNumbersAreReplayedNotRedrawn(TestCase):
    def test_dropout_in_a_local_map_body_gets_the_gradient_of_its_own_mask(self):
        f = hops.local_map(
            lambda x: F.dropout(x, 0.5) * 2, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),)
        )
        for run in ("eager", "aot"):
            x = torch.randn(8, 6, requires_grad=True)
            if run == "eager":
                y = f(x)
                y.backward(torch.ones_like(y))
            else:
                _, _, y = aot_trace(f, x)
            # d(2 * dropout(x)) / dx is 4 where the mask kept x, 0 where it dropped it.
            self.assertEqual(x.grad, (y != 0).float() * 4, msg=run)

    def test_random_values_in_a_scan_step_are_the_ones_differentiated_with_or_without_remat(self):
        def step(c, x):
            r = torch.rand_like(x)
            return c + x * r, r  # ys returns the draws: d(final carry)/dx must equal them

        for remat in (False, True):
            for run in ("eager", "aot"):
                x = torch.randn(5, 3, requires_grad=True)
                if run == "eager":
                    c, ys = hops.scan(step, torch.zeros(3), x, remat=remat)
                    c.sum().backward()
                else:
                    _, _, (c, ys) = aot_trace(lambda x: hops.scan(step, torch.zeros(3), x, remat=remat), x)
                self.assertEqual(x.grad, ys, msg=f"remat={remat} {run}")

    def test_eager_scan_draws_the_same_numbers_as_the_python_loop(self):
        def step(c, x):
            return c + F.dropout(x, 0.3), c

        xs = torch.randn(4, 5)
        torch.manual_seed(7)
        expected = python_loop(step, torch.zeros(5), xs)
        torch.manual_seed(7)
        self.assertEqual(hops.scan(step, torch.zeros(5), xs), expected)


class TestHigherOrderGradients(TestCase):
    def test_gradgradcheck_of_every_body_hop(self):
        double = dict(dtype=torch.double, requires_grad=True)
        c0, xs = torch.randn(2, **double), torch.randn(3, 2, **double)

        def step(c, x):
            return c * x.sin(), (c * x).sum()

        region = hops.local_map(lambda x: x.sin() * x, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
        scope = hops.named_scope("s")(lambda x: x.sin() * x)
        x = torch.randn(4, 2, **double)
        for name, fn, inputs in (
            ("scan", lambda c0, xs: hops.scan(step, c0, xs), (c0, xs)),
            ("scan remat", lambda c0, xs: hops.scan(step, c0, xs, remat=True), (c0, xs)),
            ("local_map", region, (x,)),
            ("named_scope", scope, (x,)),
        ):
            with self.subTest(name):
                self.assertTrue(torch.autograd.gradcheck(fn, inputs))
                self.assertTrue(torch.autograd.gradgradcheck(fn, inputs))

    def test_create_graph_gives_the_reference_second_derivative(self):
        def step(c, x):
            return c * c * x, c

        c0 = torch.tensor(0.5, requires_grad=True)
        xs = torch.tensor([0.9, 1.1])
        (g,) = torch.autograd.grad(hops.scan(step, c0, xs)[0], c0, create_graph=True)
        (gg,) = torch.autograd.grad(g, c0)
        (g_ref,) = torch.autograd.grad(python_loop(step, c0, xs)[0], c0, create_graph=True)
        (gg_ref,) = torch.autograd.grad(g_ref, c0)
        self.assertEqual((g, gg), (g_ref, gg_ref))
        self.assertNotEqual(float(gg), 0.0)


class TestBodiesCannotWriteIntoTheCallersTensors(TestCase):
    def test_writes_are_refused_before_anything_runs_naming_the_tensor(self):
        xs, init, w = torch.ones(3, 2), torch.zeros(2), torch.ones(())

        def writes_x(c, x):
            x.mul_(2)
            return c + x, None

        def writes_carry(c, x):
            c.add_(1)
            return c * 1, None

        def writes_closure(c, x):
            w.add_(1)
            return c + x * w, None

        cases = [
            (writes_x, r"^scan\(writes_x\): the body writes into its input xs in place"),
            (writes_carry, r"^scan\(writes_carry\): the body writes into its input init in place"),
            (writes_closure, r"scan\(writes_closure\): the body writes in place into 'w' \(shape \(\) torch.float32, closed over by writes_closure\)"),
        ]
        for step, message in cases:
            for run in (lambda: hops.scan(step, init, xs), lambda: make_fx(lambda i, x: hops.scan(step, i, x), tracing_mode="fake")(init, xs)):
                with self.subTest(step.__name__), self.assertRaisesRegex(ValueError, message):
                    run()
        self.assertEqual((xs, init, w), (torch.ones(3, 2), torch.zeros(2), torch.ones(())))

    def test_a_local_copy_may_be_written(self):
        def step(c, x):
            y = x.clone()
            y.mul_(2)
            return c + y, y

        xs = torch.randn(3, 2)
        self.assertEqual(hops.scan(step, torch.zeros(2), xs), python_loop(step, torch.zeros(2), xs))


class TestValidProgramsRun(TestCase):
    def test_tensors_created_inside_a_step_with_inputs_that_need_gradients(self):
        def step(c, x):
            bias = torch.zeros(2) + torch.arange(2.0) + torch.tensor(0.5) + torch.randn(2) * 0
            return c + x * 2 + bias, torch.ones(()) * c.sum()

        for run in ("eager", "aot"):
            xs = torch.randn(3, 2, requires_grad=True)
            expected = grads_of(lambda xs: python_loop(step, torch.zeros(2), xs), (xs.detach().requires_grad_(),))
            if run == "eager":
                got = grads_of(lambda xs: hops.scan(step, torch.zeros(2), xs), (xs,))
            else:
                aot_trace(lambda xs: hops.scan(step, torch.zeros(2), xs), xs)
                got = (xs.grad,)
            self.assertEqual(got, expected, msg=run)

    def test_a_custom_autograd_function_in_a_step(self):
        scale = torch.tensor(3.0)

        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * scale

            @staticmethod
            def backward(ctx, grad):
                return grad * scale  # reads a captured tensor

        def step(c, x):
            return c + Scaled.apply(x), c

        xs = torch.randn(3, 2, requires_grad=True)
        hops.scan(step, torch.zeros(2), xs)[0].sum().backward()
        self.assertEqual(xs.grad, torch.full((3, 2), 3.0))

    def test_a_scan_may_return_a_view_of_its_slice_eager_and_traced(self):
        def step(c, x):
            return c + x.sum(), x.t()

        xs = torch.randn(3, 2, 4)
        expected = python_loop(step, torch.zeros(()), xs)
        self.assertEqual(hops.scan(step, torch.zeros(()), xs), expected)
        gm = make_fx(lambda xs: hops.scan(step, torch.zeros(()), xs), tracing_mode="fake")(xs)
        self.assertEqual(gm(xs), expected)

    def test_a_local_map_with_a_closure_inside_a_scan(self):
        w = torch.randn(2, requires_grad=True)
        region = hops.local_map(lambda x: x * w, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))

        def step(c, x):
            return c + region(x), c.sum()

        def reference(c, x):
            return c + x * w, c.sum()

        xs = torch.randn(3, 4, 2)
        expected_grad = grads_of(lambda w_: python_loop(reference, torch.zeros(4, 2), xs)[0], (w,))
        self.assertEqual(grads_of(lambda w_: hops.scan(step, torch.zeros(4, 2), xs)[0], (w,)), expected_grad)
        # Traced: the region closes over a traced weight; scan and region both lift it.
        def traced(xs, w):
            region = hops.local_map(lambda x: x * w, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
            return hops.scan(lambda c, x: (c + region(x), c.sum()), torch.zeros(4, 2), xs)[0]

        traced_w = w.detach().clone().requires_grad_()
        _, _, out = aot_trace(traced, xs, traced_w)
        self.assertEqual(out, python_loop(reference, torch.zeros(4, 2), xs)[0])
        self.assertEqual(traced_w.grad, expected_grad[0])


    def test_nested_bodies_closing_over_one_weight_trace_like_eager(self):
        # Every pairing of an enclosing body (scan step, named scope) and a nested one (region,
        # scan, named scope), both reading one traced weight from their closures, the nested
        # one called twice alike (so what a trace makes for it may be reused): AOTAutograd's
        # values and gradients are eager's. What a nested body's closure reads depends on the
        # enclosing level (its stand-in, or the input a lifted tensor became).
        def inner_of(kind, w):
            if kind == "local_map":
                return hops.local_map(lambda x: x * w, mesh=LINE, in_placements=((Shard(0),),), out_placements=(Shard(0),))
            if kind == "scan":
                return lambda x: hops.scan(lambda c, r: (c + r * w, c.sum()), torch.zeros(2), x)[0]
            return hops.named_scope("inner")(lambda x: x * w.sin())

        def reference_inner(kind, w):
            if kind == "scan":
                return lambda x: torch.zeros(2) + (x * w).sum(0)
            return (lambda x: x * w) if kind == "local_map" else (lambda x: x * w.sin())

        def program(outer, inner, w, xs):
            nested = inner_of(inner, w)
            step = lambda c, x: (c + nested(x).sum() * w + nested(x + 1).sum(), c.sum())  # noqa: E731
            if outer == "scan":
                return hops.scan(step, torch.zeros(2), xs)[0]
            return hops.named_scope("outer")(lambda xs: python_loop(step, torch.zeros(2), xs)[0])(xs)

        def reference(inner, w, xs):
            nested = reference_inner(inner, w)
            return python_loop(lambda c, x: (c + nested(x).sum() * w + nested(x + 1).sum(), c.sum()), torch.zeros(2), xs)[0]

        xs = torch.randn(3, 4, 2)
        w = torch.randn(2)
        for outer in ("scan", "named_scope"):
            for inner in ("local_map", "scan", "named_scope"):
                with self.subTest(outer=outer, inner=inner):
                    traced_w = w.clone().requires_grad_()
                    _, _, out = aot_trace(lambda w, xs: program(outer, inner, w, xs), traced_w, xs)
                    eager_w = w.clone().requires_grad_()
                    expected = reference(inner, eager_w, xs)
                    self.assertEqual(out, expected)
                    self.assertEqual(traced_w.grad, torch.autograd.grad(expected.sum(), eager_w)[0])

class TestKernelsCannotLieAboutTheirOutputs(TestCase):
    def test_an_abstract_rule_that_disagrees_is_refused_eager_and_compiled(self):
        lying = hops.kernel(lambda x: x * 2, abstract=lambda x: x.new_empty(x.shape[0], 1), name="lying_kernel")
        x = torch.randn(4, 4)
        message = r"^kernel\(lying_kernel\): the kernel returned \[4, 4\] float32 but its abstract rule promises \[4, 1\] float32"
        with self.assertRaisesRegex(RuntimeError, message):
            lying(x)
        with self.assertRaisesRegex(Exception, message):
            torch.compile(lambda x: lying(x) + 1, backend="aot_eager", fullgraph=True)(x)


class TestReplicatedRegionsStayReplicated(TestCase):
    def test_grid_regions_with_replicated_and_partial_layouts_match_the_reference(self):
        torch.manual_seed(0)
        x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 3, requires_grad=True)
        f = hops.local_map(
            lambda x, w: x @ w,
            mesh=GRID,
            in_placements=((Shard(0), Shard(1)), (Replicate(), Shard(0))),  # the contracted dim over "model"
            out_placements=(Shard(0), hops.Partial()),
        )
        self.assertEqual(f(x, w), x @ w)
        self.assertEqual(grads_of(f, (x, w)), grads_of(lambda x, w: x @ w, (x, w)))
