"""Real model code nobody here wrote, through every frontend, numbers against the plain model.

HF ``transformers``' ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` (eager and SDPA attention)
and ``torchtitan``'s Llama 3 (SDPA), tiny (2 layers, dim 64, vocab 256, seq 16) and randomly
initialised (``tests/helpers/real_models.py``), used as a user would:

- the layers scanned (``stack_module_state``, ``functional_call`` of one layer as the
  ``hops.scan`` step), run eager, under ``make_fx`` (real and fake), ``torch.export`` and the
  default ``torch.compile`` with the loss inside: loss and every parameter's gradient equal the
  plain model's;
- ``hops.annotate_sharding`` on each layer's output added by forward hooks, through ``make_fx``
  and ``passes.inline_hops``;
- the attention core as a ``hops.local_map`` region (batch and heads sharded on a 2x2 mesh);
- the sharding solver's plan applied and run on one device, and lowered to DTensor and run on
  4 gloo processes;
- HF Qwen3, Mistral (sliding window) and OPT (learned positions, tied head), also with a
  left-padded attention mask and in bfloat16: their layers scanned, traced by ``make_fx`` or
  ``torch.export``, the solver's or the replicated plan, lowered to DTensor and run on the same
  4 gloo processes;
- ``hops.assume_pure`` on one layer.

A library that does not import here (the ``test`` extra installs both; torchtitan needs
``triton`` to import, and a torch recent enough for it) skips its tests, saying why.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops import ShardingSpec, _compat
from tests.helpers import real_models as rm
from tests.helpers.snapshot import aot_trace, hop_nodes

HF = ["hf_llama_eager", "hf_llama_sdpa", "hf_gpt2_eager", "hf_gpt2_sdpa"]
TITAN = ["torchtitan_llama3"]
MODELS = HF + TITAN
ROWS = ShardingSpec(rm.MESH, "S(0)R")  # hidden states [batch, seq, dim]: the batch over "data"
# CI's time budget (this module within ~90 s of one core) runs the costly checks on some models
# only: together they cover both libraries, both HF families and both attention kinds.
# HOPS_REAL_MODELS=all runs every check on every model.
EVERY = os.environ.get("HOPS_REAL_MODELS") == "all"


def some(*names: str) -> list[str]:
    return MODELS if EVERY else list(names)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models are tiny: one intra-op thread runs them faster than several (and CI runs a
    test process per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _built(name: str) -> tuple:
    real = rm.build(name)
    ids, targets = rm.example_ids()
    loss, grads = rm.plain_grads(real, ids, targets)
    real.model.zero_grad(set_to_none=True)
    return real, (ids, targets), (loss, grads)


def build(name: str) -> rm.RealModel:
    """A fresh copy of the model ``name``, or a skip naming the library that does not import
    here. (Each model is built, and its plain loss and gradients computed, once per module.)"""
    module = "torchtitan.models.llama3" if name in TITAN else "transformers"
    try:
        importlib.import_module(module)
    except ImportError as error:
        pytest.skip(f"{module} does not import with torch {torch.__version__} ({error}); the 'test' extra installs it")
    real = _built(name)[0]
    return dataclasses.replace(real, model=copy.deepcopy(real.model))


def assert_same(loss, grads: dict, expected_loss, expected_grads: dict, **tolerance) -> None:
    """Equal loss, and a gradient equal to the reference's for every parameter of the plain
    model (none missing)."""
    torch.testing.assert_close(loss, expected_loss, **tolerance)
    assert set(grads) == set(expected_grads), set(grads) ^ set(expected_grads)
    for name, expected in expected_grads.items():
        assert expected is not None, f"the plain model's {name} has no gradient"
        assert grads[name] is not None, f"no gradient for {name}"
        torch.testing.assert_close(grads[name], expected, msg=lambda m: f"gradient of {name}: {m}", **tolerance)


def reference(real: rm.RealModel):
    """``(ids, targets)`` and the plain model's loss and gradients for them."""
    _, inputs, expected = _built(real.name)
    return inputs, expected


# --------------------------------------------------------------------------- the layers scanned


