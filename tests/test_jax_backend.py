"""``torch.compile(backend=passes.jax.backend.hops_jax)``: Dynamo -> AOTAutograd -> target
``"jax"``, on CPU tensors (4 virtual CPU devices: ``tests/conftest.py`` sets ``XLA_FLAGS``).

Every ``hop_db`` sample compiled gives eager's outputs and gradients; a program without a mesh
hands its tensors to jax and back without a copy (DLPack: the result's memory is jax's
buffer); one over a mesh counts the copies it makes; Dynamo's other backends still work after.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F

ACCELERATOR_BEFORE_JAX = torch.accelerator.current_accelerator()

jax = pytest.importorskip("jax", reason="backend hops_jax needs jax (the 'jax' extra)")

import hops  # noqa: E402
from hops import Replicate, Shard  # noqa: E402
from passes.jax import backend  # noqa: E402
from passes.jax.backend import hops_jax  # noqa: E402
from tests.helpers.hop_db import MESH, ROWS, SAMPLES, forward_backward, fresh  # noqa: E402
from tests.helpers.snapshot import TestCase  # noqa: E402


def outputs_and_gradients(run, inputs):
    """``run``'s outputs (flattened) and the gradients of the inputs it reaches, at a cotangent that
    differs at every element of every floating output (a transposed or mirrored gradient shows)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    outputs = torch.utils._pytree.tree_leaves(run(*leaves))
    loss = sum((o * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum() for o in outputs if o.is_floating_point())
    return outputs, [g for g in torch.autograd.grad(loss, leaves, allow_unused=True) if g is not None]


class TestHopsJax(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def check_every_sample(self, seed, **options):
        for sample in SAMPLES:
            with self.subTest(sample=sample.name):
                torch._dynamo.reset()
                compiled = torch.compile(sample.program, backend=hops_jax, fullgraph=True, **options)
                inputs = sample.inputs(seed)
                outputs, grads = forward_backward(compiled, fresh(inputs))
                expected, expected_grads = forward_backward(sample.reference, fresh(inputs))
                for got, want in zip([*outputs, *grads], [*expected, *expected_grads]):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_every_sample_compiled_gives_eager_outputs_and_gradients(self):
        self.check_every_sample(1)

    def test_every_sample_compiled_with_dynamic_shapes_gives_eager_outputs_and_gradients(self):
        # With dynamic=True the graphs take their sizes as ints and the forward returns some
        # for the backward: jax specializes on them, and torch gets them back as ints.
        self.check_every_sample(2, dynamic=True)

    def test_one_dynamic_compile_serves_scans_of_every_length(self):
        from torch._dynamo.testing import CompileCounterWithBackend

        def step(h, x, w):
            h = torch.tanh(h @ w + x)
            return h, h.sum(-1)

        def program(h, xs, w):
            last, ys = hops.scan(step, h, xs, additional_inputs=(w,))
            return last.sum() + ys.square().mean()

        counter = CompileCounterWithBackend(hops_jax)
        compiled = torch.compile(program, backend=counter, dynamic=True, fullgraph=True)
        for length, batch in [(4, 2), (6, 3)]:
            g = torch.Generator().manual_seed(length)
            inputs = [torch.randn(batch, 3, generator=g), torch.randn(length, batch, 3, generator=g), torch.randn(3, 3, generator=g)]
            inputs = [t.requires_grad_() for t in inputs]
            got, got_grads = forward_backward(compiled, fresh(inputs))
            expected, expected_grads = forward_backward(program, fresh(inputs))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_grads, expected_grads, rtol=1e-5, atol=1e-5)
        self.assertEqual(counter.frame_count, 1)

    def test_no_copy_in_or_out_without_a_mesh(self):
        compiled = torch.compile(lambda x, w: torch.tanh(hops.einsum("ij,jk->ik", x, w)), backend=hops_jax)
        x, w = torch.randn(4, 3), torch.randn(3, 5)
        compiled(x, w)  # compiles
        graph = backend.COMPILED[-1]
        before = dict(graph.copies)
        self.assertEqual(graph.copies, {"in": 0, "out": 0})
        (out,) = graph(x, w)
        self.assertEqual(graph.copies, before)
        torch.testing.assert_close(out, torch.tanh(x @ w))
        # the input is jax's view of the tensor's memory, the output torch's view of jax's buffer
        self.assertEqual(backend._to_jax(x, {"in": 0}, "x").unsafe_buffer_pointer(), x.data_ptr())
        result = jax.numpy.ones((2, 3)) * 2
        self.assertEqual(backend._to_torch(result, {"out": 0}).data_ptr(), result.unsafe_buffer_pointer())

    def test_a_program_over_a_mesh_counts_its_copies(self):
        compiled = torch.compile(lambda x: hops.annotate_sharding(x * 2, ROWS).sin(), backend=hops_jax)
        x = torch.randn(4, 4)
        torch.testing.assert_close(compiled(x), (x * 2).sin())
        graph = backend.COMPILED[-1]
        copies = dict(graph.copies)
        compiled(x)
        self.assertEqual(graph.copies["in"], 2 * copies["in"])  # the input placed on the mesh, each call
        self.assertGreaterEqual(copies["in"], 1)

    def _step_with_residuals(self):
        """A compiled loss over the mesh, its forward and backward graphs (compiled by one step)
        and a step function returning the gradients; the forward split from its backward (as
        torch's autograd runs them: ``TestFusedBackward`` tests them fused)."""
        compiled = torch.compile(lambda x, w: hops.annotate_sharding(torch.tanh(x @ w), ROWS).square().sum(), backend=hops_jax)
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)

        def step():
            return torch.autograd.grad(compiled(x, w), (x, w))

        step()
        forward, backward = backend.COMPILED[-2:]
        forward.fused, forward.speculate = None, False
        reference = torch.autograd.grad(torch.tanh(x @ w).square().sum(), (x, w))
        return forward, backward, step, reference

    def test_residuals_reach_the_backward_as_the_forwards_jax_arrays(self):
        forward, backward, step, reference = self._step_with_residuals()
        produced, received = [], []
        run_forward, run_backward = forward.function, backward.function
        forward.function = lambda *a: produced.extend(out := run_forward(*a)) or out
        backward.function = lambda *a: received.extend(a) or run_backward(*a)
        copies_out, copies_in = forward.copies["out"], backward.copies["in"]
        for got, want in zip(step(), reference):
            torch.testing.assert_close(got, want)
        residuals = [r for r in received if any(r is p for p in produced)]
        self.assertGreaterEqual(len(residuals), 1)  # tanh's result at least
        for residual in residuals:  # the same buffers, shard by shard: no copy
            self.assertIsInstance(residual, jax.Array)
            self.assertGreater(len(residual.sharding.device_set), 1)
        self.assertEqual(forward.copies["out"], copies_out)  # no residual gathered to the host
        tensors_in = sum(not isinstance(r, jax.Array) or not any(r is p for p in produced) for r in received)
        self.assertEqual(backward.copies["in"] - copies_in, tensors_in)  # only the tangent placed

    def test_saved_tensor_hooks_see_real_residuals(self):
        forward, backward, step, reference = self._step_with_residuals()
        seen = []

        def pack(tensor):
            seen.append(tensor.clone())  # what an offloading hook does: saves a copy (a stand-in's would be junk)
            return seen[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grads = step()
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want)
        self.assertGreaterEqual(len(seen), 1)  # the hook ran; the gradients above read what it saved

    def test_a_result_sharded_over_the_mesh_reaches_torch_whole(self):
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
        value = np.arange(4 * 6 * 2, dtype=np.float32).reshape(4, 6, 2)
        for spec in (PartitionSpec("data", "model"), PartitionSpec(None, "model"), PartitionSpec("model"), PartitionSpec(("data", "model"))):
            with self.subTest(spec=spec):
                copies = {"out": 0}
                result = backend._to_torch(jax.device_put(value, NamedSharding(mesh, spec)), copies)
                self.assertEqual(copies, {"out": 1})
                torch.testing.assert_close(result, torch.from_numpy(value), rtol=0, atol=0)

    def test_dropout_in_training_draws_from_torchs_generator_with_the_gradient_of_its_mask(self):
        # dropout(tanh(x @ w)): a quarter of the values zero, the rest scaled by 1 / (1 - p); the
        # gradient the one of the mask the forward drew; a second call draws anew, and
        # torch.manual_seed gives the same draws again.
        p = 0.25

        def program(x, w):
            return torch.nn.functional.dropout(torch.tanh(x @ w), p, training=True)

        x, w = torch.randn(64, 32), torch.randn(32, 64, requires_grad=True)
        compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
        torch.manual_seed(7)
        y = compiled(x, w)
        (grad,) = torch.autograd.grad(y.sum(), w)
        kept = y != 0
        self.assertLess(abs(1 - kept.float().mean().item() - p), 0.05)
        dense = torch.tanh(x @ w.detach())
        torch.testing.assert_close(y[kept], dense[kept] / (1 - p))
        torch.testing.assert_close(grad, x.t() @ (kept * (1 - dense**2) / (1 - p)), rtol=1e-4, atol=1e-4)
        self.assertFalse(torch.equal(compiled(x, w) != 0, kept))
        torch.manual_seed(7)
        self.assertTrue(torch.equal(compiled(x, w), y))

    def test_each_step_of_a_scan_draws_its_own_dropout_mask(self):
        # ys[t] = dropout(xs[t] * w), every xs[t] the same: the masks differ between steps, and
        # w's gradient is the sum of the steps' kept values over w.
        def step(c, x, w):
            y = torch.nn.functional.dropout(x * w, 0.5, training=True)
            return c, y

        def program(xs, w):
            return hops.scan(step, torch.zeros(()), xs, additional_inputs=(w,))[1]

        xs, w = torch.ones(4, 256), torch.rand(256).add(0.5).requires_grad_()
        ys = torch.compile(program, backend=hops_jax, fullgraph=True)(xs, w)
        (grad,) = torch.autograd.grad(ys.sum(), w)
        masks = ys != 0
        for t in range(1, 4):
            self.assertFalse(torch.equal(masks[t], masks[0]))
        torch.testing.assert_close(grad, ys.detach().sum(0) / w.detach())

    def test_dropout_in_a_local_map_region_masks_each_shard_on_its_own(self):
        # y = dropout(x * w) in a region on the 2x2 mesh. Each device's block lands in its own
        # place of y (out placements shard y over both axes), so all four devices' masks are
        # read. Along an axis the inputs are sharded over, the masks differ; along one they are
        # replicated over, they are the same (a replicated value stays replicated). Kept values
        # are x * w / (1 - p), about 1 - p of them kept, and the gradients are those of the
        # masks the forward drew. torch.manual_seed reproduces the whole draw.
        p = 0.25

        def body(x, w):
            return torch.nn.functional.dropout(x * w, p, training=True)

        for sharded in ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1))):
            with self.subTest(inputs=sharded):
                torch._dynamo.reset()
                region = hops.local_map(body, mesh=MESH, in_placements=(sharded, sharded), out_placements=((Shard(0), Shard(1)),))
                x, w = torch.randn(8, 64, requires_grad=True), torch.rand(8, 64).add(0.5).requires_grad_()
                compiled = torch.compile(lambda x, w: region(x, w), backend=hops_jax, fullgraph=True)
                torch.manual_seed(3)
                y = compiled(x, w)
                gx, gw = torch.autograd.grad(y.sum(), (x, w))
                torch.manual_seed(3)  # the seed reproduces every device's draw; the next call draws anew
                self.assertTrue(torch.equal(compiled(x, w), y))
                self.assertFalse(torch.equal(compiled(x, w), y))
                split = [placement != Replicate() for placement in sharded]  # x's dim k split along mesh axis k
                rows, columns = 8 // (2 if split[0] else 1), 64 // (2 if split[1] else 1)
                self.assertEqual(tuple(y.shape), (2 * rows, 2 * columns))
                blocks = {(i, j): (slice(i * rows, (i + 1) * rows), slice(j * columns, (j + 1) * columns)) for i in (0, 1) for j in (0, 1)}
                masks = {device: y[block] != 0 for device, block in blocks.items()}
                along_data = [torch.equal(masks[(0, j)], masks[(1, j)]) for j in (0, 1)]
                along_model = [torch.equal(masks[(i, 0)], masks[(i, 1)]) for i in (0, 1)]
                self.assertEqual(along_data, [not split[0]] * 2, "the same masks along 'data' exactly where the inputs are replicated there")
                self.assertEqual(along_model, [not split[1]] * 2, "the same masks along 'model' exactly where the inputs are replicated there")
                self.assertLess(abs(1 - (y != 0).float().mean().item() - p), 0.05)
                grad_x, grad_w = torch.zeros(8, 64), torch.zeros(8, 64)
                for (i, j), block in blocks.items():
                    piece = (slice(i * rows, (i + 1) * rows) if split[0] else slice(None), slice(j * columns, (j + 1) * columns) if split[1] else slice(None))
                    kept = masks[(i, j)]
                    dense = (x * w).detach()[piece]
                    torch.testing.assert_close(y[block][kept], dense[kept] / (1 - p))
                    grad_x[piece] += kept * w.detach()[piece] / (1 - p)
                    grad_w[piece] += kept * x.detach()[piece] / (1 - p)
                torch.testing.assert_close(gx, grad_x)
                torch.testing.assert_close(gw, grad_w)

    def test_a_cnn_with_every_kind_of_pooling_compiles_forward_and_backward(self):
        # the pooling ops as AOTAutograd's graphs hold them (forward and backward ops), eager's numbers
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True),
            torch.nn.AvgPool2d(2, 1, 1, count_include_pad=False),
            torch.nn.Conv2d(4, 4, 3),
            torch.nn.AdaptiveMaxPool2d((3, 2)),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        x, cotangent = torch.randn(2, 3, 11, 9, requires_grad=True), torch.randn(2, 4)
        compiled = torch.compile(model, backend=hops_jax, fullgraph=True)
        for run in (compiled, model):
            y = run(x)
            results = (y, *torch.autograd.grad(y, (x, *model.parameters()), cotangent))
            if run is compiled:
                got = results
        for i, (a, e) in enumerate(zip(got, results)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"output / gradient {i}: {m}")

    def test_unpooling_fractional_and_lp_pools_compile_forward_and_backward(self):
        # max_unpool of a max pool's indices, fractional max pools with their samples given (the
        # windows are eager's), lp pools: eager's outputs and gradients
        def program(x, y, samples, samples3d):
            pooled, indices = F.max_pool2d(x, 2, return_indices=True)
            unpooled = F.max_unpool2d(pooled * 2, indices, 2, output_size=x.shape[-2:])
            fractional = F.fractional_max_pool2d(x, 2, output_size=(3, 4), _random_samples=samples)
            fractional3d = F.fractional_max_pool3d(y, (2, 1, 2), output_size=(2, 3, 3), _random_samples=samples3d)
            lp = F.lp_pool2d(x.abs(), 3, 2, ceil_mode=True).sum() + F.lp_pool1d(y.flatten(2), 2, 3).sum()
            return unpooled, fractional, fractional3d, lp

        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(2, 3, 7, 9, generator=generator), torch.randn(1, 3, 4, 5, 6, generator=generator)
        samples, samples3d = torch.rand(2, 3, 2, generator=generator), torch.rand(1, 3, 3, generator=generator)
        compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
        for run in (compiled, program):
            inputs = (x.clone().requires_grad_(), y.clone().requires_grad_())
            outputs = run(*inputs, samples, samples3d)
            results = (*outputs, *torch.autograd.grad(outputs, inputs, [torch.randn(o.shape, generator=torch.Generator().manual_seed(1)) for o in outputs]))
            if run is compiled:
                got = results
        for i, (a, e) in enumerate(zip(got, results)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"output / gradient {i}: {m}")

    def test_a_fractional_max_pool_drawing_its_samples_is_reproduced_by_torchs_seed(self):
        # the samples torch's F.fractional_max_pool2d draws are a random op's: each call's key
        # comes from torch's generator; the gradient goes to the chosen elements
        compiled = torch.compile(lambda v: F.fractional_max_pool2d(v, 2, output_size=(4, 4), return_indices=True), backend=hops_jax, fullgraph=True)
        x = torch.randn(2, 3, 12, 10)
        runs = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            leaf = x.clone().requires_grad_()
            values, indices = compiled(leaf)
            values.backward(torch.ones_like(values))
            runs.append((values.detach(), indices, leaf.grad))
        torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
        self.assertFalse(torch.equal(runs[0][1], runs[2][1]))
        for values, indices, grad in runs:
            torch.testing.assert_close(values, x.flatten(2).gather(2, indices.long().flatten(2)).view(values.shape), rtol=0, atol=0)
            expected = torch.zeros(2, 3, 120).scatter_add_(2, indices.long().flatten(2), torch.ones(2, 3, 16)).view(x.shape)
            torch.testing.assert_close(grad, expected, rtol=0, atol=0)

    def test_fourier_transforms_and_their_gradients_as_eager(self):
        # torch's FFT ops (r2c, c2c, c2r) with each normalization, sizes given, and through stft
        transforms = [
            lambda x: torch.fft.rfft(x).abs(),
            lambda x: torch.fft.fft(x, norm="ortho").real,
            lambda x: torch.fft.fft2(x, norm="forward").imag,
            lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=1), n=6, dim=1),
            lambda x: torch.fft.irfftn(torch.fft.rfftn(x), s=x.shape),
            lambda x: torch.fft.ifft(x.to(torch.complex64) * 2).real,
            lambda x: torch.fft.hfft(torch.fft.ihfft(x), n=8),
            lambda x: torch.fft.ihfft2(x).real,
            lambda x: torch.stft(x.reshape(-1), 16, hop_length=4, window=torch.hann_window(16), return_complex=True).abs(),
        ]
        x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
        for i, transform in enumerate(transforms):
            with self.subTest(transform=i):
                torch._dynamo.reset()
                compiled = torch.compile(transform, backend=hops_jax, fullgraph=True)
                torch.testing.assert_close(outputs_and_gradients(compiled, (x,)), outputs_and_gradients(transform, (x,)), rtol=1e-4, atol=1e-4)

    def test_linear_algebra_and_its_gradients_as_eager(self):
        # torch.linalg's factorizations and solves: values, statuses and gradients (at a cotangent
        # other than ones); det / slogdet / solve's backwards read the LU factors the forward returns,
        # inv / cholesky / solve check their status in an effect-ordered op
        spd = lambda a: a @ a.mT + 3 * torch.eye(4)  # noqa: E731
        programs = [
            lambda a, b: torch.linalg.inv(a),
            lambda a, b: torch.linalg.inv_ex(a),
            lambda a, b: torch.linalg.cholesky(spd(a), upper=True),
            lambda a, b: torch.linalg.cholesky_ex(spd(a)),
            lambda a, b: torch.linalg.det(a),
            lambda a, b: torch.linalg.slogdet(a),
            lambda a, b: torch.linalg.solve(a, b),
            lambda a, b: torch.linalg.solve(a, b[..., 0]),
            lambda a, b: torch.linalg.solve(a, b[0, :, 0]) + torch.linalg.solve(a[:1], b).sum(-1),  # (batch dims broadcast)
            lambda a, b: torch.linalg.solve(a, b.mT, left=False),
            lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True),
            lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT, left=False),
            lambda a, b: torch.lu_unpack(*torch.linalg.lu_factor(a[:, :3])),
            lambda a, b: torch.linalg.solve_triangular(torch.tril(a), b.mT, upper=False, left=False, unitriangular=True),
            lambda a, b: (lambda w, v: v @ torch.diag_embed(w) @ v.mT)(*torch.linalg.eigh(a + a.mT)),
            lambda a, b: (lambda u, s, vh: u @ torch.diag_embed(s) @ vh)(*torch.linalg.svd(a, full_matrices=False)),
            lambda a, b: (lambda q, r: q @ r.abs())(*torch.linalg.qr(a)),
            lambda a, b: torch.linalg.cond(a),
            lambda a, b: (torch.linalg.pinv(a[:, :, :3]), torch.linalg.pinv(a[:, :3, :3] @ a[:, :3, :3].mT, atol=0.5)),
            lambda a, b: torch.linalg.pinv(a + a.mT, hermitian=True),
            lambda a, b: torch.diagonal_scatter(a, b[..., 0][..., :3] * 2, 1, 1, 2) + torch.diag_embed(b[..., 1], -1, 0, 2).sum(1)[:4, :4],
        ]
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(3, 4, 4, generator=generator), torch.randn(3, 4, 2, generator=generator)
        for i, program in enumerate(programs):
            with self.subTest(program=i):
                torch._dynamo.reset()
                compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
                torch.testing.assert_close(outputs_and_gradients(compiled, (a, b)), outputs_and_gradients(program, (a, b)), rtol=2e-3, atol=2e-3)

    def test_randint_and_normal_draw_from_torchs_seed_in_their_ranges_and_dtypes(self):
        def program(x, mean, std):
            return (
                torch.randint(3, 9, (4000,)),
                torch.randint_like(x, 5),
                torch.randint(7, (4000,), dtype=torch.float32),
                torch.normal(mean, std),
                torch.normal(2.0, 3.0, (4000,)),
                torch.normal(mean, 0.5),
            )

        compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
        inputs = (torch.zeros(4000, dtype=torch.int32), torch.full((4000,), 1.0), torch.full((4000,), 2.0))
        runs = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            runs.append(compiled(*inputs))
        torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
        self.assertFalse(torch.equal(runs[0][0], runs[2][0]))
        eager = program(*inputs)
        for got, want, (low, high) in zip(runs[0][:3], eager[:3], ((3, 8), (0, 4), (0, 6))):
            self.assertEqual(got.dtype, want.dtype)
            self.assertEqual((got.min().item(), got.max().item()), (low, high))  # every value of the range, none past it
        for got, (mean, std) in zip(runs[0][3:], ((1.0, 2.0), (2.0, 3.0), (1.0, 0.5))):
            self.assertAlmostEqual(got.mean().item(), mean, delta=4 * std / 4000**0.5)
            self.assertAlmostEqual(got.std().item(), std, delta=0.05 * std)

    def test_a_tensor_on_another_device_is_refused_naming_it(self):
        with self.assertRaisesRegex(ValueError, r"hops_jax: input 0 is a meta tensor; this backend runs on CPU tensors"):
            backend._to_jax(torch.empty(2, device="meta"), {"in": 0}, "input 0")

    def test_torch_compile_finds_it_by_name(self):
        self.assertIs(torch._dynamo.lookup_backend("hops_jax"), hops_jax)  # the torch_dynamo_backends entry point
        x = torch.randn(4, 4)
        torch.testing.assert_close(torch.compile(lambda v: hops.annotate_sharding(v, ROWS).exp(), backend="hops_jax")(x), x.exp())

    def test_other_backends_still_compile_afterwards(self):
        torch.compile(lambda x: hops.annotate_sharding(x, ROWS) + 1, backend=hops_jax)(torch.randn(4, 4))
        self.assertEqual(torch.accelerator.current_accelerator(), ACCELERATOR_BEFORE_JAX)
        torch._dynamo.reset()
        x = torch.randn(4, 4)
        torch.testing.assert_close(torch.compile(lambda v: hops.annotate_sharding(v * 3, ROWS).cos(), backend="aot_eager")(x), (x * 3).cos())


