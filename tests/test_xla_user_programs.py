"""What torch_xla users meet that the other XLA tests never wrote (issue 32): programs in the
order a user writes them, in a fresh process where the test session's set-up (``conftest.py``
runs one XLA backward first) would hide the problem."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )


@pytest.mark.xla
def test_a_cpu_backward_before_the_first_xla_backward_is_a_typed_error_naming_the_remedy():
    """A user computes the CPU reference first (one CPU backward), then compiles with
    ``backend="hops_xla"``: torch's autograd engine has sized its device queues without the
    XLA device (torch_xla's behaviour under SPMD), and no XLA backward can run in the process.
    The backend (and ``hops.assume_pure``) says so before tracing, naming what works, instead
    of torch's internal assert at the user's ``loss.backward()``. (That ``prepare_autograd_for_xla()`` called first
    makes XLA backwards work is what ``conftest.py`` relies on for the whole suite.)"""
    program = """
        import torch, torch_xla
        import torch_xla.runtime as xr
        xr.use_spmd()
        import passes.xla
        w = torch.randn(4, 4, requires_grad=True)
        (w.tanh().sum()).backward()  # the CPU reference
        try:  # what backend="hops_xla" and hops.assume_pure on XLA tensors call first
            passes.xla.prepare_autograd_for_xla()
        except Exception as error:
            causes = [error]
            while causes[-1] is not None:
                causes.append(causes[-1].__cause__ or getattr(causes[-1], "inner_exception", None))
            typed = [e for e in causes if isinstance(e, passes.xla.XlaAutogradOrderError)]
            print(f"{type(typed[0]).__name__}: {typed[0]}" if typed else f"untyped {type(error).__name__}: {error}")
    """
    done = run_fresh(program)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert last.startswith("XlaAutogradOrderError"), done.stdout + done.stderr[-2000:]
    assert "passes.xla.prepare_autograd_for_xla()" in last, last


# Bodies whose backward torch_xla has no kernel for (it would copy the inputs to the host): each
# op named is in the traced graph, so the test covers the class, not one op.
def layer_norm_step(h, w):
    return torch.nn.functional.layer_norm(h @ w, h.shape[-1:], w[0], w[1]).tanh()


def group_norm_step(h, w):
    return torch.nn.functional.group_norm(h @ w, 2, w[0], w[1]).tanh()


def glu_step(h, w):
    return torch.nn.functional.glu(torch.cat([h, h @ w], -1)).tanh()


HOST_FALLBACK_BODIES = {
    "native_layer_norm_backward": layer_norm_step,
    "native_group_norm_backward": group_norm_step,
    "glu_backward": glu_step,
}


@pytest.mark.xla
@pytest.mark.parametrize("op", sorted(HOST_FALLBACK_BODIES))
def test_a_scan_body_with_an_op_torch_xla_runs_on_the_host_lowers_and_runs(op):
    """``make_fx`` of a training step whose scan body's backward calls an op torch_xla has no
    kernel for (LayerNorm's backward: every GPT-2 / OPT layer), ``lower_to_xla``, run on XLA:
    the While body is staged on placeholders, and torch_xla's copy of them to the host aborted
    the process. Loss and gradients equal eager's on the CPU."""
    import torch_xla

    body = HOST_FALLBACK_BODIES[op]

    def step(h, ws):
        def scan_step(carry, w):
            return body(carry, w), None

        last, _ = hops.scan(scan_step, h, ws)
        loss = last.square().sum()
        return loss, *torch.autograd.grad(loss, (h, ws))

    generator = torch.Generator().manual_seed(0)
    h = torch.randn(4, 8, generator=generator, requires_grad=True)
    ws = (torch.randn(3, 8, 8, generator=generator) / 3).requires_grad_()
    expected = step(h, ws)
    gm = make_fx(step, tracing_mode="fake")(h, ws)
    targets = {str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes}
    assert f"aten.{op}.default" in targets, sorted(targets)
    passes.lower_to_xla(gm)
    device = torch_xla.device()
    got = gm(h.detach().to(device), ws.detach().to(device))  # the graph computes the gradients
    torch_xla.sync()
    for name, value, reference in zip(("loss", "grad h", "grad ws"), got, expected):
        torch.testing.assert_close(value.cpu(), reference.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# Ops torch_xla runs only on the host that torch's table cannot decompose either: a staged
# computation cannot run them at all (each is asserted to be in that class, so the list tracks
# torch_xla's kernels).
HOST_ONLY_STEPS = {
    "median": (lambda c, x: c + torch.median(x), "aten.median.default"),
    "searchsorted": (lambda c, x: c + torch.searchsorted(torch.arange(4.0, device=x.device), x).sum(), "aten.searchsorted.Tensor"),
    "rfft": (lambda c, x: c + torch.view_as_real(torch.fft.rfft(x)).sum(), "aten._fft_r2c.default"),
}


def _causes(error):
    while error is not None:
        yield error
        error = error.__cause__ or getattr(error, "inner_exception", None)


@pytest.mark.xla
@pytest.mark.parametrize("name", sorted(HOST_ONLY_STEPS))
def test_an_op_only_the_host_runs_in_a_staged_computation_is_a_typed_error_naming_it(name):
    """``torch.median`` (and any op torch_xla has no kernel for and torch no decomposition of) in
    a scan body lowered to XLA, or in a ``hops_xla`` graph: torch_xla would copy the staged
    placeholders to the host and abort the process. Refused before staging, naming the op;
    outside a staged computation (the lowered graph's top level) the op still runs."""
    import torch_xla

    from passes.xla import portable

    fn, op = HOST_ONLY_STEPS[name]
    assert portable.falls_back_to_host(eval(f"torch.ops.{op}")) and not portable.device_decomposition(eval(f"torch.ops.{op}"))
    device = torch_xla.device()
    c, xs = torch.zeros(()), torch.randn(3, 5)

    def scanned(c, xs):
        return hops.scan(lambda c, x: (fn(c, x), c), c, xs)

    gm = passes.lower_to_xla(make_fx(scanned)(c, xs))
    with pytest.raises(portable.HostOnlyOpError, match=rf"scan body .*: {op} has no XLA kernel"):
        gm(c.to(device), xs.to(device))

    compiled = torch.compile(lambda c, x: fn(c, x) * 2, backend="hops_xla")
    with pytest.raises(Exception) as raised:
        compiled(c.to(device), xs[0].to(device))
    typed = [e for e in _causes(raised.value) if isinstance(e, portable.HostOnlyOpError)]
    assert typed and op in str(typed[0]), repr(raised.value)

    lazy = passes.lower_to_xla(make_fx(lambda c, x: fn(c, x) * 2)(c, xs[0]))
    torch.testing.assert_close(lazy(c.to(device), xs[0].to(device)).cpu(), fn(c, xs[0]) * 2)


class Normed(torch.nn.Module):
    """A linear layer then a normalisation whose forward saves statistics for its backward."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = {"layer_norm": torch.nn.LayerNorm(8), "group_norm": torch.nn.GroupNorm(2, 8)}[norm]

    def forward(self, x):
        return self.norm(self.linear(x).tanh()).square().mean()


@pytest.mark.xla
@pytest.mark.parametrize("norm", ["layer_norm", "group_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_hops_xla_trains_a_model_whose_saved_values_differ_in_dtype_from_the_trace(norm, dtype):
    """``torch.compile(backend="hops_xla")`` of a bf16 model with a LayerNorm (GPT-2, OPT):
    the forward graph, traced with torch's meta rules, saves LayerNorm's mean and rstd as
    float32, but torch_xla computes them in bf16; the backward graph staged for the trace's
    float32 was refused by XLA (``Call parameter must match argument``). Loss and gradients
    equal the CPU's (to bf16's precision), on two calls."""
    import torch_xla

    torch.manual_seed(0)
    model = Normed(norm).to(dtype)
    x = torch.randn(4, 8, dtype=dtype)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_loss = model(x).detach()
    device = torch_xla.device()
    on_xla = Normed(norm).to(dtype)
    on_xla.load_state_dict(model.state_dict())
    on_xla.to(device)
    torch._dynamo.reset()
    compiled = torch.compile(on_xla, backend="hops_xla")
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for _ in range(2):
        on_xla.zero_grad(set_to_none=True)
        loss = compiled(x.to(device))
        loss.backward()
        torch_xla.sync()
        torch.testing.assert_close(loss.detach().cpu(), expected_loss, **tolerance)
        for (name, p), reference in zip(on_xla.named_parameters(), expected):
            torch.testing.assert_close(p.grad.cpu(), reference, msg=lambda m: f"gradient of {name}: {m}", **tolerance)
