"""Every tracer keeps the HOPs; inductor receives them and lowers them itself.

- Tracers that borrow inductor's decomposition table (autoparallel's joint tracer,
  ``make_fx``/AOTAutograd/``torch.export`` given ``select_decomp_table()``) record the same
  HOP nodes as with no table.
- The default ``torch.compile`` backend receives the HOP nodes in its forward and backward
  graphs, and the package's post-grad pass (``hops/_inductor.py``) replaces each by what it
  computes: forward and backward equal the eager program and the plain-torch reference, and
  the graphs inductor lowers hold no HOP (a kernel as its opaque ``hops_kernels`` op, a scan
  as one ``while_loop`` whose size does not grow with the length).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

import hops
from hops import Mesh, Replicate, Shard
from tests.helpers.hop_db import SAMPLES, forward_backward, fresh
from tests.helpers.samples_together import (
    assert_close_apart,
    combined,
    forward_backward_apart,
    outputs_and_grads_apart,
    together,
    together_inputs,
)


def hop_targets(graphs):
    """The package HOPs called in ``graphs`` and in every subgraph they hold, with counts."""
    counts = {}
    for gm in graphs:
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    target = node.target
                    if isinstance(target, torch._ops.HigherOrderOperator) and target.__name__.startswith("hops_"):
                        counts[target.__name__] = counts.get(target.__name__, 0) + 1
    return counts


def targets(graphs):
    return {
        str(node.target)
        for gm in graphs
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    }


def inductor_table():
    """A copy of inductor's decomposition table, as autoparallel's tracer builds it."""
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


class _GraphsKept(Exception):
    """Raised after inductor's post-grad passes when the tests need the graphs, not the code."""


def _kept_graphs_only(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, _GraphsKept):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__
    return False


