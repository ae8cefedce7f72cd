"""Compile time of a scan under the default ``torch.compile`` backend (inductor), flat in depth.

A residual tanh layer (``h + tanh(h @ w)``, D = 64) applied N times, forward + backward,
compiled with inductor's on-disk caches disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``:
a warm cache hides the cost a user pays), in one process after one warm-up compile:

- ``hops.scan`` over stacked weights: inductor receives the scan node and lowers it to one
  ``while_loop`` whose body is compiled once (``hops/_inductor.py``);
- torch's own scan HOP (``torch._higher_order_ops.scan``), which inductor also lowers to a
  ``while_loop``; its outcome is printed beside ours (on torch 2.13 and 2.15 it fails on CPU
  with ``DataDependentOutputException`` in ``decompose_scan_to_while_loop``);
- the Python loop (the layers unrolled into the graph): compile time linear in N.

Prints, per N, each compile time and run time (forward + backward of the compiled program),
then the ratios the targets are stated in: T(64)/T(4) for hops.scan (target <= 1.5),
hops.scan / torch's scan compile time (target <= 1.0 where torch's compiles), hops.scan /
unrolled run time (target <= 1.2).

    python benchmarks/inductor_scan.py [--lengths 4 16 64] [--unrolled-lengths 4 16]
"""

from __future__ import annotations

import os

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

import hops  # noqa: E402

WIDTH, BATCH = 64, 32


def layer(h, w):
    return h + torch.tanh(h @ w)


def hops_program(h, ws):
    h, _ = hops.scan(lambda c, w: (layer(c, w), None), h, ws)
    return h


def torch_program(h, ws):
    from torch._higher_order_ops.scan import scan

    def step(c, w):
        c = layer(c, w)
        return c, c.sum()  # torch's scan wants a ys output

    h, _ = scan(step, h, ws)
    return h


def unrolled_program(h, ws):
    for i in range(ws.shape[0]):
        h = layer(h, ws[i])
    return h


PROGRAMS = {"hops.scan": hops_program, "torch scan": torch_program, "unrolled": unrolled_program}


def inputs(length):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(BATCH, WIDTH, generator=generator, requires_grad=True)
    ws = (torch.randn(length, WIDTH, WIDTH, generator=generator) / WIDTH).requires_grad_()
    return h, ws


def forward_backward(fn, h, ws):
    out = fn(h, ws)
    out.sum().backward()
    return out


def measure(name, length, repeats):
    """(compile seconds, run seconds per forward + backward, max error vs eager), or the
    failure's one-line description."""
    torch._dynamo.reset()
    program = PROGRAMS[name]
    compiled = torch.compile(program, fullgraph=True)
    h, ws = inputs(length)
    try:
        start = time.perf_counter()
        out = forward_backward(compiled, h, ws)
        compile_seconds = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 (printed as torch's outcome)
        line = traceback.format_exception_only(type(error), error)[-1].strip().splitlines()[0]
        return f"fails: {line[:100]}"
    reference_h, reference_ws = inputs(length)
    expected = forward_backward(unrolled_program, reference_h, reference_ws)
    error = max((out - expected).abs().max().item(), ((ws.grad - reference_ws.grad).abs().max() / reference_ws.grad.abs().max()).item())
    start = time.perf_counter()
    for _ in range(repeats):
        forward_backward(compiled, h, ws)
    return compile_seconds, (time.perf_counter() - start) / repeats, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--unrolled-lengths", type=int, nargs="+", default=[4, 16], help="the unrolled compile is linear in N")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, inductor caches disabled, D={WIDTH}, batch {BATCH}, forward + backward")
    measure("unrolled", 1, 1)  # warm-up: inductor's own first-compile costs
    results = {}
    for length in args.lengths:
        for name in PROGRAMS:
            if name == "unrolled" and length not in args.unrolled_lengths:
                continue
            results[name, length] = outcome = measure(name, length, args.repeats)
            if isinstance(outcome, str):
                print(f"N={length:3d} {name:10s} {outcome}")
            else:
                compile_s, run_s, error = outcome
                print(f"N={length:3d} {name:10s} compile {compile_s:6.2f} s   run {run_s * 1e3:7.2f} ms   max error {error:.1e}")

    def compile_time(name, length):
        outcome = results.get((name, length))
        return None if outcome is None or isinstance(outcome, str) else outcome[0]

    print("ratios (one run):")
    first, last = min(args.lengths), max(args.lengths)
    ours_first, ours_last = compile_time("hops.scan", first), compile_time("hops.scan", last)
    if ours_first and ours_last:
        print(f"  hops.scan compile T({last})/T({first}) = {ours_last / ours_first:.2f}   (target <= 1.5)")
    for length in args.lengths:
        ours, theirs = compile_time("hops.scan", length), compile_time("torch scan", length)
        if ours and theirs:
            print(f"  N={length}: hops.scan / torch scan compile = {ours / theirs:.2f}   (target <= 1.0)")
        elif ours:
            print(f"  N={length}: torch scan does not compile here; hops.scan does ({ours:.2f} s)")
        unrolled = results.get(("unrolled", length))
        if ours and unrolled and not isinstance(unrolled, str):
            ours_run = results["hops.scan", length][1]
            print(
                f"  N={length}: hops.scan / unrolled: compile {ours / unrolled[0]:.2f}, "
                f"run {ours_run / unrolled[1]:.2f}   (target run <= 1.2)"
            )


if __name__ == "__main__":
    main()