# Programs taking an index tensor ``i`` of 3 elements into ``x`` (5 x 4), with the size of the
# dim it indexes: ``TestIndexChecks`` runs each on generated indices, in range and out of it.
INDEXING = {
    "embedding": (lambda x, i: F.embedding(i, x), 5),
    "index_select, dim 1": (lambda x, i: x.index_select(1, i), 4),
    "gather": (lambda x, i: x.gather(1, i.view(1, 3).expand(5, 3)), 4),
    "x[i]": (lambda x, i: x[i], 5),
    "x[:, i]": (lambda x, i: x[:, i] * 2, 4),
    "index_put": (lambda x, i: x.index_put((i,), torch.ones(3, 4)), 5),
    "index_put, accumulating": (lambda x, i: torch.ops.aten.index_put(x, [None, i], torch.ones(5, 3), True), 4),
    "scatter": (lambda x, i: x.scatter(0, i.view(3, 1).expand(3, 4), 1.0), 5),
    "scatter_add": (lambda x, i: x.scatter_add(0, i.view(3, 1).expand(3, 4), torch.ones(3, 4)), 5),
    "scatter_reduce": (lambda x, i: x.scatter_reduce(1, i.view(1, 3).expand(5, 3), -x[:, :3], "amax"), 4),
    "index_add": (lambda x, i: x.index_add(0, i, torch.ones(3, 4), alpha=2), 5),
    "index_copy": (lambda x, i: x.index_copy(1, i, -x[:, :3]), 4),
    "take": (lambda x, i: x.take(i * 4), 5),
    "max_unpool2d": (lambda x, i: F.max_unpool2d(x[:1, :3].reshape(1, 1, 1, 3), i.view(1, 1, 1, 3), 2, output_size=(2, 6)), 12),
    "embedding in a scan": (lambda x, i: hops.scan(lambda c, j: (c + F.embedding(j, x).sum(0), None), torch.zeros(4), i.view(3, 1))[0], 5),
}