def scanned_grads(scanned: rm.ScannedDecoder, grads_by_name: dict) -> dict:
    """``grads_by_name`` (keyed by ``scanned``'s parameter names) under the plain names."""
    for name, p in scanned.named_parameters():
        p.grad = grads_by_name[name]
    return scanned.grads_by_plain_name()


@pytest.mark.parametrize("name", MODELS)
def test_scanned_layers_eager(name):
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    scanned = rm.ScannedDecoder(real)
    loss = rm.loss_of(scanned(ids, *rm.layer_tensors(real)), targets)
    loss.backward()
    assert_same(loss.detach(), scanned.grads_by_plain_name(), expected_loss, expected_grads)


def scanned_train_step(scanned: rm.ScannedDecoder):
    def train_step(params, buffers, ids, targets, *tensors):
        logits = torch.func.functional_call(scanned, (params, buffers), (ids, *tensors))
        loss = rm.loss_of(logits, targets)
        return loss, torch.autograd.grad(loss, list(params.values()))

    return train_step


@pytest.mark.parametrize(
    ("name", "mode"), [(name, "fake") for name in MODELS] + [(name, "real") for name in some("torchtitan_llama3")]
)
def test_scanned_layers_make_fx(name, mode):
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    scanned = rm.ScannedDecoder(real)
    params, buffers = dict(scanned.named_parameters()), dict(scanned.named_buffers())
    inputs = (params, buffers, ids, targets, *rm.layer_tensors(real))
    gm = make_fx(scanned_train_step(scanned), tracing_mode=mode)(*inputs)
    # One scan forward, one (reverse) scan backward: the layers are not unrolled.
    assert len([n for n in gm.graph.nodes if n.target is hops.scan_hop]) == 2, gm.code
    loss, grads = gm(*inputs)
    assert_same(loss, scanned_grads(scanned, dict(zip(params, grads))), expected_loss, expected_grads)


class LossOf(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, targets, *tensors):
        return rm.loss_of(self.model(ids, *tensors), targets)


@pytest.mark.parametrize("name", MODELS)
def test_scanned_layers_export(name):
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    scanned = rm.ScannedDecoder(real)
    program = torch.export.export(LossOf(scanned), (ids, targets, *rm.layer_tensors(real)))
    assert len(hop_nodes(program.graph_module, hops.scan_hop)) == 1, program.graph_module.code
    module = program.module()
    loss = module(ids, targets, *rm.layer_tensors(real))
    loss.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in module.named_parameters()}
    assert_same(loss.detach(), scanned_grads(scanned, grads), expected_loss, expected_grads)


