"""The solver core's toulbar2 engine (``passes.solver.wcsp``) and the portfolio of
``solve_problem(search="auto")``: toulbar2's plans optimal against brute force on small random
problems whose forbidden pairs cost 1e18, with and without a memory limit; infeasible only
with a proof; the time limit kept by the wall clock with toulbar2 killed at the deadline; the
portfolio (toulbar2 beside the neighbourhood search) never worse than, nor missing a plan of,
the neighbourhood search alone at the same time limit, with a busy loop on the machine; without pytoulbar2, today's search. With a time limit the plans
depend on the timing, so these assert properties, not plans."""

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.solver import InfeasiblePlacementError, NoPlanFoundError, StrategyProblem, peak_usage, problem_cost, solve_problem, wcsp
from passes.solver import search as search_module
from passes.solver.families import contest_like, contest_like_planted
from passes.solver.reduce import Reduced
from tests.helpers.random_problems import brute_force, forbidden_as_1e18_problem

pytestmark = pytest.mark.skipif(not wcsp.available(), reason="pytoulbar2 is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_problem(seed, nodes, strategies, edges, forbid, memory):
    """A random problem with forbidden pairs and strategies (one in ten) at the contest files'
    1e18, costs below 30, a memory limit near the least peak half the time (the memory rows
    bind, runs add them lazily); and its raw arrays for the brute force."""
    return forbidden_as_1e18_problem(
        np.random.default_rng(seed), nodes, strategies, edges, forbid, 0.1, memory, limit="near_least", cost_top=30, start_top=5
    )


problems = st.builds(
    random_problem,
    seed=st.integers(0, 2**32 - 1),
    nodes=st.integers(2, 6),
    strategies=st.integers(1, 4),
    edges=st.integers(1, 8),
    forbid=st.sampled_from([0.1, 0.25]),
    memory=st.booleans(),
)


def _unreduced_search(problem):
    """The problem as the search sees it, nothing eliminated (toulbar2 gets every node)."""
    reduced = Reduced(problem)
    reduced.reduce(problem.usage_limit, math.inf, eliminate=False)
    return search_module.Search(reduced, seed=0)


class TestToulbar2Engine:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=problems)
    def test_engine_optimal_or_proves_infeasible_against_brute_force(self, case):
        # Every memory row as a knapsack constraint, every edge as a cost table with
        # forbidden pairs at top: an exhaustive run is the optimum or a proof of none.
        problem, raw = case
        best = brute_force(raw)
        try:
            search = _unreduced_search(problem)
        except InfeasiblePlacementError:  # (the reductions' own proof)
            assert math.isinf(best)
            return
        result = wcsp.solve_wcsp(search, math.inf)
        if math.isinf(best):
            assert result.status == "infeasible" and result.chosen is None
            return
        assert result.status == "optimal"
        search.assign(result.chosen)
        assert search.violation() == 0
        plan = search.plan()
        assert problem_cost(problem, plan) == best
        assert problem.usage_limit is None or peak_usage(problem, plan) <= problem.usage_limit
        assert result.lower <= best

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=problems)
    def test_solve_problem_by_toulbar2_against_brute_force(self, case):
        # Through the core: reductions, memory rows added lazily, plans repaired.
        problem, raw = case
        best = brute_force(raw)
        if math.isinf(best):
            with pytest.raises(InfeasiblePlacementError):
                solve_problem(problem, search="toulbar2", reduce=False)
            return
        solution = solve_problem(problem, search="toulbar2", reduce=False)
        assert problem_cost(problem, solution.strategies) == solution.cost
        assert problem.usage_limit is None or peak_usage(problem, solution.strategies) <= problem.usage_limit
        # (Without a time limit every run is exhaustive: rows are added until the relaxation's
        # optimum fits, or no plan beats the best repaired one.)
        assert solution.lower_bound <= best == solution.cost
        assert solution.stats["status"] == "optimal"

    def test_an_upper_bound_no_plan_beats_proves_that_plan_optimal_not_infeasible(self):
        problem, raw = next(case for seed in range(50) if math.isfinite(brute_force((case := random_problem(seed, 5, 3, 6, 0.2, False))[1])))
        best = brute_force(raw)
        search = _unreduced_search(problem)
        result = wcsp.solve_wcsp(search, math.inf, upper=best)
        assert result.status == "optimal" and result.chosen is None and result.lower == best

    def test_rounded_costs_are_no_proof_but_keep_a_bound(self):
        # Costs with fractions are scaled and rounded: the run is exhaustive on the rounded
        # problem only, so it proves nothing, and its bound is lowered by the rounding.
        problem = StrategyProblem(
            [[0.3, 0.7], [0.1, 0.45], [0.25, 0.5]], [[0, 0]] * 3, [[0, 1]] * 3, [[0, 1], [1, 2]],
            [[[0.0, 1.25], [1.5, 0.0]], [[0.0, 1e18], [2.125, 0.0]]],
        )
        search = _unreduced_search(problem)
        result = wcsp.solve_wcsp(search, math.inf)
        assert result.status == "complete"
        search.assign(result.chosen)
        assert problem_cost(problem, search.plan()) == pytest.approx(0.3 + 0.1 + 0.25 + 0.0 + 0.0)
        assert 0.65 > result.lower >= 0.65 - 1e-9

    def test_a_stopped_run_proves_nothing_and_returns_by_its_deadline(self):
        # Every memory row at once: toulbar2 finds no plan in seconds (a 2000-node problem).
        problem = contest_like(0, 2000, tightness=1.02)
        reduced = Reduced(problem)
        reduced.reduce(problem.usage_limit, math.inf)
        search = search_module.Search(reduced, seed=0)
        began = time.perf_counter()
        result = wcsp.solve_wcsp(search, began + 1.5)
        took = time.perf_counter() - began
        assert took < 1.5 + 0.3, took
        assert result.status == "stopped"
        if result.chosen is not None:  # (what it found by then is a plan of the kept strategies)
            assert len(result.chosen) == len(search.nodes)


    def test_a_run_started_near_its_deadline_returns_by_it(self, monkeypatch):
        # Writing toulbar2's input is not cut at the deadline (0.7 s for 8000 nodes with the
        # machine busy, started 0.6 s before it, the arrays before it 0.2 s, while the answer
        # waited on that thread): a run is not started unless the time left allows it. (Here
        # the arrays made slow, 0.3 s, the write 1 s, and the run given 0.6 s.)
        problem = contest_like(0, 200)
        reduced = Reduced(problem)
        reduced.reduce(problem.usage_limit, math.inf)
        search = search_module.Search(reduced, seed=0)
        data, write = wcsp._data, wcsp._write_input

        def slow_data(*args):
            time.sleep(0.3)
            return data(*args)

        def slow_write(arrays):
            time.sleep(1.0)
            return write(arrays)

        monkeypatch.setattr(wcsp, "_data", slow_data)
        monkeypatch.setattr(wcsp, "_write_input", slow_write)
        began = time.perf_counter()
        result = wcsp.solve_wcsp(search, began + 0.6)
        took = time.perf_counter() - began
        assert took < 0.6 + 0.1, took
        assert result.status == "stopped" and result.chosen is None