class TestRuntimeChecks(TestCase):
    """An index out of range, an integer divided by zero, a tensor assertion: torch raises, a jax program would clamp,
    drop or make up a value. Each program runs on generated inputs against eager: where eager
    raises, the compiled program raises (``IndexOutOfRange``: an ``IndexError`` and a
    ``RuntimeError``, torch's two; ``IntegerDivisionByZero``); elsewhere values (and gradients)
    are eager's."""

    def indices(self, size, generator):
        # unique picks in range (repeats make index_copy / max_unpool nondeterministic in eager),
        # negative ones among them, then one past each end of torch's ranges
        picks = torch.randperm(size, generator=generator)[:3]
        yield picks
        yield picks - size * (picks % 2)
        for bad in (size, -size - 1, -1):
            position = int(torch.randint(0, 3, (), generator=generator))
            yield picks.index_put((torch.tensor(position),), torch.tensor(bad))

    def test_indices_out_of_range_raise_as_eager_does_in_range_give_eagers_values(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 4, generator=generator)
        for name, (program, size) in INDEXING.items():
            torch._dynamo.reset()
            compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
            for i in self.indices(size, generator):
                with self.subTest(program=name, index=i.tolist()):
                    try:
                        expected = program(x, i)
                    except (IndexError, RuntimeError) as error:
                        with self.assertRaisesRegex(IndexError, r"hops_jax: aten\.\w+.*index -?\d+ is out of bounds") as raised:
                            compiled(x, i)
                        self.assertIsInstance(raised.exception, RuntimeError, msg=f"eager raised {error!r}")
                        continue
                    leaf = x.clone().requires_grad_()
                    got = compiled(leaf, i)
                    torch.testing.assert_close(got, expected)
                    (grad,) = torch.autograd.grad(got.square().sum(), leaf)
                    leaf = x.clone().requires_grad_()
                    torch.testing.assert_close(grad, torch.autograd.grad(program(leaf, i).square().sum(), leaf)[0])

    def test_an_integer_divided_by_zero_raises_as_eager_does_floats_divide_as_eagers(self):
        programs = {
            "//": lambda x, y: x // y,
            "%": lambda x, y: x % y,
            "fmod": torch.fmod,
            "div, floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
            "div, trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
            "/": lambda x, y: x / y,
            "// by a number": lambda x, y: (x + y) // 0,
            "% in a scan": lambda x, y: hops.scan(lambda c, v: (c + x % v, None), torch.zeros_like(x), y.view(3, 1))[0],
        }
        generator = torch.Generator().manual_seed(0)
        for name, program in programs.items():
            torch._dynamo.reset()
            compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
            for dtype in (torch.int64, torch.int32, torch.float32):
                x = torch.randint(-9, 9, (3,), generator=generator).to(dtype)
                for y in (torch.tensor([2, -3, 5], dtype=dtype), torch.tensor([2, 0, 5], dtype=dtype)):
                    with self.subTest(program=name, dtype=dtype, divisor=y.tolist()):
                        try:
                            expected = program(x, y)
                        except RuntimeError as error:
                            self.assertIn("ZeroDivisionError", str(error))
                            with self.assertRaisesRegex(ZeroDivisionError, r"hops_jax: aten\.\w+.*an integer divided by zero") as raised:
                                compiled(x, y)
                            self.assertIsInstance(raised.exception, RuntimeError)
                            continue
                        torch.testing.assert_close(compiled(x, y), expected, equal_nan=True)

    def test_a_users_assert_on_tensors_raises_as_under_other_backends(self):
        # Dynamo makes ``assert cond, msg`` on a tensor torch._assert_async: aot_eager and inductor
        # raise RuntimeError(msg) when it is false; so does hops_jax, in a scan body too. (The
        # program is compiled from text: pytest rewrites this module's asserts into branches.)
        source = """
def program(x, scale):
    assert (scale > 0).all(), "scale must be positive {per row}"

    def step(carry, row):
        torch._assert_async(row.abs().max() < 100, "a row past 100")  # (a body's assert is a branch to Dynamo)
        return carry + row * scale, None

    return hops.scan(step, torch.zeros(3), x)[0]
"""
        scope = {"torch": torch, "hops": hops}
        exec(compile(source, "user_program.py", "exec"), scope)
        program = scope["program"]

        compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
        x, scale = torch.randn(4, 3), torch.rand(3) + 0.5
        torch.testing.assert_close(compiled(x, scale), program(x, scale))
        for bad, message in (((x, -scale), r"scale must be positive \{per row\}"), ((x.index_fill(0, torch.tensor(2), 200.0), scale), "a row past 100")):
            with self.subTest(message=message):
                with self.assertRaisesRegex(RuntimeError, f"hops_jax: {message}$") as raised:
                    compiled(*bad)
                self.assertIsInstance(raised.exception, AssertionError)
                with self.assertRaisesRegex(RuntimeError, message):
                    torch.compile(program, backend="aot_eager", fullgraph=True)(*bad)

    def test_a_singular_or_indefinite_matrix_raises_linalg_error_as_torch_compile_does(self):
        # where torch.compile (aot_eager) raises torch.linalg.LinAlgError on a singular / indefinite
        # input (2.13 on: the check is an effect-ordered op in the graph; 2.9's graphs drop it), so
        # does hops_jax; the _ex ones return eager's status
        singular, indefinite = torch.zeros(2, 3, 3), torch.stack([torch.eye(3), -torch.eye(3)])
        for program, bad in (
            (torch.linalg.inv, singular),
            (torch.linalg.cholesky, indefinite),
            (lambda a: torch.linalg.solve(a, torch.ones(3)), singular),
            (lambda a: torch.linalg.lu_factor(a)[0], singular),
        ):
            torch._dynamo.reset()
            try:
                torch.compile(program, backend="aot_eager", fullgraph=True)(bad)
            except RuntimeError:
                torch._dynamo.reset()
                with self.assertRaisesRegex(torch.linalg.LinAlgError, r"hops_jax: .*(singular|not positive-definite)"):
                    torch.compile(program, backend=hops_jax, fullgraph=True)(bad)
            else:
                torch._dynamo.reset()
                torch.compile(program, backend=hops_jax, fullgraph=True)(bad)  # runs, as under aot_eager
        for program, bad in ((lambda a: torch.linalg.inv_ex(a)[1], singular), (lambda a: torch.linalg.cholesky_ex(a)[1], indefinite)):
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(program, backend=hops_jax, fullgraph=True)(bad), program(bad))

    def test_an_index_out_of_range_in_a_local_map_region_raises(self):
        # (the region is a shard_map: each block checks its own indices)
        lookup = hops.local_map(
            lambda ids, w: F.embedding(ids, w) * 2, mesh=MESH, in_placements=((Shard(0), Replicate()), (Replicate(), Replicate())), out_placements=(Shard(0), Replicate())
        )
        compiled = torch.compile(lookup, backend=hops_jax, fullgraph=True)
        w, ids = torch.randn(10, 4), torch.tensor([1, 2, 3, 9, 0, 5, 6, 7])
        torch.testing.assert_close(compiled(ids, w), F.embedding(ids, w) * 2)
        with self.assertRaisesRegex(IndexError, r"aten\.embedding: index 10 is out of bounds \(expected 0 <= index < 10\)"):
            compiled(ids.index_fill(0, torch.tensor(7), 10), w)

    def test_an_index_out_of_range_in_a_fused_training_step_raises(self):
        # from the second step the backward runs in the forward's program: still checked
        model = torch.nn.Embedding(10, 4)
        compiled = torch.compile(lambda ids: model(ids).square().mean(), backend=hops_jax, fullgraph=True)
        for _ in range(3):
            compiled(torch.tensor([1, 9])).backward()
        self.assertGreater(backend.COMPILED[-2].fused.hits, 0)
        with self.assertRaisesRegex(IndexError, r"aten\.embedding: index 10 is out of bounds \(expected 0 <= index < 10\)"):
            compiled(torch.tensor([1, 10])).backward()


