"""``torch.export.save`` / ``torch.export.load`` of programs holding each HOP: the specs come
back as the same typed values, the bodies intact, and the loaded program runs and lowers
like the one saved."""

from __future__ import annotations

import io

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hops
import passes
from hops.specs import _FxLiteral
from tests.helpers.hop_db import SAMPLES, Module
from tests.helpers.snapshot import readable


def detached(values):
    return tuple(v.detach() for v in values)


def round_trip(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def hop_calls(gm: fx.GraphModule) -> list[tuple[str, str, list]]:
    """Every HOP node of ``gm`` and its subgraphs: (module, target, spec arguments)."""
    calls = []
    for name, module in sorted(gm.named_modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                calls.append((name, str(node.target), [a for a in node.args if isinstance(a, _FxLiteral)]))
    return calls


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_save_load_round_trip(sample):
    inputs, fresh = sample.inputs(0), sample.inputs(1)
    program = torch.export.export(Module(sample.program), detached(inputs))
    loaded = round_trip(program)
    saved_calls, loaded_calls = hop_calls(program.graph_module), hop_calls(loaded.graph_module)
    assert [c[1] for c in loaded_calls] == [c[1] for c in saved_calls] and saved_calls
    for (_, _, saved_specs), (_, target, loaded_specs) in zip(saved_calls, loaded_calls):
        assert saved_specs, target
        assert loaded_specs == saved_specs, target
        assert [type(s) for s in loaded_specs] == [type(s) for s in saved_specs]
    # Bodies intact: each subgraph computes the same ops.
    saved_ops = [str(n.target) for m in program.graph_module.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.op == "call_function"]
    loaded_ops = [str(n.target) for m in loaded.graph_module.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.op == "call_function"]
    assert sorted(loaded_ops) == sorted(saved_ops)
    torch.testing.assert_close(loaded.module()(*detached(fresh)), sample.reference(*detached(fresh)))


def test_loaded_program_inlines_like_the_saved_one():
    sample = next(s for s in SAMPLES if s.hop is hops.scan_hop)
    inputs = sample.inputs(0)
    program = torch.export.export(Module(sample.program), detached(inputs))
    loaded = round_trip(program)
    saved_gm = passes.inline_hops(program.module())
    loaded_gm = passes.inline_hops(loaded.module())
    assert readable(loaded_gm) == readable(saved_gm)


@pytest.mark.xla
def test_loaded_program_lowers_to_the_same_hlo():
    import torch_xla

    sample = next(s for s in SAMPLES if s.hop is hops.sharding_annotation_hop)
    inputs = sample.inputs(0)
    program = torch.export.export(Module(sample.program), detached(inputs))
    loaded = round_trip(program)
    device = torch_xla.device()
    hlos = []
    for exported in (program, loaded):
        gm = passes.lower_to_xla(exported.module())
        out = gm(*(t.detach().to(device) for t in inputs))
        hlos.append(torch_xla._XLAC._get_xla_tensors_hlo([out]))
        torch_xla.sync()
    assert 'custom_call_target="Sharding"' in hlos[0]
    assert hlos[1] == hlos[0]


# --------------------------------------------------------------------------- bodies holding HOPs
#
# A body is traced into a subgraph; a tensor it makes from Python values (``torch.tensor``)
# is an operand of its HOP, lifted level by level, so export lifts it as a constant of the
# program (its serializer refuses a tensor held by a subgraph).

MESH = hops.Mesh.of(data=2, model=2)
ROWS = hops.ShardingSpec(MESH, "S(0)R")
ROW_PLACEMENTS = (hops.Shard(0), hops.Replicate())


@hops.kernel(abstract=lambda x, *, scale: torch.empty_like(x), backward=lambda x, out, grad, *, scale: (grad * scale,))
def export_scaled(x, *, scale=1.0):
    return x * scale


def _sine(x):
    return torch.sin(x) * torch.tensor(1.5)


def _tripled(local):
    return local * torch.tensor([3.0, 1.0, -1.0, 0.5])


def _plus(c, v):
    return c + v * torch.tensor(0.25), None


INNER = {
    "annotation": lambda x: hops.annotate_sharding(x * 2, ROWS),
    "local_map": lambda x: hops.local_map(_tripled, out_placements=ROW_PLACEMENTS, in_placements=(ROW_PLACEMENTS,), device_mesh=MESH)(x),
    "kernel": lambda x: export_scaled(x, scale=0.5),
    "named_scope": lambda x: hops.named_scope("inner")(_sine)(x),
    "einsum": lambda x: hops.einsum("ij,kj->ik", x, x) * 0.1,
    "scan": lambda x: hops.scan(_plus, x, torch.stack([x, x * 2]))[0],
}


def _nested(outer: str, inner: str, constant_outside: bool):
    """A program whose ``outer`` body HOP's body calls the ``inner`` HOP (each body making a
    constant tensor when ``constant_outside``)."""

    def body(v):
        v = INNER[inner](v + (torch.tensor([1.0, -2.0, 0.5, 3.0]) if constant_outside else 0))
        return torch.tanh(v)

    def program(x):
        if outer == "scan":
            return hops.scan(lambda c, v: (body(c + v), c.sum()), x, torch.stack([x, -x, x * 0.5]))
        if outer == "local_map":
            return hops.local_map(body, out_placements=ROW_PLACEMENTS, in_placements=(ROW_PLACEMENTS,), device_mesh=MESH)(x)
        return hops.named_scope("outer")(body)(x)

    return program


def _every_hop_step(c, x, w):
    c = hops.annotate_sharding(c @ w + x * torch.tensor(0.5), ROWS)
    c = hops.local_map(_tripled, out_placements=ROW_PLACEMENTS, in_placements=(ROW_PLACEMENTS,), device_mesh=MESH)(c)
    c = hops.named_scope("block")(_sine)(export_scaled(c, scale=0.5))
    c = hops.einsum("ij,jk->ik", c, w) + torch.tensor([1.0, 2.0, 3.0, 4.0])
    c = hops.scan(_plus, c, torch.stack([c, -c]))[0]
    return c, c.sum()


class EveryHopScan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, h, xs):
        return hops.scan(_every_hop_step, h, xs, additional_inputs=(self.w,))


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_a_scan_whose_body_holds_every_hop_round_trips(strict):
    torch.manual_seed(0)
    model, h, xs = EveryHopScan(), torch.randn(4, 4), torch.randn(3, 4, 4)
    program = torch.export.export(model, (h, xs), strict=strict)
    loaded = round_trip(program)
    expected = hop_calls(program.graph_module)
    assert sorted({target for _, target, _ in expected}) == [
        "hops_kernel_einsum", "hops_kernel_export_scaled", "hops_local_map", "hops_named_scope", "hops_scan", "hops_sharding_annotation"
    ]
    assert hop_calls(loaded.graph_module) == expected
    # The constants the bodies made are constants of the program, not tensors in subgraphs.
    for module in loaded.graph_module.modules():
        if isinstance(module, fx.GraphModule):
            assert not any(isinstance(getattr(module, n.target), torch.Tensor) for n in module.graph.find_nodes(op="get_attr"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(h, xs), model(h, xs))
        h2, xs2 = torch.randn(4, 4), torch.randn(3, 4, 4)
        torch.testing.assert_close(loaded.module()(h2, xs2), model(h2, xs2))


# A strict export traces with Dynamo (seconds an example): a new draw each run.
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    outer=st.sampled_from(["scan", "local_map", "named_scope"]),
    inner=st.sampled_from(sorted(INNER)),
    constant_outside=st.booleans(),
    strict=st.booleans(),
)
def test_each_hop_nested_in_each_body_hop_round_trips(outer, inner, constant_outside, strict):
    if outer == "local_map" and inner == "einsum":
        inner = "kernel"  # the local shard is not square
    program = _nested(outer, inner, constant_outside)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(len(outer) + len(inner)))
    exported = torch.export.export(Module(program), (x,), strict=strict)
    loaded = round_trip(exported)
    assert [t for _, t, _ in hop_calls(loaded.graph_module)] == [t for _, t, _ in hop_calls(exported.graph_module)]
    torch.testing.assert_close(loaded.module()(x), program(x))
    torch.testing.assert_close(loaded.module()(x * 2), program(x * 2))