class TestPricedRounds:
    def test_a_priced_round_reaches_the_priced_optimum(self):
        # A round of the memory-priced search (``_lagrangian_search``) searches a problem
        # without memory rows: toulbar2 first proves a small one optimal within the round;
        # neighbourhoods alone end above it (on contest instance A, 23k nodes whose priced
        # problems reduce to 6.6k: the plan 1.89x the best team's cost without it, 1.003x with).
        problem, planted = contest_like_planted(0, 1000, tightness=None)
        reduced = Reduced(problem)
        reduced.reduce(None, math.inf)
        proof = search_module.Search(reduced, seed=0)
        result = wcsp.solve_wcsp(proof, math.inf)
        assert result.status == "optimal"
        proof.assign(result.chosen)
        search = search_module.Search(reduced, seed=0)
        search.assign_full(planted)
        start = search.objective()
        search_module._search_priced(search, time.perf_counter() + 4.0, 0, None)
        assert proof.objective() < start
        assert search.objective() == pytest.approx(proof.objective(), rel=1e-9)


class TestPortfolio:
    def test_time_limit_kept_by_the_wall_clock(self):
        # A problem toulbar2 cannot prove in the limit (it is killed at the deadline).
        problem = contest_like(1, 4000, tightness=1.02)
        for search in ("auto", "toulbar2"):
            began = time.perf_counter()
            try:
                solution = solve_problem(problem, time_limit=2.0, search=search)
            except NoPlanFoundError:
                solution = None
            took = time.perf_counter() - began
            assert took <= 2.0 + 1.0, (search, took)
            if solution is not None:
                assert peak_usage(problem, solution.strategies) <= problem.usage_limit
                assert solution.lower_bound <= solution.cost

    @settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 10_000), tightness=st.sampled_from([None, 1.1, 1.02]))
    def test_auto_never_worse_than_the_neighbourhood_search(self, seed, tightness):
        # At a size and limit where both engines get past the heuristics (on 300 nodes at 1.5 s
        # the answers are often the heuristics' plans, and which heuristics run before their
        # time share ends depends on the machine's load: a comparison of noise, now that the
        # portfolio's two engines share the cores).
        problem = contest_like(seed, 150, tightness=tightness)
        try:
            old = solve_problem(problem, time_limit=1.5, search="exact", seed=seed).cost
        except NoPlanFoundError:
            old = math.inf
        new = solve_problem(problem, time_limit=1.5, search="auto", seed=seed)
        assert new.cost <= old
        assert peak_usage(problem, new.strategies) <= (problem.usage_limit or math.inf)

    @staticmethod
    def _engines_on(problem, time_limit, seed):
        """(plan found alone by the neighbourhood search or None, the portfolio's, seconds the
        portfolio took), each with the same time limit."""
        try:
            alone = solve_problem(problem, time_limit=time_limit, search="exact", seed=seed)
        except NoPlanFoundError:
            alone = None
        began = time.perf_counter()
        try:
            both = solve_problem(problem, time_limit=time_limit, search="auto", seed=seed)
        except NoPlanFoundError:
            both = None
        return alone, both, time.perf_counter() - began

    def _check_portfolio(self, problem, alone, both, took, time_limit):
        assert took <= time_limit + max(1.0, 0.02 * time_limit), took
        if alone is not None:
            assert both is not None, "the neighbourhood search alone found a plan, the portfolio none"
            assert both.cost <= alone.cost
        if both is not None:
            assert problem_cost(problem, both.strategies) == both.cost < math.inf
            assert peak_usage(problem, both.strategies) <= (problem.usage_limit or math.inf)
            assert both.lower_bound <= both.cost

    @pytest.mark.parametrize("seed,tightness", [(0, None), (1, 1.1)])
    def test_auto_never_worse_nor_missing_with_the_machine_busy(self, seed, tightness):
        # A busy loop takes one of the cores (the machine loaded, as measured when the portfolio
        # ran its engines one after the other and ended with no plan, or a worse one).
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            problem = contest_like(seed, 100, tightness=tightness)
            alone, both, took = self._engines_on(problem, 2.0, seed)
            try:
                toulbar2 = solve_problem(problem, time_limit=2.0, search="toulbar2", seed=seed)
            except NoPlanFoundError:
                toulbar2 = None
        finally:
            busy.kill()
            busy.wait()
        self._check_portfolio(problem, alone, both, took, 2.0)
        self._check_portfolio(problem, toulbar2, both, took, 2.0)

    def test_without_pytoulbar2_auto_is_the_neighbourhood_search(self, monkeypatch):
        monkeypatch.setattr(wcsp, "_available", False)
        problem = contest_like(2, 200, tightness=1.1)
        solution = solve_problem(problem, time_limit=1.0)
        assert solution.stats["search"] == "exact" and "wcsp_runs" not in solution.stats
        with pytest.raises(ImportError, match="pytoulbar2"):
            solve_problem(problem, time_limit=1.0, search="toulbar2")


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state first, then the parent's
    pid), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _children_running(parent: int, script: str) -> list[int]:
    """The pids of ``parent``'s running children whose command line holds ``script`` (from /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(int(entry))
        if fields is None or int(fields[1]) != parent or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if script in f.read().decode(errors="replace"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
def test_a_toulbar2_run_dies_with_the_solver_that_started_it():
    """A solver killed while toulbar2 runs (SIGKILL: none of its cleanup runs) leaves no worker
    solving on. The run is a pigeonhole problem (13 choices of 12 strategies, no two alike), whose
    proof toulbar2 searches for silently: before, its worker (which holds the GIL and writes
    nothing while it proves) ran on for minutes after a test runner's timeout or a shell's kill."""
    script = (
        f"import math, sys, time; sys.path.insert(0, {ROOT!r})\n"
        "import numpy as np\n"
        "from passes.solver import StrategyProblem, wcsp\n"
        "from passes.solver.reduce import Reduced\n"
        "from passes.solver.search import Search\n"
        "n = 12\n"
        "pairs = [(i, j) for i in range(n + 1) for j in range(i + 1, n + 1)]\n"
        "table = np.where(np.eye(n, dtype=bool), np.inf, 0.0)\n"
        "problem = StrategyProblem([np.zeros(n)] * (n + 1), [np.zeros(n)] * (n + 1), [(0, 1)] * (n + 1), pairs, [table] * len(pairs))\n"
        "reduced = Reduced(problem)\n"
        "reduced.reduce(None, math.inf, eliminate=False)\n"
        "wcsp.solve_wcsp(Search(reduced, seed=0), time.perf_counter() + 300)\n"
    )
    solver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until = time.monotonic() + 120
        workers = []
        while not workers and solver.poll() is None and time.monotonic() < until:
            time.sleep(0.1)
            workers = _children_running(solver.pid, "wcsp_worker.py")
        time.sleep(1.0)  # (past its start: solving)
        assert solver.poll() is None and all(_running(pid) for pid in workers), "the run ended before the solver was killed"
    finally:
        solver.kill()
        solver.wait()
    assert workers, "the solver started no toulbar2 worker"
    until = time.monotonic() + 10
    while any(_running(pid) for pid in workers) and time.monotonic() < until:
        time.sleep(0.1)
    alive = [pid for pid in workers if _running(pid)]
    for pid in alive:  # (not left behind by a failing run)
        os.kill(pid, 9)
    assert not alive, f"toulbar2 workers {alive} outlived their solver"