def with_loss(program):
    """``program``'s floating outputs reduced to one loss, each weighted by its position."""
    import torch.utils._pytree as pytree

    def loss(*inputs):
        outputs = [o for o in pytree.tree_leaves(program(*inputs)) if o.is_floating_point()]
        return sum((o * (i + 1)).sum() for i, o in enumerate(outputs))

    return loss


class TestFusedBackward(TestCase):
    """A forward whose backward has run once computes the backward in the same program, at the
    cotangent its backward was last given (one at first: a loss's); the backward reads those
    gradients where its cotangents are those, else runs its own program."""

    def setUp(self):
        torch._dynamo.reset()

    def steps(self, program, inputs, count=3, cotangents=None, **options):
        """``count`` steps of ``program`` compiled, each checked against eager (loss, gradients of
        the inputs that require them, at ``cotangents[step]``); its forward graph."""
        compiled = torch.compile(program, backend=hops_jax, fullgraph=True, **options)
        wrt = [t for t in inputs if t.requires_grad]
        for step in range(count):
            cotangent = torch.tensor(1.0 if cotangents is None else cotangents[step])
            loss = compiled(*inputs)
            grads = torch.autograd.grad(loss, wrt, cotangent, allow_unused=True)
            expected = program(*inputs)
            expected_grads = torch.autograd.grad(expected, wrt, cotangent, allow_unused=True)
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return next(g for g in reversed(backend.COMPILED) if g.stand_ins or g.speculate)

    def test_every_sample_with_its_loss_compiled_runs_fused_from_its_second_step(self):
        for sample in SAMPLES:
            with self.subTest(sample=sample.name):
                torch._dynamo.reset()
                forward = self.steps(with_loss(sample.program), sample.inputs(2))
                self.assertEqual((forward.fused.hits, forward.fused.misses), (2, 0))

    def test_dropout_fused_draws_a_mask_per_step_and_its_residuals_are_recomputed_with_the_same_key(self):
        w = torch.rand(64, requires_grad=True) + 1
        compiled = torch.compile(lambda w: F.dropout(w, 0.5, training=True).sum(), backend=hops_jax)
        masks = []
        for step, cotangent in enumerate([1.0, 1.0, 1.0, 2.0]):
            torch.manual_seed(step % 3)  # (the last step repeats the first's draw)
            loss = compiled(w)
            (grad,) = torch.autograd.grad(loss, w, torch.tensor(cotangent))
            masks.append(grad != 0)
            torch.testing.assert_close(grad, masks[-1] * 2.0 * cotangent, rtol=0, atol=0)  # kept: scaled by 1/(1-p)
            torch.testing.assert_close(loss, (masks[-1] * 2.0 * w).sum())  # the loss of the same mask
        forward = backend.COMPILED[-2]
        self.assertEqual((forward.fused.hits, forward.fused.misses), (2, 1))  # the last step ran split, recomputed
        self.assertFalse(torch.equal(masks[1], masks[2]))
        self.assertTrue(torch.equal(masks[0], masks[3]))

    def test_another_cotangent_runs_the_backwards_program_and_is_the_next_steps(self):
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        program = lambda x, w: hops.annotate_sharding(torch.tanh(x @ w), ROWS).square().sum()  # noqa: E731
        # (a loss accumulated over three steps, then a scale that changes twice, then stays)
        cotangents = [1.0, 1.0, 1 / 3, 1 / 3, 1 / 3, 0.5, 2.0, 2.0, 2.0, 2.0]
        forward = self.steps(program, (x, w), count=len(cotangents), cotangents=cotangents)
        # steps 1, 3, 4 and 9 fused; off after the two misses in a row (5, 6), on again after two
        # split steps (7, 8) given the cotangent it would have used
        self.assertEqual((forward.fused.hits, forward.fused.misses), (4, 0))

    def test_a_loss_returned_beside_other_outputs_fuses_where_only_the_loss_is_differentiated(self):
        x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        program = lambda x, w: ((x @ w).sin().sum(), {"logits": x @ w, "scaled": 2 * w})  # noqa: E731  (as HF's outputs)
        compiled = torch.compile(program, backend=hops_jax)
        for uses_logits in (False, False, False, True, False):
            loss, outputs = compiled(x, w)
            expected_loss, expected_outputs = program(x, w)
            total = loss + outputs["logits"].square().sum() if uses_logits else loss
            expected_total = expected_loss + expected_outputs["logits"].square().sum() if uses_logits else expected_loss
            torch.testing.assert_close(torch.autograd.grad(total, w), torch.autograd.grad(expected_total, w))
            torch.testing.assert_close(outputs, expected_outputs)
        fused = backend.COMPILED[-2].fused
        self.assertEqual((fused.hits, fused.misses, fused.count), (3, 0, 3))  # the miss (logits used) reset by a hit

    def test_a_second_backward_of_one_step_recomputes_its_residuals(self):
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        compiled = torch.compile(lambda x, w: torch.tanh(x @ w).square().sum(), backend=hops_jax)
        expected = torch.autograd.grad(torch.tanh(x @ w).square().sum(), (x, w))
        with unittest.mock.patch.object(torch._functorch.config, "donated_buffer", False):  # (torch's, for retain_graph)
            for _ in range(2):
                loss = compiled(x, w)
                first = torch.autograd.grad(loss, (x, w), retain_graph=True)
                second = torch.autograd.grad(loss, (x, w))
                for got in (*first, *second):
                    self.assertFalse(got.requires_grad)
                torch.testing.assert_close([*first, *second], [*expected, *expected])
        self.assertEqual(backend.COMPILED[-2].fused.hits, 1)

    def test_forwards_without_backward_stop_fusing_until_training_resumes(self):
        x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        program = lambda x, w: (x @ w).sin().sum()  # noqa: E731
        forward = self.steps(program, (x, w), count=2)
        for _ in range(3):  # (evaluating with gradients enabled)
            torch.compile(program, backend=hops_jax)(x, w)  # (the same graph: Dynamo's cache) no backward
        self.assertFalse(forward.fused.on)
        self.steps(program, (x, w), count=2)  # split, eager's gradients: the program would have served both
        self.assertTrue(forward.fused.on)
        self.steps(program, (x, w), count=2)
        self.assertEqual((forward.fused.hits, forward.fused.misses), (3, 0))

    def test_a_batch_norm_writing_its_running_statistics_runs_split(self):
        norm = torch.nn.BatchNorm1d(4)
        x = torch.randn(8, 4, requires_grad=True)
        compiled = torch.compile(lambda x: norm(x).square().sum(), backend=hops_jax)
        eager = torch.nn.BatchNorm1d(4)
        for cotangent in [1.0, 1.0, 2.0]:
            (grad,) = torch.autograd.grad(compiled(x), x, torch.tensor(cotangent))
            (expected,) = torch.autograd.grad(eager(x).square().sum(), x, torch.tensor(cotangent))
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(norm.running_mean, eager.running_mean)
        self.assertIsNone(backend.COMPILED[-2].fused)

    def test_an_input_saved_for_the_backward_and_modified_in_place_is_refused_as_autograd_does(self):
        x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        program = lambda x, w: (x @ w).sin().sum()  # noqa: E731  (saves x, the input, and x @ w)
        compiled = torch.compile(program, backend=hops_jax)
        for step, cotangent in enumerate([1.0, 1.0, 2.0]):  # split, fused, recomputed
            for run in (program, compiled):
                with self.subTest(step=step, run=run):
                    loss = run(x, w)
                    with torch.no_grad():
                        x.add_(1)
                    with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
                        torch.autograd.grad(loss, w, torch.tensor(cotangent))
        fused = backend.COMPILED[-2].fused
        self.assertEqual((fused.hits, fused.misses), (1, 1))  # each path taken: fused, recomputed

    def test_an_input_not_saved_may_be_modified_in_place_before_the_backward(self):
        x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
        compiled = torch.compile(lambda x, w: (x @ w).sum(), backend=hops_jax)  # saves x only
        for _ in range(3):
            loss = compiled(x, w)
            with torch.no_grad():
                w.mul_(2)
            (grad,) = torch.autograd.grad(loss, w)
            torch.testing.assert_close(grad, x.sum(0, keepdim=True).T.expand(4, 4))