# --------------------------------------------------------------------------- several HOPs in one body, at depth 2
#
# A scan step holding several HOPs, one of them a body HOP (a named scope or a replicated
# region) holding several more: exported, lowered by the package's passes on the program's
# ``module()`` (as a user compares targets), saved, loaded and run. ``module()`` shares the
# program's bodies, so a pass that rewrote them in place broke the saved program (a node the
# rewrite made had no ``meta["val"]``: ``SpecViolationError`` in ``torch.export.save``).

REPLICATED = (hops.Replicate(), hops.Replicate())

LEAVES = {
    "annotation": lambda v, w, b: hops.annotate_sharding(v * 2, ROWS),
    "kernel": lambda v, w, b: export_scaled(v, scale=0.5),
    "einsum": lambda v, w, b: hops.einsum("ij,jk->ik", v, w),
    "einsum_linear": lambda v, w, b: hops.einsum_linear(v, w, b),
    "local_map": lambda v, w, b: hops.local_map(_tripled, out_placements=REPLICATED, in_placements=(REPLICATED,), device_mesh=MESH)(v),
    "named_scope": lambda v, w, b: hops.named_scope("leaf")(_sine)(v),
}


def _chain(leaves):
    def run(v, w, b):
        for leaf in leaves:
            v = torch.tanh(LEAVES[leaf](v, w, b))
        return v

    return run