@contextlib.contextmanager
def inductor_graphs(codegen: bool = True):
    """Compile with inductor and caches off; yields (received, lowered): the graphs inductor
    receives (after AOTAutograd) and the graphs it lowers (after its post-grad passes).
    ``codegen=False`` stops each compile once its graph is lowered (the kernels' code and its
    C++ compile are most of a compile's time) and runs the graph inductor received instead."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    received, lowered, compiled = [], [], []

    class Keep(CustomGraphPass):
        def __call__(self, graph):
            # Inductor also runs its post-grad passes on each subgraph: keep the graphs it
            # was given.
            if any(graph.owning_module is gm for gm in compiled):
                lowered.append(copy.deepcopy(graph.owning_module))
                if not codegen:
                    raise _GraphsKept

        def uuid(self):
            return None

    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        received.append(copy.deepcopy(gm))
        compiled.append(gm)
        if codegen:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as error:
            if not _kept_graphs_only(error):
                raise
        else:
            raise AssertionError("inductor lowered no graph of this compile")
        return make_boxed_func(copy.deepcopy(received[-1]).forward)

    # No FX-graph or AOTAutograd cache: a hit would skip the passes that keep the graphs. The
    # compiled kernels may still be reused: they are what these tests do not look at.
    with config.patch(post_grad_custom_post_pass=Keep(), fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ):

        def backend(gm, example_inputs):
            return compile_fx(gm, example_inputs, inner_compile=inner)

        yield backend, received, lowered


# --------------------------------------------------------------------------- inductor


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_inductor_receives_the_hops_and_lowers_them_itself(sample):
    # The values of inductor's code: the cache test below.
    torch._dynamo.reset()
    with inductor_graphs(codegen=False) as (backend, received, lowered):
        compiled = torch.compile(sample.program, backend=backend, fullgraph=True)
        forward_backward(compiled, fresh(sample.inputs()))
    assert len(received) == len(lowered) == 2  # forward and backward
    assert hop_targets(received), targets(received)  # the nodes reach inductor
    assert not hop_targets(lowered), targets(lowered)  # and none reaches its lowering
    after = targets(lowered)
    if sample.hop is hops.einsum or getattr(sample.hop, "kernel_name", "").startswith("einsum"):
        assert not [t for t in after if "hops_kernels" in t], after  # einsum is plain torch
    elif isinstance(sample.hop, hops.Kernel):
        assert f"hops_kernels.{sample.hop.kernel_name}.default" in after, after
    if sample.hop is hops.scan_hop:
        assert "while_loop" in after, after


def scan_program(length, unroll=1, width=4, reverse=False):
    """A scan of ``length`` residual tanh layers of ``width`` (seeded inputs) and its inputs."""

    def layer(h, w):
        return h + torch.tanh(h @ w), h.sum(-1)

    def program(h, ws):
        return hops.scan(layer, h, ws, unroll=unroll, reverse=reverse)

    g = torch.Generator().manual_seed(length)
    h = torch.randn(3, width, generator=g, requires_grad=True)
    ws = (torch.randn(length, width, width, generator=g) / width).requires_grad_()
    return program, (h, ws)


def lowered_graphs(length, unroll=1, width=4, reverse=False, backward=True, codegen=True):
    """The graphs inductor lowers for ``scan_program`` (forward, and backward unless
    ``backward=False``: AOTAutograd compiles it at the first backward), after checking the
    compiled values (and gradients) against eager (``codegen=False``: the graphs only, see
    ``inductor_graphs``)."""
    program, inputs = scan_program(length, unroll, width, reverse)
    torch._dynamo.reset()
    with inductor_graphs(codegen) as (backend, received, lowered):
        compiled = torch.compile(program, backend=backend, fullgraph=True)
        if backward:
            got, got_grads = forward_backward(compiled, fresh(inputs))
        else:
            got = compiled(*fresh(inputs))
    if backward:
        expected, expected_grads = forward_backward(program, fresh(inputs))
        torch.testing.assert_close(got_grads, expected_grads, atol=1e-5, rtol=1e-4)
    else:
        expected = program(*fresh(inputs))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    return lowered


def graph_size(gm):
    return sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def test_a_scan_is_one_loop_whatever_its_length():
    # The forward and backward graphs inductor lowers have the same size for 2 and 9 steps:
    # the step is in the loop's body once, and by default an iteration runs one step. (The
    # values of inductor's loops: the next test.)
    short, long = lowered_graphs(2, unroll=None, codegen=False), lowered_graphs(9, unroll=None, codegen=False)
    assert [graph_size(gm) for gm in short] == [graph_size(gm) for gm in long]
    assert steps_per_iteration(long[0]) == {9: 1}


def steps_per_iteration(gm):
    """How many steps of ``scan_program``'s layer each while_loop body of ``gm`` runs (its
    ``mm`` nodes; the layer has one), by the scan's length (the first dim of the stacked
    weights the body reads; bodies without an ``mm`` left out)."""
    steps = {}
    for loop in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.while_loop):
        body = getattr(gm, str(loop.args[1].target))
        mms = [n for n in body.graph.nodes if n.target is torch.ops.aten.mm.default]
        if mms:
            width = mms[0].meta["val"].shape[-1]
            (length,) = {
                p.meta["val"].shape[0]
                for p in body.graph.find_nodes(op="placeholder")
                if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].shape[1:] == (width, width)
            }
            assert length not in steps, (length, steps)
            steps[length] = len(mms)
    return steps


# (length, unroll, reverse), each length its own.
LENGTHS = {
    "empty": (0, None, False),
    "remainder-reverse": (5, 2, True),
    "remainder": (7, 3, False),
    "unroll-past-the-end-reverse": (3, 5, True),
}


def several_carries_program():
    """A reverse scan of two carries and two xs whose ys are a dict, and its inputs."""

    def step(carry, x):
        a, b = carry
        u, v = x
        a = torch.tanh(a * u + b)
        b = b + v.sum()
        return (a, b), {"a": a * 2, "v": v}

    def program(a, b, us, vs):
        return hops.scan(step, (a, b), (us, vs), reverse=True)

    g = torch.Generator().manual_seed(1)
    shapes = [(3,), (3,), (5, 3), (5, 2)]
    return program, tuple(torch.randn(shape, generator=g, requires_grad=True) for shape in shapes)


@functools.cache
def scans_compiled_together():
    """The scans of ``LENGTHS`` and ``several_carries_program`` in one program, compiled by
    inductor (its code run, forward and backward): for each, the compiled and the eager
    (outputs, inputs' gradients); and the forward graph inductor lowers. One compile for the
    tests of this section: inductor lowers each scan node by itself."""
    cases = {case: scan_program(length, unroll, reverse=reverse) for case, (length, unroll, reverse) in LENGTHS.items()}
    cases["several-carries"] = several_carries_program()
    counts = [len(inputs) for _, inputs in cases.values()]
    program = combined([one for one, _ in cases.values()], counts)
    inputs = [t for _, case_inputs in cases.values() for t in case_inputs]

    def apart(fn):
        return outputs_and_grads_apart(fn, inputs, list(cases), counts)

    torch._dynamo.reset()
    with inductor_graphs() as (backend, received, lowered):
        got = apart(torch.compile(program, backend=backend, fullgraph=True))
    assert len(lowered) == 2  # forward and backward
    return got, apart(program), lowered[0]


def assert_case_matches_eager(case, **tolerances):
    got, expected, _ = scans_compiled_together()
    torch.testing.assert_close(got[case], expected[case], **tolerances)


@pytest.mark.parametrize("case", LENGTHS)
def test_any_length_unroll_and_direction_gives_eager_values(case):
    # Values and gradients equal eager whether the steps divide into iterations or leave a
    # remainder after the loop, forward or reverse; an iteration runs the steps asked for
    # where the length has them, each step with its own mm (the steps are in the body, the
    # body is one graph).
    length, unroll, _ = LENGTHS[case]
    assert_case_matches_eager(case, atol=1e-5, rtol=1e-4)
    if length >= (unroll or 1) and length > 0:
        assert steps_per_iteration(scans_compiled_together()[2])[length] == (unroll or 1)


def test_one_compile_serves_every_length_with_dynamic_shapes():
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(h, x, w):
        h = torch.tanh(h @ w + x)
        return h, h.sum(-1)

    def program(h, xs, w):
        return hops.scan(step, h, xs, additional_inputs=(w,))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(program, backend=counter, dynamic=True, fullgraph=True)
    for length, batch in [(4, 2), (6, 3)]:
        inputs = [torch.randn(batch, 3, requires_grad=True), torch.randn(length, batch, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)]
        got, got_grads = forward_backward(compiled, fresh(inputs))
        expected, expected_grads = forward_backward(program, fresh(inputs))
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(got_grads, expected_grads)
    assert counter.frame_count == 1


def test_compiled_reverse_scan_with_several_carries_and_xs():
    # Compiled in one program with the scans above (inductor, its code run).
    assert_case_matches_eager("several-carries")


def test_a_named_scope_names_the_nodes_inductor_lowers():
    @hops.named_scope("attention")
    def scores(q, k):
        return torch.softmax(q @ k.t(), -1)

    # The names of the graphs inductor lowers: no code needed.
    torch._dynamo.reset()
    with inductor_graphs(codegen=False) as (backend, received, lowered):
        compiled = torch.compile(scores, backend=backend, fullgraph=True)
        forward_backward(compiled, [torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)])
    names = [node.name for gm in lowered for node in gm.graph.nodes if node.op == "call_function"]
    assert names and all(name.startswith("attention") for name in names), names


def test_every_hop_of_the_package_has_an_inductor_rule():
    # Iterates torch's HOP registry (every kernel defined so far included), not a list.
    from hops import _inductor

    package_hops = [
        hop for name, hop in torch._ops._higher_order_ops.items() if name.startswith("hops_") and type(hop).__module__.startswith("hops.")
    ]
    assert len(package_hops) >= 6
    assert [hop.__name__ for hop in package_hops if _inductor.inductor_rule(hop) is None] == []
    assert all(hop.cacheable() for hop in package_hops)


# --------------------------------------------------------------------------- other tracers


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_make_fx_with_inductor_decompositions_keeps_every_hop(sample):
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = sample.inputs()
    plain = make_fx(sample.program, tracing_mode="fake")(*fresh(inputs))
    decomposed = make_fx(sample.program, inductor_table(), tracing_mode="fake")(*fresh(inputs))
    assert hop_targets([plain])
    assert hop_targets([decomposed]) == hop_targets([plain])


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_aot_autograd_with_inductor_decompositions_keeps_every_hop(sample):
    from functorch.compile import aot_function, make_boxed_func

    def traced(decompositions):
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm)

        fn = aot_function(sample.program, fw_compiler=keep, bw_compiler=keep, decompositions=decompositions)
        forward_backward(fn, fresh(sample.inputs()))
        assert len(graphs) == 2
        return [hop_targets([g]) for g in graphs]

    plain = traced(None)
    assert plain[0], plain  # the forward holds the HOP (a backward may be plain ops: a kernel's)
    assert traced(inductor_table()) == plain


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_export_with_inductor_decompositions_keeps_every_hop(sample):
    from tests.helpers.hop_db import Module

    exported = torch.export.export(Module(sample.program), tuple(t.detach() for t in sample.inputs()))
    plain = hop_targets([exported.graph_module])
    decomposed = hop_targets([exported.run_decompositions(inductor_table()).graph_module])
    assert plain and decomposed == plain


class Annotated(torch.nn.Module):
    """Two annotations around a scan of annotated steps: what autoparallel traces."""

    def __init__(self):
        super().__init__()
        self.mesh = Mesh((2, 2), ("data", "model"))
        self.w = torch.nn.Parameter(torch.randn(4, 4) / 2)
        self.rows = hops.ShardingSpec(self.mesh, (Shard(0), Replicate()))

    def step(self, h, x):
        h = hops.annotate_sharding(torch.tanh(h @ self.w + x), self.rows)
        return h, None

    def forward(self, h, xs):
        h = hops.annotate_sharding(h, self.rows)
        h, _ = hops.scan(self.step, h, xs)
        return hops.annotate_sharding(h * 2, self.rows).sum()


def joint_hops(decompositions):
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    model = Annotated()
    args = (torch.randn(4, 4), torch.randn(2, 4, 4))
    exported = torch.export.export(model, args, strict=True)
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, exported.module(), args, decompositions=decompositions)
        return hop_targets([joint.graph_module])


def test_autoparallels_recipe_keeps_every_hop():
    # autoparallel: torch.export (strict), then aot_export_joint_with_descriptors with a
    # copy of inductor's table: the joint graph holds the annotations and the scans
    # (forward and backward) as with no table.
    plain = joint_hops(None)
    assert plain.get("hops_scan") == 2 and plain.get("hops_sharding_annotation", 0) >= 4, plain
    assert joint_hops(inductor_table()) == plain


# --------------------------------------------------------------------------- models


class Block(torch.nn.Module):
    """A residual MLP block whose layers run through hops.scan over stacked weights, with a
    local_map region and an annotation: what a user hands to torch.compile(model)."""

    def __init__(self, layers=3, width=8):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(layers, width, width) / width**0.5)
        self.mesh = Mesh((2, 2), ("data", "model"))
        self.norm = hops.local_map(
            lambda x: x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(),
            mesh=self.mesh,
            in_placements=((Shard(0), Replicate()),),
            out_placements=((Shard(0), Replicate()),),
        )

    def layer(self, h, w):
        h = h + torch.tanh(hops.einsum("bi,io->bo", self.norm(h), w))
        return hops.annotate_sharding(h, hops.ShardingSpec(self.mesh, (Shard(0), Replicate()))), h.sum()

    def forward(self, x):
        h, sums = hops.scan(self.layer, x, self.weights)
        return h, sums


def test_compiled_model_trains_like_eager():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8)
    compiled = torch.compile(model)
    got = forward_backward(compiled, [x])[0]
    got_grad = model.weights.grad.clone()
    model.weights.grad = None
    expected = forward_backward(model, [x])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grad, model.weights.grad, atol=1e-5, rtol=1e-4)


def test_compiled_step_inside_eager_scan():
    w = torch.randn(3, 3)

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sin()

    torch._dynamo.reset()
    xs = torch.randn(5, 3, requires_grad=True)
    got_c, got_ys = hops.scan(torch.compile(step), torch.ones(3), xs)
    expected_c, expected_ys = torch.ones(3), []
    for x in xs:
        expected_c, y = step(expected_c, x)
        expected_ys.append(y)
    expected_ys = torch.stack(expected_ys)
    torch.testing.assert_close(got_c, expected_c)
    torch.testing.assert_close(got_ys, expected_ys)
    (got_grad,) = torch.autograd.grad(got_ys.sum(), xs)
    (expected_grad,) = torch.autograd.grad(expected_ys.sum(), xs)
    torch.testing.assert_close(got_grad, expected_grad)


# --------------------------------------------------------------------------- caches


def compile_counting(program, inputs, backward=True, apart=False):
    """Compile ``program`` (default backend) in a fresh Dynamo state, run forward (and
    backward); AOTAutograd's and inductor's cache counters of that compile, and the results
    (``apart``: ``program`` is every sample's, its results read per sample)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(program, fullgraph=True)
    if apart:
        results = forward_backward_apart(compiled, inputs)
    else:
        results = forward_backward(compiled, fresh(inputs)) if backward else compiled(*fresh(inputs))
    aot, inductor = dict(counters["aot_autograd"]), dict(counters["inductor"])
    return (
        {
            "aot": "hit" if aot.get("autograd_cache_hit") else "bypass" if aot.get("autograd_cache_bypass") else "miss",
            "fx": "hit" if inductor.get("fxgraph_cache_hit") else "bypass" if inductor.get("fxgraph_cache_bypass") else "miss",
        },
        results,
    )


@pytest.fixture
def fresh_caches():
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), config.patch(force_disable_caches=False, fx_graph_cache=True):
        with torch._functorch.config.patch(enable_autograd_cache=True):
            yield


def test_default_backend_matches_eager_and_a_second_identical_compile_hits_both_caches(fresh_caches):
    # Every sample in one program (one forward and one backward graph: a sample's HOP that
    # made the graph uncacheable or its key unstable would make it bypass or miss). The first
    # compile (the default backend, both caches missing) and the second (both hitting: the
    # cached code) give eager's and the plain-torch reference's values and gradients, sample
    # by sample.
    inputs = together_inputs(seed=3)
    first, compiled_first = compile_counting(together(), inputs, apart=True)
    second, compiled_second = compile_counting(together(), inputs, apart=True)
    assert first == {"aot": "miss", "fx": "miss"}, first
    assert second == {"aot": "hit", "fx": "hit"}, second
    eager = forward_backward_apart(together(), inputs)
    reference = forward_backward_apart(together(attribute="reference"), inputs)
    for got in (compiled_first, compiled_second):
        for expected in (eager, reference):
            assert_close_apart(got, expected, atol=1e-5, rtol=1e-4)


MESH = Mesh((2, 2), ("data", "model"))


ROWS = (Shard(0), Replicate())


def annotated_scan(dim=0, reverse=False, unroll=1, activation=torch.tanh, region=ROWS):
    spec = hops.ShardingSpec(MESH, (Shard(dim), Replicate()))
    norm = hops.local_map(lambda h: h * 2, mesh=MESH, in_placements=(region,), out_placements=(region,))

    def step(h, x):
        h = hops.annotate_sharding(activation(norm(h) + x), spec)
        return h, h.sum()

    def program(h, xs):
        return hops.scan(step, h, xs, reverse=reverse, unroll=unroll)

    return program


CHANGES = {
    "spec": {"dim": 1},  # one annotation: S(0) -> S(1)
    "placement": {"region": (Shard(0), Shard(1))},  # one placement of a region
    "reverse": {"reverse": True},  # one scan option (the others enter the key the same way)
    "body": {"activation": torch.sin},  # the body's code
}


def test_a_program_differing_in_one_spec_or_body_misses(fresh_caches):
    inputs = (torch.randn(4, 4, requires_grad=True), torch.randn(3, 4, 4, requires_grad=True))
    compile_counting(annotated_scan(), inputs)
    assert compile_counting(annotated_scan(), inputs)[0] == {"aot": "hit", "fx": "hit"}
    for what, change in CHANGES.items():
        # The cache is looked up when the forward compiles: the forward's values show whether
        # what ran is the changed program (a wrong hit would run the first one's code).
        changed, got = compile_counting(annotated_scan(**change), inputs, backward=False)
        assert changed["aot"] == "miss", (what, changed)
        expected = annotated_scan(**change)(*fresh(inputs))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=what)


@pytest.mark.parametrize("active", [0, 1])
def test_inductor_runs_the_active_alternative_of_a_region(active):
    # A region offering row- and column-parallel placements holds one body per alternative
    # (other local shapes); inductor compiles the active one.
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    line = Mesh.of(model=4)
    region = hops.local_map(
        lambda x, w: x @ w,
        mesh=line,
        in_placements=((Shard(0),), (Replicate(),)),
        out_placements=((Shard(0),),),
        alternatives=[hops.RegionPlacements("R, S(1)", "S(1)")],
    )
    x, w = torch.randn(8, 6), torch.randn(6, 12)
    gm = make_fx(region, tracing_mode="fake")(x, w)
    (node,) = [n for n in gm.graph.nodes if n.target is hops.local_map_hop]
    node.args = (*node.args[:-1], node.args[-1].choose(active))
    gm.recompile()
    with inductor_graphs() as (_, received, lowered):
        result = compile_fx(gm, [x, w])(x, w)
    torch.testing.assert_close(result[0] if isinstance(result, (tuple, list)) else result, x @ w)
