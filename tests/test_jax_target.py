"""Target ``"jax"`` (``passes/jax/``): a traced graph as a JAX function.

Every ``hop_db`` sample's forward graph and joint graph (outputs and gradients), lowered and
jitted, compute the reference; ``jax.grad`` of a lowered forward graph gives torch autograd's
gradients; the StableHLO jax emits holds Shardy's ``sdy.sharding_constraint`` for an annotation
(its gradient layout in the backward), ``sdy.manual_computation`` for a region, a
``stablehlo.while`` whose body holds the constraint for a scan, and the scope's name in the
locations; ATen ops are checked against torch on generated programs; an op without a rule is
refused naming it; and using the target leaves torch as it was (Dynamo still compiles a HOP,
the current accelerator is unchanged).

4 virtual CPU devices: ``tests/conftest.py`` sets ``XLA_FLAGS`` before jax is imported.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

ACCELERATOR_BEFORE_JAX = torch.accelerator.current_accelerator()

jax = pytest.importorskip("jax", reason="target 'jax' needs jax (the 'jax' extra)")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hops  # noqa: E402
import passes  # noqa: E402
from hops import Mesh, Partial, Replicate, Shard, ShardingSpec  # noqa: E402
from hops.lowering import jax_x64  # noqa: E402
from passes.jax import NoJaxRule, lower_to_jax  # noqa: E402
from tests.helpers.hop_db import COLUMNS, MESH, ROWS, SAMPLES, forward_backward, fresh  # noqa: E402
from tests.helpers.snapshot import TestCase  # noqa: E402
from tests.test_targets import joint  # noqa: E402


def arrays(tensors):
    return [t.detach().numpy() for t in tensors]


def close(test, actual, expected, what, rtol=1e-5):
    actual, expected = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    test.assertEqual(len(actual), len(expected), f"{what}: number of outputs")
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(torch.from_numpy(np.array(a)), e.detach(), rtol=rtol, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}[{i}]: {m}")


def weighted_loss(outputs):
    """What ``hop_db.forward_backward`` differentiates: output i weighted by i + 1."""
    return sum((o * (i + 1)).sum() for i, o in enumerate(pytree.tree_leaves(outputs)) if jnp.issubdtype(o.dtype, jnp.floating))


def stablehlo(function, *inputs, debug_info=False):
    return jax.jit(function).lower(*inputs).as_text(debug_info=debug_info)


def functions_called_in_while_bodies(text):
    """The text of every ``stablehlo.while`` body and of the functions it calls (transitively)."""
    functions = dict(re.findall(r"func\.func (?:public |private )?@(\S+)\((.*?)\n  \}", text, flags=re.S))
    bodies = re.findall(r"\} do \{(.*?)\n    \}", text, flags=re.S)
    seen, pending = [], list(bodies)
    while pending:
        chunk = pending.pop()
        seen.append(chunk)
        pending += [functions[name] for name in re.findall(r"func\.call @(\S+)\(", chunk) if name in functions]
    return bodies, "\n".join(seen)


def shardy_layout(mesh, placements, ndim):
    """How Shardy writes the layout of a rank-``ndim`` value with ``placements``: ``[{"data"}, {}]``."""
    dims = [[] for _ in range(ndim)]
    for axis, placement in zip(mesh.axis_names, placements):
        if isinstance(placement, Shard):
            dims[placement.dim].append(f'"{axis}"')
    return "[" + ", ".join("{" + ", ".join(axes) + "}" for axes in dims) + "]"


class TestSamples(TestCase):
    """Every ``hop_db`` sample, forward and joint (outputs and gradients of their sum)."""

    def test_every_sample_lowered_computes_the_reference(self):
        for sample in SAMPLES:
            for name, program, reference in (
                ("forward", sample.program, sample.reference),
                ("joint", joint(sample.program), joint(sample.reference)),
            ):
                with self.subTest(sample=sample.name, graph=name):
                    graph = make_fx(program, tracing_mode="fake")(*sample.inputs(0))
                    function = jax.jit(lower_to_jax(graph))
                    inputs = sample.inputs(1)
                    close(self, function(*arrays(inputs)), reference(*fresh(inputs)), f"{sample.name} {name}")

    def test_jax_grad_of_every_lowered_forward_is_torch_autograd(self):
        for sample in SAMPLES:
            with self.subTest(sample=sample.name):
                inputs = [t.detach() for t in sample.inputs(0)]
                function = lower_to_jax(make_fx(sample.program)(*inputs))
                values = arrays(sample.inputs(1))
                grads = jax.jit(jax.grad(lambda *xs: weighted_loss(function(*xs)), argnums=tuple(range(len(values)))))(*values)
                _, expected = forward_backward(sample.reference, fresh(sample.inputs(1)))
                close(self, grads, expected, f"{sample.name} gradients")

    def test_the_callers_graph_is_left_as_it_was(self):
        sample = SAMPLES[2]  # a scan: its body is a subgraph the lowering rewrites
        graph = make_fx(sample.program, tracing_mode="fake")(*sample.inputs(0))
        before = graph.print_readable(print_output=False)
        lower_to_jax(graph)
        self.assertEqual(graph.print_readable(print_output=False), before)
        inputs = sample.inputs(1)
        close(self, graph(*[t.detach() for t in inputs]), sample.reference(*inputs), "the caller's graph after lowering")


class TestShardyText(TestCase):
    def setUp(self):
        # torch_xla's jax features (its profiler's scopes among them, run by the XLA tests of the 2.9
        # leg in the same process) switch jax to GSPMD process-wide (torch_xla/_internal/
        # jax_workarounds.py); the shardings are then GSPMD custom calls. These tests read Shardy's.
        previous = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", True)
        self.addCleanup(jax.config.update, "jax_use_shardy_partitioner", previous)

    def test_an_annotation_is_a_sharding_constraint_and_its_gradient_layout_constrains_the_backward(self):
        def program(x):
            return hops.annotate_sharding(x * 2, ROWS, grad_spec=COLUMNS).sin()

        x = torch.randn(4, 4)
        function = lower_to_jax(make_fx(program)(x))
        forward = stablehlo(function, x.numpy())
        self.assertIn("sdy.mesh @mesh = <[\"data\"=2, \"model\"=2]>", forward)
        self.assertEqual(re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])>", forward), ['[{"data"}, {}]'])
        backward = stablehlo(jax.grad(lambda v: function(v).sum()), x.numpy())
        self.assertEqual(
            sorted(re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])>", backward)),
            ['[{"data"}, {}]', '[{}, {"model"}]'],  # the value's layout, then its gradient's (COLUMNS)
        )
        # and the gradient is eager's
        reference = x.clone().requires_grad_()
        program(reference).sum().backward()
        close(self, jax.grad(lambda v: function(v).sum())(x.numpy()), reference.grad, "gradient")

    def test_a_region_is_a_manual_computation(self):
        sample = SAMPLES[1]
        inputs = [t.detach() for t in sample.inputs(0)]
        text = stablehlo(lower_to_jax(make_fx(sample.program)(*inputs)), *arrays(inputs))
        self.assertEqual(text.count("sdy.manual_computation("), 1)
        self.assertIn('in_shardings=[<@mesh, [{"data"}, {}]>, <@mesh, [{}, {}]>] out_shardings=[<@mesh, [{"data"}, {}]>]', text)

    def test_partial_outputs_of_a_region_are_reduced(self):
        # The joint's backward region takes a cotangent pending a sum over "model" and returns
        # gradients pending sums: each must be all-reduced (and the values are eager's).
        sample = SAMPLES[1]
        graph = make_fx(joint(sample.program), tracing_mode="fake")(*sample.inputs(0))
        self.assertIn("'S(0)P, PP'", graph.print_readable(print_output=False))
        function = lower_to_jax(graph)
        text = stablehlo(function, *arrays(sample.inputs(0)))
        self.assertEqual(text.count("sdy.manual_computation("), 2)
        self.assertGreaterEqual(text.count("stablehlo.all_reduce"), 2)
        inputs = sample.inputs(1)
        close(self, function(*arrays(inputs)), joint(sample.reference)(*fresh(inputs)), "joint")

    def test_a_scan_is_a_while_whose_body_holds_the_constraint(self):
        def step(h, x, w):
            h = hops.annotate_sharding(torch.tanh(h @ w + x), ROWS)
            return h, h.sum(-1)

        def program(h, xs, w):
            return hops.scan(step, h, xs, additional_inputs=(w,))

        inputs = (torch.randn(4, 3), torch.randn(5, 4, 3), torch.randn(3, 3))
        text = stablehlo(lower_to_jax(make_fx(program)(*inputs)), *arrays(inputs))
        bodies, reachable = functions_called_in_while_bodies(text)
        self.assertEqual(len(bodies), 1, text)
        self.assertIn('sdy.sharding_constraint', reachable)
        self.assertIn('[{"data"}, {}]', reachable)

    def test_a_scope_names_the_ops_of_its_body(self):
        sample = SAMPLES[3]
        inputs = [t.detach() for t in sample.inputs(0)]
        text = stablehlo(lower_to_jax(make_fx(sample.program)(*inputs)), *arrays(inputs), debug_info=True)
        scope = re.search(r"ScopeSpec\('([^']+)'\)", make_fx(sample.program)(*inputs).print_readable(print_output=False))
        self.assertIsNotNone(scope)
        self.assertRegex(text, rf'loc\("[^"]*{re.escape(scope.group(1))}/[^"]*dot_general')

    def test_einsum_is_one_dot_general(self):
        sample = SAMPLES[5]
        inputs = [t.detach() for t in sample.inputs(0)]
        text = stablehlo(lower_to_jax(make_fx(sample.program)(*inputs)), *arrays(inputs))
        self.assertEqual(text.count("stablehlo.dot_general"), 1)
        self.assertNotIn("stablehlo.reshape", text)


class TestScans(TestCase):
    """Scan options and HOPs nested in scan bodies, against the Python loop."""

    def check_scan(self, step, reference_step, options, gradients=True):
        generator = torch.Generator().manual_seed(0)
        inputs = tuple(torch.randn(*shape, generator=generator) for shape in ((4, 3), (5, 4, 3), (3, 3)))
        graph = make_fx(lambda h, xs, w: hops.scan(step, h, xs, additional_inputs=(w,), **options))(*inputs)
        function = lower_to_jax(graph)
        h, xs, w = (t.clone().requires_grad_() for t in inputs)
        ys, order = {}, range(len(xs) - 1, -1, -1) if options.get("reverse") else range(len(xs))
        carry = h
        for i in order:
            carry, ys[i] = reference_step(carry, xs[i], w)
        expected = (carry, torch.stack([ys[i] for i in range(len(xs))]))
        close(self, jax.jit(function)(*arrays(inputs)), expected, f"scan {options}")
        if gradients:
            grads = jax.jit(jax.grad(lambda *v: weighted_loss(function(*v)), argnums=(0, 1, 2)))(*arrays(inputs))
            weighted_loss_torch = sum((o * (i + 1)).sum() for i, o in enumerate(expected))
            # float32 rounding accumulates over the steps (jax and torch differ in summation order)
            close(self, grads, torch.autograd.grad(weighted_loss_torch, (h, xs, w)), f"scan {options} gradients", rtol=1e-4)

    def test_reverse_unroll_remat_with_a_scope_an_einsum_and_a_constraint_in_the_body(self):
        @hops.named_scope("cell")
        def cell(h, w):
            return torch.tanh(hops.einsum("bi,ij->bj", h, w))

        def step(h, x, w):
            h = hops.annotate_sharding(cell(h, w) + x, ROWS)
            return h, h.sum(0)

        def reference_step(h, x, w):
            h = torch.tanh(h @ w) + x
            return h, h.sum(0)

        for options in ({}, {"reverse": True, "unroll": 2}, {"remat": True}):
            with self.subTest(**options):
                self.check_scan(step, reference_step, options)

    def test_a_scan_in_a_scan_body(self):
        def step(h, x, w):
            h = hops.annotate_sharding(torch.tanh(h @ w) + x, ROWS)
            return h, hops.scan(lambda c, y: (c * 0.5 + y, c.sum()), h.sum(0), h)[0]

        def reference_step(h, x, w):
            h = torch.tanh(h @ w) + x
            c = h.sum(0)
            for y in h:
                c = c * 0.5 + y
            return h, c

        # jaxlib 0.7.1 (the 2.9 leg's, pinned by torch_xla) aborts the process compiling the gradient
        # of this program written in plain jax too (LLVM: '__xla_cpu_runtime_PartitionId' could not
        # be resolved); 0.10.2 compiles it. The values are checked on every leg.
        self.check_scan(step, reference_step, {"reverse": True}, gradients=jax.__version_info__ >= (0, 10))


class TestAtenTable(TestCase):
    """The ATen rules against torch, on generated programs over the ops decomposed graphs hold."""

    UNARY = [torch.sin, torch.tanh, torch.exp, torch.relu, torch.sigmoid, torch.nn.functional.gelu, torch.neg, torch.abs, torch.rsqrt, lambda x: x.softmax(-1), lambda x: x.log_softmax(0)]
    BINARY = [torch.add, torch.sub, torch.mul, torch.maximum, lambda a, b: a / (b.abs() + 1), lambda a, b: torch.where(a > b, a, b * 2), lambda a, b: a - 2 * b]
    SHAPE = [lambda x: x.t().reshape(-1, x.shape[0]).t(), lambda x: x.unsqueeze(1).expand(-1, 2, -1).sum(1), lambda x: torch.cat([x, x[:, :1]], 1)[:, 1:], lambda x: x.mean(-1, keepdim=True) + x.amax(0), lambda x: x @ x.t() @ x]

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10)), min_size=1, max_size=6))
    def test_generated_programs_forward_and_backward(self, choices):
        def program(x, y):
            for kind, index in choices:
                if kind == 0:
                    x = self.UNARY[index % len(self.UNARY)](x)
                elif kind == 1:
                    x = self.BINARY[index % len(self.BINARY)](x, y)
                else:
                    x = self.SHAPE[index % len(self.SHAPE)](x)
                x = x.tanh()  # bounded values: float32 rounding stays within the tolerance
            return x * y.cos()  # y always reaches the output (its gradient is asked for)

        # rsqrt of a negative is NaN in both: NaN compares equal to NaN here.
        g = torch.Generator().manual_seed(len(choices))
        x, y = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)
        graph = make_fx(joint(program), tracing_mode="fake")(x.requires_grad_(), y.requires_grad_())
        close(self, lower_to_jax(graph)(*arrays((x, y))), joint(program)(*fresh((x, y))), f"program {choices}", rtol=1e-4)

    @settings(max_examples=10, deadline=None, derandomize=True)
    @given(
        st.integers(1, 3),
        st.integers(1, 2),
        st.lists(st.tuples(*[st.integers(1, 3)] * 3, st.integers(0, 2), st.integers(0, 2), st.integers(2, 4)), min_size=3, max_size=3),
    )
    def test_transposed_convolutions_and_their_gradients_as_torch(self, spatial, groups, dims):
        # per dim (stride, dilation, kernel, padding, output padding, input size); torch takes an
        # output padding below the stride or the dilation, so past the stride where the dilation is larger
        dims = [(s, d, k, p, o % max(s, d), n) for s, d, k, p, o, n in dims[:spatial]]
        assume(all((n - 1) * s - 2 * p + d * (k - 1) + o + 1 > 0 for s, d, k, p, o, n in dims))
        stride, dilation, kernel, padding, output_padding, size = (tuple(column) for column in zip(*dims))
        g = torch.Generator().manual_seed(spatial * 10 + groups)
        x = torch.randn(2, 2 * groups, *size, generator=g)
        w, b = torch.randn(2 * groups, 3, *kernel, generator=g), torch.randn(3 * groups, generator=g)
        convolve = getattr(torch.nn.functional, f"conv_transpose{spatial}d")

        def program(x, w, b):
            out = convolve(x, w, b, stride, padding, output_padding, groups, dilation)
            return out * torch.linspace(-1, 1, out.numel()).view(out.shape)  # (a cotangent other than ones)

        inputs = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
        graph = make_fx(joint(program), tracing_mode="fake")(*inputs)
        close(self, lower_to_jax(graph)(*arrays(inputs)), joint(program)(*fresh(inputs)), f"conv_transpose{spatial}d {dims} groups {groups}", rtol=1e-4)

    def test_reductions_scans_and_sorts_of_a_0d_tensor_along_its_dim_0_as_torch(self):
        # torch reads dim 0 / -1 of a 0-d tensor as a dim of one element (a loss reduced again
        # along -1; a scalar a reduction kept 0-d); squeeze of an empty dim list squeezes none
        along = [
            torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.logsumexp, torch.cumsum, torch.cumprod, torch.logcumsumexp,
            torch.softmax, torch.log_softmax, torch.nansum, torch.count_nonzero, torch.argmax, torch.argmin,
            lambda x, d: torch.max(x, d), lambda x, d: torch.min(x, d), lambda x, d: torch.cummax(x, d), lambda x, d: torch.sort(x, d),
            lambda x, d: torch.var(x, d, correction=0), lambda x, d: torch.std(x, d, keepdim=True, correction=0), lambda x, d: torch.aminmax(x, dim=d),
            lambda x, d: torch.any(x > 0, d), lambda x, d: torch.all(x > 0, d, keepdim=True), lambda x, d: torch.sum(x, (d,), keepdim=True),
        ]
        x, y = torch.tensor(0.7), torch.ones(1, 3, 1)
        index = torch.tensor([0])

        def program(x, y):
            entries = [x.index_select(0, index), x.index_add(-1, index, y.sum(), alpha=2), x.index_copy(0, index, y.sum())]
            return [f(x, d) for f in along for d in (0, -1)], entries, torch.squeeze(y, ()), torch.squeeze(y, (0, -1)), torch.squeeze(x, 0)

        with jax_x64():  # (int64 results as int64)
            close(self, lower_to_jax(make_fx(program)(x, y))(*arrays((x, y))), program(x, y), "0-d reductions", rtol=1e-6)

    def test_round_to_decimals_complex_of_broadcast_parts_and_an_empty_inverse_as_torch(self):
        def program(x, y):
            return (
                torch.round(x * 1000, decimals=2),
                torch.round(x * 1000, decimals=-2),
                torch.round(torch.tensor([0.5, 1.5, 2.5, -0.5])),  # (half to even)
                torch.complex(x, y[:1]),
                torch.linalg.inv(x[:, :0, :0]),
            )

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(2, 3, 3, generator=g), torch.randn(2, 3, 3, generator=g)
        close(self, lower_to_jax(make_fx(program)(x, y))(*arrays((x, y))), program(x, y), "round / complex / empty inverse", rtol=1e-6)

    def test_cosine_windows_as_torch(self):
        def windows():
            return [
                torch.hann_window(16),
                torch.hann_window(7, periodic=False),
                torch.hamming_window(9),
                torch.hamming_window(9, False, 0.5, 0.4),
                torch.blackman_window(12),
                torch.blackman_window(5, periodic=False, dtype=torch.float64),
                torch.hann_window(1),
                torch.hann_window(0),
            ]

        with jax_x64():
            close(self, lower_to_jax(make_fx(windows)())(), windows(), "windows", rtol=1e-6)

    def test_roll_and_searchsorted_as_torch(self):
        # roll flat, along one dim and two (and its gradient, a roll back); searchsorted on a 1-d and
        # a batched sequence with a tie, both sides, int32, a sorter, a number
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)

        def rolled(x, y):
            return torch.roll(x, 7) * y + torch.roll(x, (1, -3), (0, 2)) + torch.roll(x, -1, 1).sin()

        graph = make_fx(joint(rolled), tracing_mode="fake")(x.requires_grad_(), y.requires_grad_())
        close(self, lower_to_jax(graph)(*arrays((x, y))), joint(rolled)(*fresh((x, y))), "roll", rtol=1e-5)

        row, rows = torch.sort(torch.randn(7, generator=g)).values, torch.sort(torch.randn(3, 4, 7, generator=g), -1).values
        rows[0, 0, 2] = rows[0, 0, 3]
        values = torch.randn(3, 4, 5, generator=g)
        values[0, 0, 0] = rows[0, 0, 2]
        order = torch.randn(3, 4, 7, generator=g).argsort(-1)
        shuffled = torch.empty_like(rows).scatter_(-1, order, rows)  # shuffled[order] == rows

        def searched(row, rows, shuffled, order, values):
            return (
                torch.searchsorted(row, values),
                torch.searchsorted(row, values, right=True, out_int32=True),
                torch.searchsorted(rows, values),
                torch.searchsorted(rows, values, side="right"),
                torch.searchsorted(shuffled, values, sorter=order),
                torch.searchsorted(row, 0.1),
            )

        inputs = (row, rows, shuffled, order, values)
        with jax_x64():  # (int64 results as int64)
            close(self, lower_to_jax(make_fx(searched)(*inputs))(*arrays(inputs)), searched(*inputs), "searchsorted", rtol=0)

    def test_prims_convert_element_type_casts_as_torch(self):
        # Recorded by decompositions under dynamic shapes (a float Dynamo passes as a tensor).
        def program(x):
            return torch.ops.prims.convert_element_type(x * 3, torch.float16).float() + torch.ops.prims.convert_element_type(x, torch.int32)

        x = torch.randn(4, 3) * 4
        graph = make_fx(program)(x)
        close(self, lower_to_jax(graph)(*arrays((x,))), program(x), "convert_element_type", rtol=1e-3)

    def test_gather_and_its_gradient_as_torch(self):
        # HF BERT's token-type embedding reads its buffer with gather; the backward scatters.
        # The index is smaller than the input along the other dim, as torch allows.
        def program(x, y):
            index = torch.tensor([[0, 2, 1], [3, 3, 0]])
            return torch.gather(x, 1, index) * y + torch.gather(x, 0, index[:, :2].clamp(max=1))[:, :1]

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(3, 4, generator=g), torch.randn(2, 3, generator=g)
        graph = make_fx(joint(program), tracing_mode="fake")(x.requires_grad_(), y.requires_grad_())
        assert any(n.target is torch.ops.aten.gather.default for n in graph.graph.nodes)
        close(self, lower_to_jax(graph)(*arrays((x, y))), joint(program)(*fresh((x, y))), "gather", rtol=1e-5)

    @settings(max_examples=3, deadline=None)
    @given(group=st.sampled_from([1, 2, 3]), is_causal=st.booleans(), masked=st.booleans(), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
    @example(group=2, is_causal=True, masked=False, scale=None, seed=0)  # HF Llama's grouped heads, always
    def test_cpu_flash_attention_rules_equal_the_cpu_kernels(self, group, is_causal, masked, scale, seed):
        # What real models' graphs traced on CPU hold, grouped-query attention (fewer key/value
        # heads, as HF Llama's SDPA passes them) included: outputs, logsumexp and gradients.
        from passes.jax.aten import ATEN

        aten = torch.ops.aten
        g = torch.Generator().manual_seed(seed)
        heads, length, source = 2, 3, 4  # fixed shapes: each new shape compiles every jax op again
        q = torch.randn(2, heads * group, length, 4, generator=g)
        k, v = (torch.randn(2, heads, source, 4, generator=g) for _ in range(2))
        options = dict(attn_mask=torch.randn(length, source, generator=g) if masked else None, scale=scale)
        is_causal = is_causal and not masked and length <= source  # the kernel's causal mask is top-left
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, **options)
        grad_out = torch.randn(out.shape, generator=g)
        expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, is_causal, **options)
        jax_options = dict(options, attn_mask=None if options["attn_mask"] is None else jnp.asarray(options["attn_mask"].numpy()))
        q_, k_, v_, grad_out_ = (jnp.asarray(t.numpy()) for t in (q, k, v, grad_out))
        got = ATEN[aten._scaled_dot_product_flash_attention_for_cpu](q_, k_, v_, 0.0, is_causal, **jax_options)
        got_grads = ATEN[aten._scaled_dot_product_flash_attention_for_cpu_backward](
            grad_out_, q_, k_, v_, got[0], got[1], 0.0, is_causal, **jax_options
        )
        for name, a, b in zip(("output", "logsumexp", "grad query", "grad key", "grad value"), (*got, *got_grads), (out, lse, *expected)):
            torch.testing.assert_close(torch.from_numpy(np.asarray(a)), b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")

    DTYPE_CASES = [
        ("int64 past int32", lambda v: (v.amax(1), v + 1, v.sum(), v > 2**32, (v > 0).sum()), torch.tensor([[2**40 + 3, -5, 7], [1, 2**33, -(2**35)]])),
        ("int32 sums in int64", lambda v: (v.sum(), v.cumsum(0), (v > 0).sum(), v.argmax()), torch.tensor([2**30, 2**30, 2**30], dtype=torch.int32)),
        ("float64 digits past float32", joint(lambda v: ((v - 1) * 1e12).square()), torch.tensor([1 + 1e-12, 1 - 3e-12, 2.0], dtype=torch.float64, requires_grad=True)),
        ("numbers the program makes", lambda v: (v + torch.arange(0.5, 3.5), v * torch.full((3,), 2.5), torch.arange(3), torch.full((2,), 3)), torch.tensor([1.5, 2.25, 3.0], dtype=torch.float16)),
    ]

    def test_under_x64_outputs_and_gradients_have_the_graphs_dtypes_and_values(self):
        # The caller's jax config decides, as for any JAX function (lower_to_jax's docstring): with
        # x64 on, int64 values past int32's range and float64's digits are exact, and a tensor the
        # program makes of Python numbers (full, arange) has torch's dtype, not jax's 64-bit guess.

        with jax_x64():
            for name, program, x in self.DTYPE_CASES:
                got = pytree.tree_leaves(lower_to_jax(make_fx(program)(x))(x.detach().numpy()))
                expected = pytree.tree_leaves(program(*fresh([x])))
                self.assertEqual(len(got), len(expected))
                for i, (a, e) in enumerate(zip(got, expected)):
                    exact = not e.is_floating_point()
                    torch.testing.assert_close(
                        torch.from_numpy(np.array(a)), e.detach(), rtol=0 if exact else None, atol=0 if exact else None, msg=lambda m: f"{name}[{i}]: {m}"
                    )

    def test_without_x64_64_bit_dtypes_are_jaxs_32_bit_ones_and_others_torchs(self):
        # jax's default: int64 computed as int32, float64 as float32, without a warning from the
        # rules; a float the program makes is torch's float32 (float16 * float32 is float32).
        self.assertFalse(jax.config.jax_enable_x64)
        x = torch.tensor([1.5, 2.25, 3.0], dtype=torch.float16)
        program = self.DTYPE_CASES[3][1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = lower_to_jax(make_fx(program)(x))(x.numpy())
        self.assertEqual([a.dtype for a in got], [jnp.float32, jnp.float32, jnp.int32, jnp.int32])
        torch.testing.assert_close([torch.from_numpy(np.array(a)).to(e.dtype) for a, e in zip(got, program(x))], list(program(x)), rtol=0, atol=0)

    def test_one_lowered_function_called_with_and_without_x64_keeps_each_modes_constants(self):
        # A tensor constant of the graph is made a jax array the first time the function runs; a
        # caller who switches x64 between calls gets each mode's array, not the first call's
        # (an int64 constant made as int32 would wrap 2**40 + 3 to 3 under x64).

        big = torch.tensor([2**40 + 3, -(2**35)])
        function = lower_to_jax(make_fx(lambda v: v + big)(torch.tensor([1, 2])))
        x = np.array([1, 2])
        without = function(x)
        self.assertEqual(without.dtype, jnp.int32)
        with jax_x64():
            got = function(x)
        self.assertEqual(got.dtype, jnp.int64)
        self.assertEqual(np.asarray(got).tolist(), [2**40 + 4, -(2**35) + 2])
        self.assertEqual(function(x).dtype, jnp.int32)  # (and back)

    def test_an_op_without_a_rule_is_refused_naming_it_before_anything_runs(self):
        # (kthvalue: no rule, and no decomposition of torch's to run instead)
        graph = make_fx(lambda x: torch.kthvalue(x, 2).values.sin())(torch.randn(3))
        with self.assertRaisesRegex(NoJaxRule, r"lower_to_jax: %kthvalue .*: no JAX rule for aten\.kthvalue\.default") as caught:
            lower_to_jax(graph)
        self.assertIs(caught.exception.op, torch.ops.aten.kthvalue.default)
        self.assertIsInstance(caught.exception, passes.PassError)


class TestRefusals(TestCase):
    def test_a_partial_annotation_is_refused(self):
        spec = ShardingSpec(MESH, (Partial(), Replicate()))
        graph = make_fx(lambda x: x * 2)(torch.randn(4))
        (mul,) = [n for n in graph.graph.nodes if n.op == "call_function"]
        with graph.graph.inserting_after(mul):
            call = graph.graph.call_function(hops.sharding_annotation_hop, (mul, spec))
        next(iter(graph.graph.find_nodes(op="output"))).args = (call,)
        graph.recompile()
        with self.assertRaisesRegex(passes.PassError, r"lower_to_jax: .*hops_sharding_annotation.*Partial placement"):
            lower_to_jax(graph)

    def test_a_mesh_larger_than_the_devices_names_the_flag(self):
        big = ShardingSpec(Mesh((4, 4), ("data", "model")), (Shard(0), Replicate()))
        function = lower_to_jax(make_fx(lambda x: hops.annotate_sharding(x, big))(torch.randn(8, 2)))
        with self.assertRaisesRegex(ValueError, r"device ids up to 15 but jax has 4 .*xla_force_host_platform_device_count=16"):
            jax.jit(function)(np.ones((8, 2), np.float32))

    def test_a_region_spec_of_the_wrong_type_is_refused(self):
        sample = SAMPLES[1]
        graph = make_fx(sample.program, tracing_mode="fake")(*sample.inputs(0))
        (region,) = [n for n in graph.graph.nodes if n.target is hops.local_map_hop]
        region.args = (*region.args[:-1], ROWS)
        with self.assertRaisesRegex(passes.PassError, r"lower_to_jax: .*hops_local_map.*must be a hops\.LocalMapSpec"):
            lower_to_jax(graph)


class TestSolvedAndExported(TestCase):
    def test_the_placements_the_solver_chooses_run_through_the_target_like_eager(self):
        from tests.helpers.snapshot import aot_trace
        from tests.test_solver_apply import GRID, SLOW_LINK, model

        torch.manual_seed(0)
        args = [torch.randn(4, 8, 16), torch.randn(16, 16, requires_grad=True), (torch.randn(3, 16, 16) / 4).requires_grad_(), torch.randn(16, 8, requires_grad=True)]
        forward, backward, _ = aot_trace(model, *args)
        solution = passes.solve_placements((forward, backward), GRID, cost_model=SLOW_LINK)
        passes.apply_placements((forward, backward), solution)
        forward_jax, backward_jax = jax.jit(lower_to_jax(forward)), jax.jit(lower_to_jax(backward))
        loss, *saved = forward_jax(*arrays(args))
        grads = backward_jax(*saved, np.ones((), np.float32))
        reference = model(*args)
        close(self, [loss, *grads[1:]], [reference, *torch.autograd.grad(reference, args[1:])], "solved program", rtol=1e-4)
        # every sharded layout the solver chose for a forward value is a constraint of the program
        text = forward_jax.lower(*arrays(args)).as_text()
        stated = set(re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])>", text))
        chosen = {
            shardy_layout(GRID, placements, len(solution.graph.nodes[key]["shape"]))
            for key, placements in solution.placements.items()
            if key.startswith("forward/") and any(isinstance(p, Shard) for p in placements) and not any(isinstance(p, Partial) for p in placements)
        }
        self.assertTrue(chosen)
        self.assertLessEqual(chosen, stated)
        self.assertIn("sdy.manual_computation(", text)
        self.assertIn("stablehlo.while", text)

    def test_a_lowered_program_round_trips_through_jax_export(self):
        from jax import export

        sample = SAMPLES[2]  # a scan holding its body
        graph = make_fx(joint(sample.program), tracing_mode="fake")(*sample.inputs(0))
        function = jax.jit(lower_to_jax(graph))
        inputs = arrays(sample.inputs(1))
        exported = export.export(function)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs])
        loaded = export.deserialize(exported.serialize())
        close(self, loaded.call(*inputs), joint(sample.reference)(*fresh(sample.inputs(1))), "exported, serialized, loaded")


class TestTorchUnchanged(TestCase):
    def test_dynamo_still_compiles_a_hop_after_the_jax_target_ran(self):
        sample = SAMPLES[0]
        graph = make_fx(sample.program)(*[t.detach() for t in sample.inputs(0)])
        jax.jit(lower_to_jax(graph))(*arrays(sample.inputs(0)))  # the target has run in this process
        self.assertEqual(torch.accelerator.current_accelerator(), ACCELERATOR_BEFORE_JAX)
        self.assertNotEqual(torch._C._get_privateuse1_backend_name(), "jax")
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: hops.annotate_sharding(x * 2, ROWS).sin(), fullgraph=True)
        x = torch.randn(4, 4)
        torch.testing.assert_close(compiled(x), (x * 2).sin())



# A kernel with a Pallas implementation for target "jax": tanh(x * w). pallas_call has no
# reverse-mode rule, so, as in JAX, the kernel is a jax.custom_vjp whose backward is given.
JAX_CALLS = []


def _pallas_scaled_tanh(x, w):
    from jax.experimental import pallas as pl

    def body(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...] * w_ref[...])

    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@jax.custom_vjp
def pallas_scaled_tanh(x, w):
    JAX_CALLS.append("forward")
    return _pallas_scaled_tanh(x, w)


def _pallas_forward(x, w):
    y = pallas_scaled_tanh(x, w)
    return y, (x, w, y)


def _pallas_backward(saved, g):
    JAX_CALLS.append("backward")
    x, w, y = saved
    dy = g * (1 - y * y)
    return dy * w, dy * x


pallas_scaled_tanh.defvjp(_pallas_forward, _pallas_backward)


def _torch_backward(x, w, y, g):
    dy = g * (1 - y * y)
    return dy * w, dy * x


@hops.kernel(abstract=lambda x, w: x.new_empty(x.shape), backward=_torch_backward, jax=pallas_scaled_tanh)
def jax_scaled_tanh(x, w):
    return torch.tanh(x * w)


@hops.kernel(abstract=lambda x, w: x.new_empty(x.shape), jax=lambda x, w: (x * w)[:, :1])
def lying_jax_kernel(x, w):
    return x * w


class TestKernelJaxImplementation(TestCase):
    """``hops.kernel(jax=...)``: target "jax" calls the JAX implementation (a Pallas kernel in a
    scan, in a scope, its output constrained), jax differentiating it; eager keeps the torch function."""

    def setUp(self):
        previous = jax.config.jax_use_shardy_partitioner  # see TestShardyText.setUp
        jax.config.update("jax_use_shardy_partitioner", True)
        self.addCleanup(jax.config.update, "jax_use_shardy_partitioner", previous)

    @staticmethod
    def program(h, xs, w):
        @hops.named_scope("pallas_cell")
        def cell(h, w):
            return jax_scaled_tanh(h, w)

        def step(h, x, w):
            h = hops.annotate_sharding(cell(h + x, w), ROWS)
            return h, h.sum(-1)

        return hops.scan(step, h, xs, additional_inputs=(w,))

    def inputs(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(4, 8, generator=g), torch.randn(3, 4, 8, generator=g), torch.randn(4, 8, generator=g)

    def test_a_pallas_kernel_in_a_scan_forward_and_backward_equals_eager(self):
        inputs = self.inputs()
        function = lower_to_jax(make_fx(self.program)(*inputs))
        JAX_CALLS.clear()
        values = jax.jit(function)(*arrays(inputs))
        self.assertEqual(JAX_CALLS, ["forward"])  # the Pallas kernel ran, not the torch function
        leaves = [t.clone().requires_grad_() for t in inputs]
        expected = self.program(*leaves)  # eager: the torch function and its torch backward
        close(self, values, expected, "values")
        grads = jax.jit(jax.grad(lambda *v: weighted_loss(function(*v)), argnums=(0, 1, 2)))(*arrays(inputs))
        self.assertIn("backward", JAX_CALLS)  # the gradient came through the kernel's custom_vjp
        loss = sum((o * (i + 1)).sum() for i, o in enumerate(expected))
        close(self, grads, torch.autograd.grad(loss, leaves), "gradients", rtol=1e-4)

    def test_the_constraint_and_the_scope_hold_the_kernel_inside_the_while_loop(self):
        inputs = self.inputs()
        function = lower_to_jax(make_fx(self.program)(*inputs))
        text = stablehlo(function, *arrays(inputs), debug_info=True)
        bodies, reachable = functions_called_in_while_bodies(text)
        self.assertTrue(bodies, text)  # the scan's loop (Pallas's interpreter adds its grid's loop inside)
        self.assertIn('sdy.sharding_constraint', reachable)
        self.assertIn('[{"data"}, {}]', reachable)
        self.assertRegex(text, r'loc\("pallas_cell/pallas_call"')
        # the kernel's tanh, inside the loop, is located in the scope
        tanh = re.findall(r"stablehlo\.tanh .*? loc\((#loc\d+)\)", reachable)
        self.assertTrue(tanh, reachable)
        locations = dict(re.findall(r"^(#loc\d+) = (.*)$", text, flags=re.M))

        def resolve(name, depth=0):
            found = locations.get(name, "")
            return found + "".join(resolve(ref, depth + 1) for ref in re.findall(r"#loc\d+", found) if depth < 8)

        self.assertTrue(any("pallas_cell" in resolve(loc) for loc in tanh), [resolve(loc) for loc in tanh])
        # the constraint stands on the kernel's result: its operand is computed from the tanh
        self.assertRegex(reachable, r"stablehlo\.tanh[\s\S]*sdy\.sharding_constraint")

    def test_eager_and_other_targets_keep_the_torch_function(self):
        x, w = torch.randn(4, 8), torch.randn(4, 8)
        JAX_CALLS.clear()
        torch.testing.assert_close(jax_scaled_tanh(x, w), torch.tanh(x * w))
        inlined = passes.inline_hops(make_fx(lambda x, w: jax_scaled_tanh(x, w))(x, w))
        torch.testing.assert_close(inlined(x, w), torch.tanh(x * w))
        self.assertEqual(JAX_CALLS, [])

    def test_a_jax_implementation_that_breaks_the_abstract_promise_is_refused(self):
        x = torch.randn(4, 8)
        function = lower_to_jax(make_fx(lambda x, w: lying_jax_kernel(x, w) + 1)(x, x))
        with self.assertRaisesRegex(RuntimeError, r"kernel\(lying_jax_kernel\): its jax implementation returned \[4, 1\] float32 but its abstract rule promises \[4, 8\] float32"):
            function(*arrays((x, x)))

    def test_a_jax_implementation_that_is_not_callable_is_refused_naming_it(self):
        with self.assertRaisesRegex(TypeError, r"kernel: jax must be callable, got str 'pallas'"):
            hops.kernel(abstract=lambda x: x.new_empty(x.shape), jax="pallas")