def _container(kind, leaves):
    """A body HOP (``kind``) whose body runs ``leaves`` in order, ``w`` and ``b`` its operands."""
    body = _chain(leaves)
    if kind == "named_scope":
        return lambda v, w, b: hops.named_scope("block")(body)(v, w, b)
    placements = (REPLICATED, REPLICATED, (hops.Replicate(),) * 2)
    return lambda v, w, b: hops.local_map(body, out_placements=REPLICATED, in_placements=placements, device_mesh=MESH)(v, w, b)


def _depth_two_program(before, kind, inside, after):
    """``scan`` whose step runs the HOPs ``before``, a ``kind`` body HOP running ``inside``, then ``after``."""
    inner = _container(kind, inside)

    def step(c, x, w, b):
        v = _chain(before)(c + x, w, b)
        v = torch.tanh(inner(v, w, b))
        v = _chain(after)(v, w, b)
        return v, v.sum()

    def program(h, xs, w, b):
        return hops.scan(step, h, xs, additional_inputs=(w, b))

    return program


class _ValueChecker(fx.Interpreter):
    """Runs a graph, checking each call's result against the node's ``meta["val"]``."""

    def run_node(self, node):
        result = super().run_node(node)
        if node.op == "call_function":
            assert "val" in node.meta, f"{node.format_node()} has no meta['val']"
            for value, recorded in zip(torch.utils._pytree.tree_leaves(result), torch.utils._pytree.tree_leaves(node.meta["val"]), strict=True):
                if isinstance(value, torch.Tensor):
                    assert (tuple(recorded.shape), recorded.dtype) == (tuple(value.shape), value.dtype), node.format_node()
        return result


def _checking_vals(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every graph in it run by ``_ValueChecker``."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.forward = lambda *args, module=module: _ValueChecker(module).run(*args)
    return gm


LEAF_NAMES = sorted(LEAVES)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    order=st.permutations(LEAF_NAMES),
    cuts=st.tuples(st.integers(0, len(LEAF_NAMES)), st.integers(0, len(LEAF_NAMES))),
    kind=st.sampled_from(["named_scope", "local_map"]),
    strict=st.booleans(),
)
def test_several_hops_at_depth_two_lower_save_load_and_run(order, cuts, kind, strict):
    first, second = sorted(cuts)
    inside = [leaf for leaf in order[first:second] if not (kind == "local_map" and leaf == "local_map")] or ["kernel"]
    program = _depth_two_program(order[:first], kind, inside, order[second:])
    g = torch.Generator().manual_seed(first * 7 + second)
    h, xs, w, b = torch.randn(4, 4, generator=g), torch.randn(3, 4, 4, generator=g), torch.randn(4, 4, generator=g) * 0.5, torch.randn(4, generator=g)
    exported = torch.export.export(Module(program), (h, xs, w, b), strict=strict)
    saved = exported.graph_module.print_readable(print_output=False)
    lowered = _checking_vals(passes.inline_hops(exported.module()))
    # The pass rewrote its own copy of the bodies, not the program's.
    assert exported.graph_module.print_readable(print_output=False) == saved
    loaded = round_trip(exported)
    assert [t for _, t, _ in hop_calls(loaded.graph_module)] == [t for _, t, _ in hop_calls(exported.graph_module)]
    h2, xs2 = torch.randn(4, 4, generator=g), torch.randn(3, 4, 4, generator=g)
    for args in ((h, xs, w, b), (h2, xs2, w, b)):
        expected = program(*args)
        torch.testing.assert_close(loaded.module()(*args), expected)
        torch.testing.assert_close(lowered(*args), expected)
    # The same of the loaded program: lowered, then saved again.
    lowered_loaded = passes.inline_hops(loaded.module())
    again = round_trip(loaded)
    for args in ((h, xs, w, b), (h2, xs2, w, b)):
        expected = program(*args)
        torch.testing.assert_close(lowered_loaded(*args), expected)
        torch.testing.assert_close(again.module()(*args), expected)


@pytest.mark.parametrize("lower", ["inline_hops", "unroll_scan"])
def test_a_pass_on_the_programs_module_leaves_the_program_as_exported(lower):
    # Every pass rewrites its own copy of the bodies, and gives the nodes it makes values.
    torch.manual_seed(0)
    model, h, xs = EveryHopScan(), torch.randn(4, 4), torch.randn(3, 4, 4)
    program = torch.export.export(model, (h, xs))
    saved = program.graph_module.print_readable(print_output=False)
    lowered = _checking_vals(getattr(passes, lower)(program.module()))
    assert program.graph_module.print_readable(print_output=False) == saved
    loaded = round_trip(program)
    with torch.no_grad():
        expected = model(h, xs)
        torch.testing.assert_close(lowered(h, xs), expected)
        torch.testing.assert_close(loaded.module()(h, xs), expected)


