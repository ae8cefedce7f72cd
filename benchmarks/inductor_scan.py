"""Compile time of a scan under the default ``torch.compile`` backend (inductor), flat in depth.

A residual tanh layer (``h + tanh(h @ w)``, D = 64) applied N times, its loss
(``last.sum() + ys.sum()``) inside the compiled function as a training step has it,
forward + backward,
compiled with inductor's on-disk caches disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``:
a warm cache hides the cost a user pays), each program and length in a fresh process (the
kernels one compile builds stay in memory and would make the next program's compile look
cheap) after one warm-up compile of an unrelated function (inductor's own start-up):

- ``hops.scan`` over stacked weights (``unroll`` left to the lowering, the default):
  inductor receives the scan node and lowers it to one ``while_loop`` whose body is one
  graph whatever N, one step per iteration;
- ``hops.scan(unroll=2)``: two steps per iteration, to show what the loop's own
  per-iteration cost is worth against the compile time a second step costs;
- torch's own scan HOP (``torch._higher_order_ops.scan``), which inductor also lowers to a
  ``while_loop``; its outcome is printed beside ours (where it fails, the error);
- the Python loop (the layers unrolled into the graph): compile time linear in N.

Prints, per N, each compile time and run time, then the ratios the targets are stated in:
T(64)/T(4) for hops.scan (target <= 1.5), hops.scan / torch's scan compile time (target
<= 1.0 where torch's compiles), hops.scan / unrolled run time (target <= 1.2). Run time is
one forward + backward of the compiled program, in CPU seconds on one thread
(``torch.set_num_threads(1)``), measured for all programs of one N in one process (its own,
after the compile measurements): the best of many rounds that alternate the programs. The
machine is shared and noisy, CPU time on one thread is what load changes least, and one
process for all programs removes the process-to-process spread (allocation, layout) that
separate processes showed (+-15% for the same program).

    python benchmarks/inductor_scan.py [--lengths 4 16 64] [--unrolled-lengths 4 16 64]
    python benchmarks/inductor_scan.py --one NAME LENGTH   (one compile measurement, a JSON line)
    python benchmarks/inductor_scan.py --run-times LENGTH NAME...   (run times, a JSON line)
"""

from __future__ import annotations

import os

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

import hops  # noqa: E402

WIDTH, BATCH = 64, 32


def layer(h, w):
    return h + torch.tanh(h @ w)


def step(c, w):
    c = layer(c, w)
    return c, c


def loss(last, ys):
    # The loss is taken inside the compiled function, as a training step does: its gradient
    # enters the backward loop expanded (the gradient of a .sum() has stride 0).
    return last.sum() + ys.sum()


def hops_program(h, ws):
    return loss(*hops.scan(step, h, ws))


def hops_two_step_program(h, ws):
    return loss(*hops.scan(step, h, ws, unroll=2))


def torch_program(h, ws):
    from torch._higher_order_ops.scan import scan

    def cloned_step(c, w):  # torch's scan refuses a ys output that aliases the carry
        c = layer(c, w)
        return c, c.clone()

    return loss(*scan(cloned_step, h, ws))


def unrolled_program(h, ws):
    ys = []
    for i in range(ws.shape[0]):
        h = layer(h, ws[i])
        ys.append(h)
    return loss(h, torch.stack(ys))


PROGRAMS = {"hops.scan": hops_program, "unroll=2": hops_two_step_program, "torch_scan": torch_program, "unrolled": unrolled_program}


def inputs(length):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(BATCH, WIDTH, generator=generator, requires_grad=True)
    ws = (torch.randn(length, WIDTH, WIDTH, generator=generator) / WIDTH).requires_grad_()
    return h, ws


def forward_backward(fn, h, ws):
    out = fn(h, ws)
    out.backward()
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
    error = max(((out - expected).abs() / expected.abs()).item(), ((ws.grad - reference_ws.grad).abs().max() / reference_ws.grad.abs().max()).item())
    return (compiled, h, ws), compile_seconds, error


