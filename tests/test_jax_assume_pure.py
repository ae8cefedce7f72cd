"""``hops.assume_pure`` on target ``"jax"`` (``passes/jax/pure.py``): the function traced once per
signature and run as one jitted ``jax.vjp`` call, its backward one call of the vjp function;
values and gradients equal eager's (the same ``hops.assume_pure`` function run by torch).

4 virtual CPU devices: ``tests/conftest.py`` sets ``XLA_FLAGS`` before jax is imported.
"""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax", reason="target 'jax' needs jax (the 'jax' extra)")

import hops  # noqa: E402
from passes.jax.pure import assume_pure_on_jax  # noqa: E402
from tests.helpers.hop_db import ROWS  # noqa: E402
from tests.helpers.snapshot import TestCase  # noqa: E402


@hops.assume_pure
def recurrent(h, xs, w, *, scale):
    def step(h, x, w):
        h = hops.annotate_sharding(torch.tanh(h @ w + x) * scale, ROWS)
        return h, h.sum(-1)

    final, ys = hops.scan(step, h, xs, additional_inputs=(w,))
    return {"final": final, "ys": ys, "steps": torch.tensor(xs.shape[0])}


class TestAssumePureOnJax(TestCase):
    def inputs(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, 3, generator=g), torch.randn(5, 4, 3, generator=g), torch.randn(3, 3, generator=g)

    def check(self, function, reference, inputs, scale):
        leaves = [t.clone().requires_grad_() for t in inputs]
        got = function(*leaves, scale=scale)
        loss = got["final"].sum() + (got["ys"] * 2).sum()
        grads = torch.autograd.grad(loss, leaves)
        fresh = [t.clone().requires_grad_() for t in inputs]
        expected = reference(*fresh, scale=scale)
        expected_grads = torch.autograd.grad(expected["final"].sum() + (expected["ys"] * 2).sum(), fresh)
        for name in ("final", "ys", "steps"):
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        self.assertFalse(got["steps"].requires_grad)
        for name, a, b in zip(("h", "xs", "w"), grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"gradient of {name}: {m}")

    def test_values_and_gradients_equal_eager_through_jax_vjp(self):
        function = assume_pure_on_jax(recurrent)
        backward_calls = []
        self.check(function, recurrent, self.inputs(), 0.5)
        (entry,) = function._cache.values()
        # the backward is one call of the jitted vjp function (counted by wrapping it)
        jitted = entry.backward
        entry.backward = lambda vjp, cotangents: backward_calls.append(1) or jitted(vjp, cotangents)
        self.check(function, recurrent, self.inputs(1), 0.5)  # same signature: no new trace
        self.assertEqual((function.traces, len(backward_calls)), (1, 1))
        self.check(function, recurrent, self.inputs(2), 2.0)  # a new parameter value: a new trace
        self.assertEqual(function.traces, 2)

    def test_the_forward_is_one_jitted_function_holding_the_scan_and_the_constraint(self):
        function = assume_pure_on_jax(recurrent)
        h, xs, w = self.inputs()
        function(h, xs, w, scale=0.5)
        (entry,) = function._cache.values()
        text = entry.forward.lower(*(t.numpy() for t in (h, xs, w))).as_text()
        self.assertEqual(text.count("stablehlo.while"), 1)
        self.assertRegex(text, r"sdy\.sharding_constraint|mhlo\.sharding")

    def test_a_non_callable_is_refused_naming_it(self):
        with self.assertRaisesRegex(TypeError, r"assume_pure_on_jax: fn must be callable, got int 3"):
            assume_pure_on_jax(3)

    def check_dtypes(self, fn, x):
        """``fn`` on target jax gives eager's outputs and gradient: dtypes, and values (integers
        exactly; floats within their dtype's default tolerance, which 32-bit rounding misses)."""
        results = []
        for function in (assume_pure_on_jax(fn), fn):
            leaf = x.detach().clone().requires_grad_(x.requires_grad)
            outputs = function(leaf)
            grads = []
            if leaf.requires_grad:
                real = [torch.view_as_real(o) if o.is_complex() else o for o in outputs if o.requires_grad]
                grads = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(real)), leaf)
            results.append([*outputs, *grads])
        for i, (a, b) in enumerate(zip(*results)):
            exact = not (b.is_floating_point() or b.is_complex())
            torch.testing.assert_close(a, b, rtol=0 if exact else None, atol=0 if exact else None, msg=lambda m: f"result {i}: {m}")

    def test_int64_results_are_eagers_past_int32(self):
        big = torch.tensor([[2**40 + 3, -5, 7], [1, 2**33, -(2**35)]])
        self.check_dtypes(lambda v: (v.amax(1), v + 1, v.sum(), v > 2**32, (v > 0).sum()), big)

    def test_float64_results_and_gradients_are_computed_in_float64(self):
        near_one = torch.tensor([1 + 1e-12, 1 - 3e-12, 2.0], dtype=torch.float64, requires_grad=True)
        self.check_dtypes(lambda v: (((v - 1) * 1e12).square(), torch.exp(v * 300.0)), near_one)

    def test_a_complex_gradient_is_torchs_the_conjugate_of_jaxs(self):
        z = torch.tensor([1 + 1e-12 + 2j, 2 - 3j], dtype=torch.complex128, requires_grad=True)
        self.check_dtypes(lambda v: (((v - 1) * 1e12) * (v - 1j), (v * v).abs()), z)