# --------------------------------------------------------------------------- a fresh process
#
# ``import hops`` registers a namespace with torch's serializer and replaces none of its
# methods; the ones ``_compat.EXPORT_PATCHES`` names are wrapped only once a program holding a
# HOP is exported, or loaded. A process that imported the package and traced nothing loads
# programs holding every HOP (a region with alternatives too, its tuple of bodies), runs them,
# and saves them again.

FRESH_LOAD = """
import io, sys, torch
import torch._export.serde.serialize as serialize
before = functions()
import hops
from tests.helpers.hop_db import SAMPLES  # defines the samples' kernels, as a user's module does
from hops._compat import EXPORT_PATCHES
assert changed(before, functions()) == [], changed(before, functions())
assert "hops" in serialize._deserialization_registry
for path in sys.argv[1:]:
    loaded = torch.export.load(path + ".pt2")
    inputs, expected, specs = torch.load(path + ".io", weights_only=False)
    torch.testing.assert_close(loaded.module()(*inputs), expected)
    got = [(type(a).__name__, repr(a)) for m in loaded.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
           for n in m.graph.nodes if n.op == "call_function" for a in n.args if isinstance(a, hops.specs._FxLiteral)]
    assert got == specs, (path, got, specs)
    buffer = io.BytesIO()
    torch.export.save(loaded, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.export.load(buffer).module()(*inputs), expected)
assert changed(before, functions()) == sorted(EXPORT_PATCHES), changed(before, functions())
"""


def _specs_of(gm):
    return [
        (type(a).__name__, repr(a))
        for m in gm.modules()
        if isinstance(m, fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
        for a in n.args
        if isinstance(a, _FxLiteral)
    ]


def test_a_process_that_only_imported_hops_loads_runs_and_saves_programs_holding_every_hop(tmp_path):
    from tests.test_inductor_pass_chaining import subprocess_check

    line = hops.Mesh.of(model=4)
    alternatives = hops.local_map(
        lambda x, w: x @ w,
        mesh=line,
        in_placements=((hops.Shard(0),), (hops.Replicate(),)),
        out_placements=((hops.Shard(0),),),
        alternatives=[hops.RegionPlacements("R, S(1)", "S(1)")],
    )
    programs = [(s.name, Module(s.program), detached(s.inputs(0))) for s in SAMPLES]
    programs.append(("alternatives", Module(alternatives), (torch.randn(8, 6), torch.randn(6, 12))))
    paths = []
    for name, module, inputs in programs:
        exported = torch.export.export(module, inputs)
        path = str(tmp_path / name)
        torch.export.save(exported, path + ".pt2")
        torch.save((inputs, exported.module()(*inputs), _specs_of(exported.graph_module)), path + ".io")
        paths.append(path)
    assert any(isinstance(n.args[0], tuple) for n in exported.graph_module.graph.nodes if n.target is hops.local_map_hop)
    subprocess_check(FRESH_LOAD, *paths)


EXPORTS_LAZILY = """
import torch
import torch._export.serde.serialize as serialize
before = functions()
import hops
from hops._compat import COMPILE_PATCHES, EXPORT_PATCHES
assert changed(before, functions()) == [], changed(before, functions())
def program(x):
    y = hops.annotate_sharding(x * 2, hops.ShardingSpec(hops.Mesh.of(data=2), "S(0)"))
    last, ys = hops.scan(lambda c, row: (c + row, c * row), y[0], y)
    return ys + last
x = torch.randn(4, 3)
# Inductor lowers the graph (not read from a warm cache), so the compile's own patches
# (COMPILE_PATCHES, installed when Dynamo first traces a scan and inductor first lowers a
# graph) are there on every run.
torch._inductor.config.force_disable_caches = True
torch.compile(program, fullgraph=True)(x)
torch.func.grad(lambda x: program(x).sum())(x)
assert changed(before, functions()) == sorted(COMPILE_PATCHES), changed(before, functions())
class M(torch.nn.Module):
    def forward(self, x):
        return program(x)
torch.export.export(M(), (x,))
assert changed(before, functions()) == sorted(COMPILE_PATCHES + EXPORT_PATCHES), changed(before, functions())
"""


def test_the_serializer_is_wrapped_by_the_first_export_not_by_import_or_compile():
    from tests.test_inductor_pass_chaining import subprocess_check

    subprocess_check(EXPORTS_LAZILY)
