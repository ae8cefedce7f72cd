"""Compile time of a scan under the default ``torch.compile`` backend (inductor), flat in depth.

A residual tanh layer (``h + tanh(h @ w)``, D = 64) applied N times, forward + backward,
compiled with inductor's on-disk caches disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``:
a warm cache hides the cost a user pays), in one process after one warm-up compile:

- ``hops.scan`` over stacked weights (``unroll`` left to the lowering, the default):
  inductor receives the scan node and lowers it to one ``while_loop`` whose body is one
  graph whatever N; this step has little work, so the body runs it a few times per
  iteration (``hops/scan.py``, ``_inductor_unroll``);
- ``hops.scan(unroll=1)``: one step per iteration, to show the loop's own per-iteration cost;
- torch's own scan HOP (``torch._higher_order_ops.scan``), which inductor also lowers to a
  ``while_loop``; its outcome is printed beside ours (where it fails, the error);
- the Python loop (the layers unrolled into the graph): compile time linear in N.

Prints, per N, each compile time and run time, then the ratios the targets are stated in:
T(64)/T(4) for hops.scan (target <= 1.5), hops.scan / torch's scan compile time (target
<= 1.0 where torch's compiles), hops.scan / unrolled run time (target <= 1.2). Run time is
one forward + backward of the compiled program, in CPU seconds of this process on one
thread (``torch.set_num_threads(1)``), the best of several rounds that alternate the
programs: the machine is shared and noisy, and CPU time on one thread is what load changes
least.

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


def hops_one_step_program(h, ws):
    h, _ = hops.scan(lambda c, w: (layer(c, w), None), h, ws, unroll=1)
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


PROGRAMS = {"hops.scan": hops_program, "unroll=1": hops_one_step_program, "torch scan": torch_program, "unrolled": unrolled_program}


def inputs(length):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(BATCH, WIDTH, generator=generator, requires_grad=True)
    ws = (torch.randn(length, WIDTH, WIDTH, generator=generator) / WIDTH).requires_grad_()
    return h, ws


def forward_backward(fn, h, ws):
    out = fn(h, ws)
    out.sum().backward()
    return out


def compile_once(name, length):
    """(the compiled program with its inputs, compile seconds, max error vs eager), or the
    failure's one-line description."""
    compiled = torch.compile(PROGRAMS[name], fullgraph=True)
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
    return (compiled, h, ws), compile_seconds, error


def run_times(programs, rounds, repeats):
    """Per program: the best over ``rounds`` (alternating the programs) of the CPU seconds
    one forward + backward takes, averaged over ``repeats`` calls."""
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(rounds):
        for name, (compiled, h, ws) in programs.items():
            start = time.process_time()
            for _ in range(repeats):
                forward_backward(compiled, h, ws)
            best[name] = min(best[name], (time.process_time() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--unrolled-lengths", type=int, nargs="+", default=[4, 16], help="the unrolled compile is linear in N")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, inductor caches disabled, D={WIDTH}, batch {BATCH}, forward + backward, one thread")
    compile_once("unrolled", 1)  # warm-up: inductor's own first-compile costs
    results = {}
    for length in args.lengths:
        torch._dynamo.reset()  # each length compiles afresh (no automatic dynamic shapes)
        compiled = {}
        for name in PROGRAMS:
            if name == "unrolled" and length not in args.unrolled_lengths:
                continue
            outcome = compile_once(name, length)
            if isinstance(outcome, str):
                results[name, length] = outcome
            else:
                compiled[name], compile_s, error = outcome
                results[name, length] = [compile_s, None, error]
        for name, run_s in run_times(compiled, args.rounds, args.repeats).items():
            results[name, length][1] = run_s
        for name in PROGRAMS:
            outcome = results.get((name, length))
            if isinstance(outcome, str):
                print(f"N={length:3d} {name:10s} {outcome}")
            elif outcome is not None:
                compile_s, run_s, error = outcome
                print(f"N={length:3d} {name:10s} compile {compile_s:6.2f} s   run {run_s * 1e3:7.3f} ms   max error {error:.1e}")

    def measured(name, length, what):
        outcome = results.get((name, length))
        return None if outcome is None or isinstance(outcome, str) else outcome[what]

    print("ratios (one run):")
    first, last = min(args.lengths), max(args.lengths)
    ours_first, ours_last = measured("hops.scan", first, 0), measured("hops.scan", last, 0)
    if ours_first and ours_last:
        print(f"  hops.scan compile T({last})/T({first}) = {ours_last / ours_first:.2f}   (target <= 1.5)")
    for length in args.lengths:
        ours, theirs = measured("hops.scan", length, 0), measured("torch scan", length, 0)
        if ours and theirs:
            print(f"  N={length}: hops.scan / torch scan compile = {ours / theirs:.2f}   (target <= 1.0)")
        elif ours:
            print(f"  N={length}: torch scan does not compile here; hops.scan does ({ours:.2f} s)")
        unrolled_compile, unrolled_run = measured("unrolled", length, 0), measured("unrolled", length, 1)
        if ours and unrolled_run:
            print(
                f"  N={length}: hops.scan / unrolled: compile {ours / unrolled_compile:.2f}, "
                f"run {measured('hops.scan', length, 1) / unrolled_run:.2f}   (target run <= 1.2); "
                f"unroll=1 run {measured('unroll=1', length, 1) / unrolled_run:.2f}"
            )


if __name__ == "__main__":
    main()