def run_times(programs, rounds, repeats):
    """For each name: the best over ``rounds`` (which alternate the programs) of the CPU
    seconds one forward + backward takes, averaged over ``repeats`` calls."""
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(rounds):
        for name, (compiled, h, ws) in programs.items():
            start = time.process_time()
            for _ in range(repeats):
                forward_backward(compiled, h, ws)
            best[name] = min(best[name], (time.process_time() - start) / repeats)
    return best


def measure_one(name, length):
    """This process's compile measurement of ``name`` at ``length``, as a dict."""
    torch.set_num_threads(1)
    torch.compile(lambda x: torch.sin(x) * 2)(torch.randn(3))  # inductor's start-up, not this program's kernels
    outcome = compile_once(name, length)
    if isinstance(outcome, str):
        return {"outcome": outcome}
    _, compile_s, error = outcome
    return {"compile": compile_s, "error": error}


def measure_run_times(length, names, rounds, repeats):
    """Run times of the programs ``names`` at ``length``, compiled and run in this process."""
    torch.set_num_threads(1)
    programs = {}
    for name in names:
        outcome = compile_once(name, length)
        if not isinstance(outcome, str):
            programs[name] = outcome[0]
    return run_times(programs, rounds, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--unrolled-lengths", type=int, nargs="+", default=[4, 16, 64], help="the unrolled compile is linear in N")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--one", nargs=2, metavar=("NAME", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--run-times", nargs="+", metavar="LENGTH NAME", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]))))
        return
    if args.run_times:
        print(json.dumps(measure_run_times(int(args.run_times[0]), args.run_times[1:], args.rounds, args.repeats)))
        return
    print(f"torch {torch.__version__}, inductor caches disabled, D={WIDTH}, batch {BATCH}, forward + backward, one thread")
    results = {}

    def subprocess_json(*arguments):
        command = [sys.executable, __file__, *arguments, "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {"outcome": f"fails: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}

    for length in args.lengths:
        names = [name for name in PROGRAMS if name != "unrolled" or length in args.unrolled_lengths]
        for name in names:
            results[name, length] = subprocess_json("--one", name, str(length))
        compiled = [name for name in names if "outcome" not in results[name, length]]
        for name, seconds in subprocess_json("--run-times", str(length), *compiled).items():
            if name in compiled:  # (a failed run-time process answers {"outcome": ...})
                results[name, length]["run"] = seconds
        for name in names:
            result = results[name, length]
            if "outcome" in result:
                print(f"N={length:3d} {name:10s} {result['outcome']}", flush=True)
            else:
                run = f"{result['run'] * 1e3:7.3f} ms" if "run" in result else "not measured"
                print(f"N={length:3d} {name:10s} compile {result['compile']:6.2f} s   run {run}   max error {result['error']:.1e}", flush=True)

    def measured(name, length, what):
        return results.get((name, length), {}).get(what)

    print("ratios (one run):")
    first, last = min(args.lengths), max(args.lengths)
    ours_first, ours_last = measured("hops.scan", first, "compile"), measured("hops.scan", last, "compile")
    if ours_first and ours_last:
        print(f"  hops.scan compile T({last})/T({first}) = {ours_last / ours_first:.2f}   (target <= 1.5)")
    for length in args.lengths:
        ours, theirs = measured("hops.scan", length, "compile"), measured("torch_scan", length, "compile")
        if ours and theirs:
            two_steps = measured("unroll=2", length, "compile")
            print(
                f"  N={length}: hops.scan / torch scan compile = {ours / theirs:.2f}   (target <= 1.0)"
                + (f"; unroll=2 {two_steps / theirs:.2f}" if two_steps else "")
            )
        elif ours:
            print(f"  N={length}: torch scan does not compile here; hops.scan does ({ours:.2f} s)")
        unrolled_compile, unrolled_run = measured("unrolled", length, "compile"), measured("unrolled", length, "run")
        if ours and unrolled_run:
            two_steps = measured("unroll=2", length, "run")
            print(
                f"  N={length}: hops.scan / unrolled: compile {ours / unrolled_compile:.2f}, "
                f"run {measured('hops.scan', length, 'run') / unrolled_run:.2f}   (target run <= 1.2)"
                + (f"; unroll=2 run {two_steps / unrolled_run:.2f}" if two_steps else "")
            )


if __name__ == "__main__":
    main()