@pytest.mark.parametrize("name", some("hf_llama_sdpa"))
def test_scanned_layers_compile(name):
    """The default backend (inductor), the loss inside the compiled function. On torch 2.9
    Dynamo cannot trace a step calling ``functional_call`` (``_compat``): the compile
    graph-breaks at the scan there, and the numbers must still be right."""
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    scanned = rm.ScannedDecoder(real)
    torch._dynamo.reset()
    compiled = torch.compile(LossOf(scanned), fullgraph=_compat.DYNAMO_SPECULATES_FUNCTIONAL_CALL)
    loss = compiled(ids, targets, *rm.layer_tensors(real))
    loss.backward()
    assert_same(loss.detach(), scanned.grads_by_plain_name(), expected_loss, expected_grads, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- annotations by hooks


def annotate_outputs(layers) -> None:
    for layer in layers:
        layer.register_forward_hook(lambda module, args, out: hops.annotate_sharding(out, ROWS))


def plain_train_step(module: torch.nn.Module):
    def train_step(params, buffers, ids, targets):
        loss = rm.loss_of(torch.func.functional_call(module, (params, buffers), (ids,)), targets)
        return loss, torch.autograd.grad(loss, list(params.values()))

    return train_step


def plain_names(grads: dict) -> dict:
    """Gradients keyed by ``rm.Logits``' parameter names, under the plain model's."""
    return {name.removeprefix("model."): grad for name, grad in grads.items()}


@pytest.mark.parametrize(
    ("name", "structure"),
    [(name, "layers") for name in some("hf_llama_eager", "torchtitan_llama3")]
    + [(name, "scanned") for name in some("hf_llama_sdpa", "hf_gpt2_eager")],
)
def test_annotations_added_by_forward_hooks(name, structure):
    """Each layer's output annotated by a forward hook: the annotations are nodes of the
    ``make_fx`` graph (in the scan's body when scanned), ``passes.inline_hops`` removes them and
    the graph computes the plain model's numbers."""
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    if structure == "layers":
        annotate_outputs(real.layers)
        model = rm.Logits(real)
        step = plain_train_step(model)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        inputs = (params, buffers, ids, targets)
    else:
        model = rm.ScannedDecoder(real)
        annotate_outputs([model.template])
        step = scanned_train_step(model)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        inputs = (params, buffers, ids, targets, *rm.layer_tensors(real))
    gm = make_fx(step, tracing_mode="fake")(*inputs)
    annotations = hop_nodes(gm, hops.sharding_annotation_hop)
    assert len(annotations) >= (rm.LAYERS if structure == "layers" else 1), gm.code
    assert all(node.args[-1] == ROWS for node in annotations)
    passes.inline_hops(gm)
    assert not hop_nodes(gm, hops.sharding_annotation_hop)
    loss, grads = gm(*inputs)
    grads = dict(zip(params, grads))
    grads = scanned_grads(model, grads) if structure == "scanned" else plain_names(grads)
    assert_same(loss, grads, expected_loss, expected_grads)


# --------------------------------------------------------------------------- attention as a region


@pytest.mark.parametrize("name", MODELS)
def test_attention_as_a_local_map_region(name):
    """The attention core a ``local_map`` region (each device its batch rows and heads):
    eager, and traced by ``make_fx`` then inlined (one region per layer), the plain model's
    numbers."""
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    region = rm.region_attention(real)
    loss, grads = rm.plain_grads(region, ids, targets)
    assert_same(loss, grads, expected_loss, expected_grads)

    module = rm.Logits(region)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    gm = make_fx(plain_train_step(module), tracing_mode="fake")(params, buffers, ids, targets)
    assert len([n for n in gm.graph.nodes if n.target is hops.local_map_hop]) == 2 * rm.LAYERS, gm.code
    passes.inline_hops(gm)
    assert not hop_nodes(gm, hops.local_map_hop)
    loss, grads = gm(params, buffers, ids, targets)
    assert_same(loss, plain_names(dict(zip(params, grads))), expected_loss, expected_grads)


# --------------------------------------------------------------------------- the solver's plan


def solve_and_apply(graphs) -> None:
    """Solve ``graphs`` on the 2x2 mesh, state the plan as annotations, check and inline them."""
    solution = passes.solve_placements(graphs, rm.MESH, cost_model=passes.CostModel.preset("tpu-v5e"))
    passes.apply_placements(graphs, solution)
    graphs = graphs if isinstance(graphs, tuple) else (graphs,)
    for gm in graphs:
        passes.check_placements(gm)
    assert hop_nodes(graphs[0], hops.sharding_annotation_hop), "the plan states no layout"
    for gm in graphs:
        passes.inline_hops(gm)


@functools.lru_cache(maxsize=None)
def solved_plan(name: str) -> dict:
    """The model's training step (attention a region) traced by ``make_fx`` into one graph of
    flat inputs (parameters, buffers, ids, targets -> loss, each parameter's gradient), solved on
    the 2x2 mesh and the plan applied as annotations; the inputs, their solved placements and
    the parameters' names. Made once per model for the tests below (the graph is copied)."""
    real = build(name)
    (ids, targets), _ = reference(real)
    module = rm.Logits(rm.region_attention(real))
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    step, num_params, num_buffers = plain_train_step(module), len(params), len(buffers)

    def flat_step(*tensors):
        named = dict(zip(params, tensors[:num_params]))
        return step(named, dict(zip(buffers, tensors[num_params : num_params + num_buffers])), *tensors[num_params + num_buffers :])

    inputs = [*params.values(), *buffers.values(), ids, targets]
    gm = make_fx(flat_step, tracing_mode="fake")(*inputs)
    inputs = [t.detach() for t in inputs]
    solution = passes.solve_placements(gm, rm.MESH, cost_model=passes.CostModel.preset("tpu-v5e"))
    passes.apply_placements(gm, solution)
    passes.check_placements(gm)
    assert hop_nodes(gm, hops.sharding_annotation_hop), "the plan states no layout"
    placements = [solution.placements[node.name] for node in gm.graph.find_nodes(op="placeholder")]
    return dict(gm=gm, inputs=inputs, placements=placements, names=[n.removeprefix("model.") for n in params])


@pytest.mark.parametrize("name", some("torchtitan_llama3"))
def test_solver_plan_runs_on_one_device(name):
    """The solved plan (``solved_plan``) inlined and run on one device: the plain model's loss
    and gradients."""
    plan = solved_plan(name)
    _, (expected_loss, expected_grads) = reference(build(name))
    gm = passes.inline_hops(copy.deepcopy(plan["gm"]))
    assert not hop_nodes(gm, hops.sharding_annotation_hop)
    loss, grads = gm(*plan["inputs"])
    assert_same(loss, dict(zip(plan["names"], grads)), expected_loss, expected_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.xla
@pytest.mark.parametrize("name", some("hf_llama_sdpa", "torchtitan_llama3"))
def test_solver_plan_runs_on_xla(name):
    """The solved plan (``solved_plan``, traced on CPU: its attention is CPU flash attention)
    lowered with ``lower_to_xla`` and run by torch_xla on its 4 CPU devices under SPMD: a
    ``Sharding`` custom call in the HLO, and the plain model's loss and gradients."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    plan = solved_plan(name)
    _, (expected_loss, expected_grads) = reference(build(name))
    gm = passes.lower_to_xla(copy.deepcopy(plan["gm"]))
    assert not hop_nodes(gm, hops.sharding_annotation_hop)
    device = torch_xla.device()
    loss, grads = gm(*[t.to(device) for t in plan["inputs"]])
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss, *[g for g in grads if g is not None]])
    assert 'custom_call_target="Sharding"' in hlo
    torch_xla.sync()
    xm.wait_device_ops()
    grads = {n: (None if g is None else g.cpu()) for n, g in zip(plan["names"], grads)}
    assert_same(loss.cpu(), grads, expected_loss, expected_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.xla
@pytest.mark.parametrize("name", some("hf_llama_sdpa", "hf_gpt2_eager"))
def test_exported_scanned_layers_run_on_xla(name):
    """``torch.export`` of the scanned layers (the attention a sharded region), decomposed,
    lowered with ``lower_to_xla`` and run by torch_xla under SPMD: the plain model's loss. The
    decomposed program names the tracing host (``_to_copy`` and export's
    ``_assert_tensor_metadata`` with ``device=cpu``) and reduces with ``sum(x, [])``, which
    torch_xla reads as reducing nothing. Differentiating the lowered program is refused
    (a loop lowered to a While has no autograd rule) rather than missing gradients."""
    import torch_xla

    real = build(name)
    (ids, targets), (expected_loss, _) = reference(real)
    region = rm.region_attention(real)
    tensors = rm.layer_tensors(region)
    module = torch.export.export(LossOf(rm.ScannedDecoder(region)), (ids, targets, *tensors)).run_decompositions().module()
    passes.lower_to_xla(module)
    assert not hop_nodes(module, hops.local_map_hop), "lowered: the region runs as XLA's manual computation"
    device = torch_xla.device()
    module.to(device)
    inputs = (ids.to(device), targets.to(device), *[t.to(device) for t in tensors])
    with pytest.raises(RuntimeError, match="a scan lowered to an XLA While has no autograd rule"):
        module(*inputs)
    with torch.no_grad():
        loss = module(*inputs)
    torch.testing.assert_close(loss.cpu(), expected_loss, rtol=1e-4, atol=1e-5)



def to_device_keeping_ties(module: torch.nn.Module, device) -> None:
    """``module.to(device)`` with its tied parameters still one parameter: moving to XLA makes
    a new parameter per owner (GPT-2's embedding and output head would train apart)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((owner, name))
    module.to(device)
    for tied in owners.values():
        (first, first_name), *rest = tied
        for owner, name in rest:
            setattr(owner, name, getattr(first, first_name))


@pytest.mark.xla
@pytest.mark.parametrize("name", some("hf_gpt2_sdpa"))
def test_scanned_layers_with_a_region_compile_with_hops_xla(name):
    """``torch.compile(backend="hops_xla")`` of the scanned layers, the attention a ``local_map``
    region (SDPA with a causal mask), on XLA tensors: the plain model's loss and gradients. On
    torch 2.9 Dynamo graph-breaks at the scan (``_compat.DYNAMO_SPECULATES_FUNCTIONAL_CALL``):
    the scan runs eagerly on XLA (its joint, which has writes, traced again through
    functionalization with the region's body in it) and the graph after the break takes the
    scan's outputs, which Dynamo fakeifies."""
    import torch_xla

    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    region = rm.region_attention(real)
    tensors = rm.layer_tensors(region)
    scanned = rm.ScannedDecoder(region)
    device = torch_xla.device()
    to_device_keeping_ties(scanned, device)
    torch._dynamo.reset()
    compiled = torch.compile(LossOf(scanned), backend="hops_xla", fullgraph=_compat.DYNAMO_SPECULATES_FUNCTIONAL_CALL)
    loss = compiled(ids.to(device), targets.to(device), *[t.to(device) for t in tensors])
    loss.backward()
    torch_xla.sync()
    grads = {n: None if g is None else g.cpu() for n, g in scanned.grads_by_plain_name().items()}
    assert_same(loss.detach().cpu(), grads, expected_loss, expected_grads, rtol=1e-4, atol=1e-5)

# The solver's plans on 4 gloo processes: one spawn for every model (spawning is the cost).
DTENSOR_MODELS = some("hf_llama_sdpa", "torchtitan_llama3")
# More HF decoders, their layers scanned, through the DTensor target in the same spawn: a case
# is "<model>-<tracer>-<plan>[-<dtype>]" (tracer make_fx of the training step, or torch.export of
# the loss run with loss.backward(); plan the solver's or every input replicated). Each model,
# each tracer, both plans, left padding and bfloat16 at least once, within CI's budget.
SCANNED_DTENSOR_CASES = [
    "hf_qwen3_sdpa_padded-make_fx-solved",
    "hf_opt_eager_padded-make_fx-replicated-bfloat16",
    "hf_mistral_sdpa_padded-export-replicated",  # a sliding window
    "hf_opt_eager-export-replicated",  # a tied head: torch.export.load unties it
]
DTENSOR_TIMEOUT_SECONDS = 300


def importable(name: str) -> bool:
    try:
        importlib.import_module("torchtitan.models.llama3" if name in TITAN else "transformers")
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def dtensor_runs(tmp_path_factory):
    """Each rank's outcome per model (``tests/helpers/real_models_dtensor.py``): 4 processes
    spawned once; while they start, this process makes each model's plan (``solved_plan``) and
    writes it with the plain model's loss and gradients for the ranks to compare with."""
    import torch.distributed as dist

    from tests.helpers import real_models_dtensor
    from tests.helpers.ranks import run_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    names = [name for name in DTENSOR_MODELS + SCANNED_DTENSOR_CASES if importable(name.split("-")[0])]
    if not names:
        pytest.skip("neither transformers nor torchtitan imports here; the 'test' extra installs them")
    outdir = tmp_path_factory.mktemp("real_models_dtensor")

    def make_plans():
        for name in names:

            def make_plan(name=name):
                if name in SCANNED_DTENSOR_CASES:
                    return scanned_dtensor_plan(*name.split("-"))
                _, (loss, grads) = reference(build(name))
                plan = dict(solved_plan(name))
                return dict(plan, loss=loss, grads=[grads[n] for n in plan["names"]])

            real_models_dtensor.write_plan(str(outdir), name, make_plan)

    return run_ranks(real_models_dtensor.__file__, names, outdir, timeout=DTENSOR_TIMEOUT_SECONDS, while_running=make_plans)


@pytest.mark.parametrize("name", DTENSOR_MODELS)
def test_solver_plan_runs_on_four_gloo_processes(dtensor_runs, name):
    """The solved plan (``solved_plan``) lowered by ``passes.lower_to_dtensor`` and run on 4
    gloo processes, its inputs laid out as solved: on every rank, the loss and every
    parameter's gradient (``full_tensor()``) equal the plain model's."""
    build(name)  # skips, saying why, where the model's library does not import
    for rank, run in enumerate(dtensor_runs):
        assert name in run["results"], f"rank {rank} did not finish {name} (exit code {run['code']}):\n{run['log']}"
        assert run["results"][name] is None, f"rank {rank}, {name}:\n{run['results'][name]}"


def stacked_grads(real: rm.RealModel, scanned: rm.ScannedDecoder, grads: dict) -> dict:
    """The plain model's gradients ``grads`` under ``scanned``'s parameter names (a stacked
    parameter's gradient is the layers' gradients stacked)."""
    out = {}
    for name, _ in scanned.named_parameters():
        if name.startswith("stacked_params."):
            key = name.removeprefix("stacked_params.").replace("__", ".")
            out[name] = torch.stack([grads[f"{real.layers_path}.{i}.{key}"] for i in range(rm.LAYERS)])
        else:
            out[name] = grads[name.removeprefix("model.")]
    return out


def scanned_dtensor_plan(name: str, tracer: str, plan: str, dtype: str = "float32") -> dict:
    """What a rank runs of a case of ``SCANNED_DTENSOR_CASES``: the model ``name``'s layers
    scanned (``rm.ScannedDecoder``) in ``dtype``; with ``tracer="make_fx"`` its training step
    (loss and every parameter's gradient) traced into a graph of flat inputs, one scan each way,
    and ``plan="solved"`` the solver's plan on the 2x2 mesh applied (else every input
    replicated); with ``tracer="export"`` the loss exported (``torch.export.save``'s bytes). With
    the plain model's loss and gradients in ``dtype`` to compare with."""
    import io

    real = build(name)
    ids, targets = rm.example_ids()
    if dtype == "float32":
        _, (loss, grads) = reference(real)
    else:  # the plain model in dtype, its layer inputs (rotary tables) recorded again in it
        real = rm.record_layer_inputs(dataclasses.replace(real, model=real.model.to(getattr(torch, dtype))), ids)
        loss, grads = rm.plain_grads(real, ids, targets)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    scanned = rm.ScannedDecoder(real)
    expected = stacked_grads(real, scanned, grads)
    tensors = [t.detach() for t in rm.layer_tensors(real)]
    if tracer == "export":
        program = torch.export.export(LossOf(scanned), (ids, targets, *tensors))
        assert len(hop_nodes(program.graph_module, hops.scan_hop)) == 1, program.graph_module.code
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        ties: dict[str, list[str]] = {}
        first: dict[int, str] = {}
        for n, p in program.module().named_parameters(remove_duplicate=False):
            ties.setdefault(first.setdefault(id(p), n), []).append(n)
        return dict(program=buffer.getvalue(), inputs=[ids, targets, *tensors], loss=loss, tolerance=tolerance,
                    grads={f"model.{n}": g for n, g in expected.items()}, ties=ties)
    params, buffers = dict(scanned.named_parameters()), dict(scanned.named_buffers())
    step, num_params, num_buffers = scanned_train_step(scanned), len(params), len(buffers)

    def flat_step(*flat):
        named = dict(zip(params, flat[:num_params]))
        return step(named, dict(zip(buffers, flat[num_params : num_params + num_buffers])), *flat[num_params + num_buffers :])

    inputs = [*params.values(), *buffers.values(), ids, targets, *tensors]
    gm = make_fx(flat_step, tracing_mode="fake")(*inputs)
    assert len(hop_nodes(gm, hops.scan_hop)) == 2, gm.code
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if plan == "solved":
        solution = passes.solve_placements(gm, rm.MESH, cost_model=passes.CostModel.preset("tpu-v5e"))
        passes.apply_placements(gm, solution)
        passes.check_placements(gm)
        assert hop_nodes(gm, hops.sharding_annotation_hop), "the plan states no layout"
        placements = [solution.placements[node.name] for node in placeholders]
    else:
        placements = [(hops.Replicate(),) * len(rm.MESH.shape)] * len(placeholders)
    return dict(gm=gm, inputs=[t.detach() for t in inputs], placements=placements, names=list(params),
                loss=loss, grads=list(expected.values()), tolerance=tolerance)


@pytest.mark.parametrize("case", SCANNED_DTENSOR_CASES)
def test_scanned_layers_run_on_four_gloo_processes(dtensor_runs, case):
    """``SCANNED_DTENSOR_CASES`` (``scanned_dtensor_plan``): Qwen3, Mistral and OPT, their layers
    scanned, traced (``make_fx`` / ``torch.export``), planned (solver / replicated), lowered by
    ``passes.lower_to_dtensor`` and run on 4 gloo processes: on every rank the loss and every
    parameter's gradient equal the plain model's."""
    build(case.split("-")[0])  # skips, saying why, where the model's library does not import
    for rank, run in enumerate(dtensor_runs):
        assert case in run["results"], f"rank {rank} did not finish {case} (exit code {run['code']}):\n{run['log']}"
        assert run["results"][case] is None, f"rank {rank}, {case}:\n{run['results'][case]}"


@pytest.mark.parametrize("name", some("hf_gpt2_eager"))
def test_solver_plan_of_the_scanned_layers_runs_on_one_device(name):
    """As ``examples/auto_shard.py``: the layers scanned, the attention a region, AOTAutograd's
    forward and backward graphs solved together (the scan body once), the plan applied,
    inlined and run on one device: the plain model's loss and gradients."""
    real = build(name)
    (ids, targets), (expected_loss, expected_grads) = reference(real)
    region = rm.region_attention(real)
    model = rm.ScannedDecoder(region)
    names = [n for n, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())

    def loss_fn(ids, targets, *args):
        params = dict(zip(names, args[: len(names)]))
        logits = torch.func.functional_call(model, (params, buffers), (ids, *args[len(names) :]))
        return rm.loss_of(logits, targets)

    leaves = [p.detach().requires_grad_() for _, p in model.named_parameters()]
    inputs = [ids, targets, *leaves, *rm.layer_tensors(region)]
    forward, backward, _ = aot_trace(loss_fn, *inputs)
    solve_and_apply((forward, backward))
    loss, *saved = forward(*(t.detach() for t in inputs))
    grads = backward(*saved, torch.ones(()))
    grads = scanned_grads(model, dict(zip(names, grads[2 : 2 + len(names)])))
    assert_same(loss, grads, expected_loss, expected_grads, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- assume_pure


@pytest.mark.parametrize("name", MODELS)
def test_assume_pure_on_one_layer(name):
    """The first layer traced once (``hops.assume_pure``): loss and gradients equal the plain
    model's, and again from the cached graphs after the parameters change."""
    real = build(name)
    ids, targets = rm.example_ids()
    pure = build(name)
    wrapped = hops.assume_pure(pure.layers[0])
    pure.replace_layer(0, wrapped)
    names = [n for n, _ in real.model.named_parameters()]
    for _ in range(2):
        expected_loss, expected_grads = rm.plain_grads(real, ids, targets)
        loss, grads = rm.plain_grads(pure, ids, targets)
        assert_same(loss, dict(zip(names, grads.values())), expected_loss, expected_grads)
        with torch.no_grad():  # an optimizer step on both: the cached graph must read the new values
            for a, b in zip(real.model.parameters(), pure.model.parameters()):
                a.mul_(0.9)
                b.mul_(0.9)
    info = wrapped.cache_info()
    assert info.traces == 1 and info.hits >= 1, info
