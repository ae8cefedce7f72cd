"""The solver core's engines side by side on generated families (``families.contest_like``).

Per problem (a seed, a node count, a memory tightness: the usage limit over the least peak,
``None`` for no limit) and engine (``solve_problem(search=...)``: ``exact``, the neighbourhood
search with HiGHS alone; ``toulbar2``, toulbar2 alone after the heuristics; ``auto``, the
portfolio), this prints the plan's cost relative to the best any engine found on that
problem, the engine's lower bound relative to the same, and the seconds taken against the
time limit (every call must return within the limit plus the larger of 1 s and 2%). Each
plan is checked by ``problem_cost`` and ``peak_usage`` (an independent evaluation). A final
row per engine: the geometric mean of cost / best, the worst, and the longest overrun.

Re-measured at commit "docs: the IOPDDL figures after priced rounds with toulbar2" (idle 2-core
machine, torch 2.13 venv; ``--sizes 500,2000,8000 --seeds 0,1 --tightness none,1.1 --engines
exact,auto``, 10 s): every problem now gets a plan from both engines (the feasibility phase of
issue 33), where the table below, measured before it, had none on 11-14 of 27:

| nodes | tightness | seed | exact cost | exact bound | exact s | auto cost | auto bound | auto s |
|---|---|---|---|---|---|---|---|---|
| 500 | None | 0 | 1.0000 | 1.0000 | 3.1 | 1.0000 | 1.0000 | 0.4 |
| 500 | None | 1 | 1.0000 | 1.0000 | 1.8 | 1.0000 | 1.0000 | 0.4 |
| 500 | 1.1 | 0 | 1.0000 | 1.0000 | 4.5 | 1.0000 | 1.0000 | 2.5 |
| 500 | 1.1 | 1 | 1.0028 | 0.9983 | 9.5 | 1.0000 | 1.0000 | 2.1 |
| 2000 | None | 0 | 1.0000 | 1.0000 | 3.8 | 1.0000 | 1.0000 | 1.7 |
| 2000 | None | 1 | 1.0000 | 1.0000 | 6.8 | 1.0000 | 1.0000 | 2.5 |
| 2000 | 1.1 | 0 | 1.2717 | 0.9770 | 9.4 | 1.0000 | 0.9961 | 9.4 |
| 2000 | 1.1 | 1 | 1.0852 | 0.9169 | 9.4 | 1.0000 | 0.9302 | 9.5 |
| 8000 | None | 0 | 1.0043 | 0.9703 | 9.4 | 1.0000 | 0.9713 | 9.4 |
| 8000 | None | 1 | 1.0000 | 0.9729 | 9.3 | 1.0021 | 0.9729 | 9.4 |
| 8000 | 1.1 | 0 | 1.0000 | 0.7502 | 9.3 | 1.1142 | 0.7706 | 9.5 |
| 8000 | 1.1 | 1 | 1.0064 | 0.6900 | 9.4 | 1.0000 | 0.7106 | 9.4 |
exact: geometric mean cost/best 1.0284, worst 1.2717, no plan 0, longest past the limit -0.52 s
auto: geometric mean cost/best 1.0092, worst 1.1142, no plan 0, longest past the limit -0.51 s

Open: at 8000 nodes under a limit the portfolio can end worse than the neighbourhood search
alone (1.114x above): toulbar2 shares the 2 cores and its plans there are not the better ones.

Earlier (torch 2.13 venv, pytoulbar2 1.4.0.1, HiGHS via highspy; the 2-core machine shared
with other work, load 3-5, so the 8000-node rows found no plan in 10 s where a quieter run of
the same code found some; "nan": no engine found a plan; bounds are each engine's own):

| nodes | tightness | seed | exact cost | exact bound | exact s | toulbar2 cost | toulbar2 bound | toulbar2 s | auto cost | auto bound | auto s |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 500 | None | 0 | 1.0963 | 0.8347 | 10.0 | 1.0000 | 1.0000 | 1.7 | 1.0000 | 1.0000 | 1.3 |
| 500 | None | 1 | 1.0566 | 0.8777 | 10.1 | 1.0000 | 1.0000 | 1.9 | 1.0000 | 1.0000 | 1.2 |
| 500 | None | 2 | 1.0506 | 0.9312 | 10.0 | 1.0000 | 1.0000 | 2.0 | 1.0000 | 1.0000 | 1.1 |
| 500 | 1.1 | 0 | 1.5057 | 0.9819 | 9.6 | 1.0000 | 1.0000 | 2.3 | 1.0000 | 1.0000 | 1.8 |
| 500 | 1.1 | 1 | inf | -inf | 9.4 | 1.0000 | 1.0000 | 4.1 | 1.0000 | 1.0000 | 4.0 |
| 500 | 1.1 | 2 | 1.1550 | 0.9950 | 9.5 | 1.0000 | 1.0000 | 2.2 | 1.0000 | 1.0000 | 2.1 |
| 500 | 1.02 | 0 | 1.5525 | 0.9851 | 9.5 | 1.0000 | 1.0000 | 2.7 | 1.0000 | 1.0000 | 1.8 |
| 500 | 1.02 | 1 | inf | -inf | 9.4 | 1.0000 | 1.0000 | 2.9 | 1.0000 | 1.0000 | 2.5 |
| 500 | 1.02 | 2 | 1.1644 | 0.9935 | 9.6 | 1.0000 | 1.0000 | 1.8 | 1.0000 | 1.0000 | 2.5 |
| 2000 | None | 0 | 1.2290 | 0.8596 | 10.1 | 1.0000 | 1.0000 | 9.3 | 1.0000 | 1.0000 | 4.2 |
| 2000 | None | 1 | 1.1932 | 0.8831 | 10.1 | 1.0000 | 0.9860 | 9.9 | 1.0798 | 0.9854 | 10.9 |
| 2000 | None | 2 | 1.2898 | 0.8982 | 10.1 | 1.0000 | 0.9964 | 9.9 | 1.0000 | 1.0000 | 5.2 |
| 2000 | 1.1 | 0 | 1.3471 | 0.6637 | 9.7 | inf | -inf | 5.6 | 1.0000 | 0.8077 | 9.8 |
| 2000 | 1.1 | 1 | 1.0000 | 0.5417 | 9.7 | 1.0000 | 0.6425 | 9.2 | 1.0000 | 0.6425 | 9.8 |
| 2000 | 1.1 | 2 | nan | nan | 9.6 | nan | nan | 8.8 | nan | nan | 9.6 |
| 2000 | 1.02 | 0 | inf | -inf | 9.5 | 1.1390 | 0.9199 | 10.2 | 1.0000 | 0.9195 | 9.8 |
| 2000 | 1.02 | 1 | 1.0000 | 0.5417 | 9.5 | 1.0000 | 0.6425 | 9.4 | 1.0000 | 0.6425 | 9.9 |
| 2000 | 1.02 | 2 | nan | nan | 9.5 | nan | nan | 8.9 | nan | nan | 9.7 |
| 8000 | None | 0 | nan | nan | 9.3 | nan | nan | 6.3 | nan | nan | 9.5 |
| 8000 | None | 1 | nan | nan | 9.7 | nan | nan | 9.8 | nan | nan | 9.3 |
| 8000 | None | 2 | nan | nan | 9.7 | nan | nan | 8.1 | nan | nan | 9.7 |
| 8000 | 1.1 | 0 | nan | nan | 9.6 | nan | nan | 12.4 | nan | nan | 12.1 |
| 8000 | 1.1 | 1 | nan | nan | 9.7 | nan | nan | 12.7 | nan | nan | 10.4 |
| 8000 | 1.1 | 2 | nan | nan | 9.5 | nan | nan | 7.6 | nan | nan | 10.9 |
| 8000 | 1.02 | 0 | nan | nan | 9.6 | nan | nan | 10.8 | nan | nan | 10.4 |
| 8000 | 1.02 | 1 | nan | nan | 9.3 | nan | nan | 11.2 | nan | nan | 11.3 |
| 8000 | 1.02 | 2 | nan | nan | 9.4 | nan | nan | 7.5 | nan | nan | 9.3 |
exact: geometric mean cost/best 1.1914, worst inf, no plan 14, longest past the limit +0.09 s
toulbar2: geometric mean cost/best 1.0087, worst inf, no plan 12, longest past the limit +2.74 s
auto: geometric mean cost/best 1.0048, worst 1.0798, no plan 11, longest past the limit +2.12 s

The table above is of the sequential portfolio (toulbar2 for 85% of the time, then the
neighbourhood search). Issue 33 runs them at once; measured before and after on the same
machine (500 and 2000 nodes, tightness none and 1.1, seeds 0 and 1, engines exact and auto;
"busy": a ``while True: pass`` loop on one of the 2 cores; the geometric mean of cost / best
plan of that run, the rows where auto's plan was worse than exact's or missing where exact
had one, and the problems with no plan from auto):

| limit | load | before: exact / auto geo mean | before: auto worse or missing | after: exact / auto geo mean | after: auto worse or missing |
|---|---|---|---|---|---|
| 3 s | idle | 1.1628 / 1.0000 (auto no plan 1) | 0 | 1.1868 / 1.0118 (auto no plan 1) | 1 (1.085x, 2000 nodes, 1.1) |
| 3 s | busy | 1.1090 / 1.0031 (auto no plan 2) | 1 (1.019x) | 1.0256 / 1.0000 (auto no plan 2) | 0 |
| 8 s | idle | 1.0947 / 1.0018 (auto no plan 1) | 1 (no plan; exact had one) | 1.1642 / 1.0000 (auto no plan 0) | 0 |
| 8 s | busy | 1.0578 / 1.0073 (auto no plan 2) | 1 (1.044x) | 1.1480 / 1.0288 (auto no plan 2) | 2 (1.167x, 1.016x; 2000 nodes) |

Every call stayed within its limit (+0.01 s at most after). What remains: on a loaded machine
the two engines share the cores, so at 2000 nodes the neighbourhood search inside auto can end
worse than it does alone (one core fewer for it while toulbar2 runs).

Usage: python benchmarks/solver_engines.py [--time-limit S] [--sizes 500,2000,8000]
       [--seeds 0,1] [--tightness none,1.1,1.02] [--engines exact,toulbar2,auto]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from passes.solver import NoPlanFoundError, peak_usage, problem_cost, solve_problem  # noqa: E402
from passes.solver.families import contest_like  # noqa: E402


def _run(problem, engine: str, limit: float) -> tuple[float, float, float]:
    began = time.perf_counter()
    try:
        solution = solve_problem(problem, time_limit=limit, search=engine)
    except NoPlanFoundError:
        return math.inf, -math.inf, time.perf_counter() - began
    seconds = time.perf_counter() - began
    cost = problem_cost(problem, solution.strategies)
    assert math.isclose(cost, solution.cost, rel_tol=1e-9), (cost, solution.cost)
    assert problem.usage_limit is None or peak_usage(problem, solution.strategies) <= problem.usage_limit
    return cost, solution.lower_bound, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--sizes", default="500,2000,8000")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tightness", default="none,1.1,1.02")
    parser.add_argument("--engines", default="exact,toulbar2,auto")
    args = parser.parse_args()
    engines = args.engines.split(",")
    tightness = [None if t == "none" else float(t) for t in args.tightness.split(",")]
    limit = args.time_limit
    print(f"time limit {limit:g} s; cost and lower bound relative to the best plan any engine found")
    print("| nodes | tightness | seed | " + " | ".join(f"{e} cost | {e} bound | {e} s" for e in engines) + " |")
    print("|---|---|---|" + "---|---|---|" * len(engines))
    ratios: dict[str, list[float]] = {e: [] for e in engines}
    overrun: dict[str, float] = {e: -math.inf for e in engines}
    for nodes in [int(n) for n in args.sizes.split(",")]:
        for tight in tightness:
            for seed in [int(s) for s in args.seeds.split(",")]:
                problem = contest_like(seed, nodes, tightness=tight)
                found = {e: _run(problem, e, limit) for e in engines}
                best = min(cost for cost, _, _ in found.values())
                cells = []
                for e in engines:
                    cost, lower, seconds = found[e]
                    ratios[e].append(cost / best)
                    overrun[e] = max(overrun[e], seconds - limit)
                    cells.append(f"{cost / best:.4f} | {lower / best:.4f} | {seconds:.1f}")
                print(f"| {nodes} | {tight} | {seed} | " + " | ".join(cells) + " |", flush=True)
    for e in engines:
        finite = [r for r in ratios[e] if math.isfinite(r)]
        geo = math.exp(sum(math.log(r) for r in finite) / len(finite)) if finite else math.inf
        print(
            f"{e}: geometric mean cost/best {geo:.4f}, worst {max(ratios[e]):.4f}, "
            f"no plan {len(ratios[e]) - len(finite)}, longest past the limit {overrun[e]:+.2f} s"
        )


if __name__ == "__main__":
    main()
