"""``torch.export.save`` / ``torch.export.load`` of programs holding each HOP: the specs come
back as the same typed values, the bodies intact, and the loaded program runs and lowers
like the one saved."""

from __future__ import annotations

import io

import pytest
import torch
import torch.fx as fx
from hop_db import SAMPLES, Module
from snapshot import readable

import hops
import passes
from hops.specs import _FxLiteral


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
