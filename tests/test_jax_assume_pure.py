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