BIG = torch.tensor([[2**40 + 3, -5, 7], [1, 2**33, -(2**35)]])  # int64 values past int32's range
NEAR_ONE = torch.tensor([1 + 1e-12, 1 - 3e-12, 2.0], dtype=torch.float64)  # equal to 1 in float32


class TestEagerDtypes(TestCase):
    """Results and gradients with eager's dtypes and values: int64 / float64 / complex128 programs
    computed in 64 bits (jax's x64 mode scoped to the backend's calls), not jax's 32-bit default."""

    def setUp(self):
        torch._dynamo.reset()

    def check(self, program, *inputs):
        """``program`` compiled gives eager's outputs and inputs' gradients: dtypes and values
        (float64 within float64's default tolerance, which float32 rounding misses)."""
        compiled = torch.compile(program, backend=hops_jax, fullgraph=True)
        got, expected = self.run_with_gradients(compiled, inputs), self.run_with_gradients(program, inputs)
        self.assertEqual(len(got), len(expected))
        for i, (a, b) in enumerate(zip(got, expected)):
            exact = not (b.is_floating_point() or b.is_complex())
            torch.testing.assert_close(a, b, rtol=0 if exact else None, atol=0 if exact else None, msg=lambda m: f"result {i}: {m}")

    @staticmethod
    def run_with_gradients(program, inputs):
        inputs = fresh(inputs)
        outputs = program(*inputs)
        differentiable = [t for t in inputs if t.requires_grad]
        if not differentiable:
            return list(outputs)
        loss = sum((o * (i + 1)).sum() for i, o in enumerate(outputs) if o.requires_grad)
        return [*outputs, *torch.autograd.grad(loss, differentiable)]

    def test_int64_and_bool_results_are_eagers_past_int32(self):
        self.check(lambda v: (v.amax(1), v + 1, v.sum(), v > 2**32, (v > 0).sum(), v.float().argmax()), BIG)

    def test_an_int32_sum_is_int64_as_eager(self):
        self.check(lambda v: (v.sum(), v.cumsum(0)), torch.tensor([2**30, 2**30, 2**30], dtype=torch.int32))

    def test_float64_results_and_gradients_are_computed_in_float64(self):
        x = NEAR_ONE.clone().requires_grad_()
        self.check(lambda v: (((v - 1) * 1e12).square(), torch.exp(v * 300.0)), x)

    def test_complex128_results_and_gradients_are_computed_in_complex128(self):
        z = torch.complex(NEAR_ONE, NEAR_ONE.flip(0)).requires_grad_()
        self.check(lambda v: torch.view_as_real(((v - 1) * 1e12) * (v - 1)), z)

    def test_float32_results_stay_float32_with_numbers_made_in_the_program(self):
        # torch.full / arange of Python floats are float32 (torch's default), not jax's x64 float64
        x = torch.tensor([1.5, 2.25, 3.0], dtype=torch.float16)
        self.check(lambda v: (v + torch.arange(0.5, 3.5), v * torch.full((3,), 2.5), torch.arange(3) + v.argmax()), x)

    def test_the_callers_jax_config_is_left_as_it_was(self):
        before = jax.config.jax_enable_x64
        torch.compile(lambda v: v * 2, backend=hops_jax)(BIG)
        self.assertEqual(jax.config.jax_enable_x64, before)
        self.assertEqual(jax.numpy.arange(2).dtype, jax.numpy.int64 if before else jax.numpy.int32)
