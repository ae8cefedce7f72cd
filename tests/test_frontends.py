"""Every HOP sample (``hop_db``) through every frontend: the HOP stays one node with typed
spec arguments, the recorded program computes the reference on new inputs, and every pass
gives the same code with all meta deleted. Graph snapshots live with each sample."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import hops
import passes
from hops._body_hop.subgraph import strip_detach
from tests.helpers.hop_db import SAMPLES, Module, Sample
from tests.helpers.snapshot import TestCase, aot_trace, compile_trace, delete_meta, hop_nodes, readable


def operations(gm: fx.GraphModule) -> list:
    """``gm``'s nodes and those of its subgraphs as (op, target, args), nodes by position."""
    result = []
    for name, module in sorted(gm.named_modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        position = {node: i for i, node in enumerate(module.graph.nodes)}

        def arg(value):
            if isinstance(value, fx.Node):
                return ("node", position[value])
            return value

        for node in module.graph.nodes:
            target = node.target if node.op != "get_attr" else "<attribute>"
            result.append((name, node.op, str(target), pytree.tree_map(arg, (node.args, node.kwargs))))
    return result


def detached(values):
    return tuple(v.detach() for v in values)


def reference_grads(sample: type[Sample], inputs):
    outputs = sample.reference(*inputs)
    loss = sum(o.sum() for o in pytree.tree_leaves(outputs))
    return outputs, torch.autograd.grad(loss, inputs)

def trace(frontend: str, sample: type[Sample]) -> dict[str, fx.GraphModule]:
    """The graphs ``frontend`` records for ``sample``, checked against the reference on new inputs."""
    inputs, fresh = sample.inputs(0), sample.inputs(1)
    if frontend.startswith("make_fx"):
        mode = frontend.removeprefix("make_fx_")
        program = sample.program
        if mode == "functionalized":
            program, mode = torch.func.functionalize(program), "fake"
        gm = make_fx(program, tracing_mode=mode)(*detached(inputs))
        torch.testing.assert_close(gm(*detached(fresh)), sample.reference(*detached(fresh)))
        return {"graph": gm}
    if frontend == "aot":
        forward, backward, outputs = aot_trace(sample.program, *inputs)
        expected, expected_grads = reference_grads(sample, fresh)
        forward_again, backward_again, outputs = aot_trace(sample.program, *fresh)
        torch.testing.assert_close(outputs, expected)
        torch.testing.assert_close(tuple(t.grad for t in fresh), expected_grads)
        return {"forward": forward, "backward": backward}
    if frontend.startswith("export"):
        program = torch.export.export(Module(sample.program), detached(inputs), strict=frontend == "export_strict")
        torch.testing.assert_close(program.module()(*detached(fresh)), sample.reference(*detached(fresh)))
        return {"graph": program.graph_module}
    if frontend == "dynamo":
        graphs, outputs = compile_trace(sample.program, *fresh)
        expected, expected_grads = reference_grads(sample, sample.inputs(1))
        torch.testing.assert_close(outputs, expected)
        torch.testing.assert_close(tuple(t.grad for t in fresh), expected_grads)
        return graphs
    raise ValueError(frontend)


FRONTENDS = [
    "make_fx_real",
    "make_fx_fake",
    "make_fx_symbolic",
    "make_fx_functionalized",
    "aot",
    "export_strict",
    "export_non_strict",
    "dynamo",
]


class TestFrontends(TestCase):
    """``test_<sample>_<frontend>``: one node with typed specs, and the reference's numbers."""

    def check_frontend(self, sample, frontend):
        graphs = trace(frontend, sample)
        nodes = [node for gm in graphs.values() for node in hop_nodes(gm, sample.hop)]
        self.assertTrue(nodes, f"{sample.name}: no {sample.hop.__name__} node in the {frontend} graphs")
        for node in nodes:
            spec = node.args[-1]
            self.assertTrue(hasattr(spec, "__fx_create_arg__"), f"{node.format_node()} has no typed spec")
            self.assertEqual(spec, eval(repr(spec), {"hops": hops}))
        snapshot = getattr(sample, f"snapshot_{frontend}", None)
        if snapshot is not None:
            snapshot(self, "".join(readable(strip_detach(gm)) for gm in graphs.values()))


class TestGraphsAsData(TestCase):
    """Recorded graphs are data: passes read node args only (``test_<sample>_<frontend>_meta_free``)
    and graphs round-trip through pickle and deepcopy with the same code."""

    def check_meta_free(self, sample, frontend):
        for gm in trace(frontend, sample).values():
            for run in (passes.inline_hops, passes.lower_to_xla, passes.unroll_scan, passes.check_placements):
                with_meta, without_meta = copy.deepcopy(gm), copy.deepcopy(gm)
                delete_meta(without_meta)
                outcomes = []
                for graph in (with_meta, without_meta):
                    try:
                        run(graph)
                        outcomes.append({n: m.code for n, m in graph.named_modules() if isinstance(m, fx.GraphModule)})
                    except passes.PassError as error:
                        outcomes.append(str(error))
                self.assertEqual(outcomes[0], outcomes[1])

    def check_round_trip(self, sample, frontend):
        for gm in trace(frontend, sample).values():
            # Unpickling re-traces the code, which renames nodes after their targets: the
            # operations and their arguments are what must come back.
            for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
                self.assertEqual(operations(clone), operations(gm))


def _add_tests() -> None:
    for sample in SAMPLES:
        for frontend in FRONTENDS:
            setattr(
                TestFrontends,
                f"test_{sample.name}_{frontend}",
                lambda self, sample=sample, frontend=frontend: self.check_frontend(sample, frontend),
            )
        for frontend in ("make_fx_fake", "aot", "dynamo"):
            setattr(
                TestGraphsAsData,
                f"test_{sample.name}_{frontend}_meta_free",
                lambda self, sample=sample, frontend=frontend: self.check_meta_free(sample, frontend),
            )
        for frontend in ("make_fx_fake", "aot"):
            setattr(
                TestGraphsAsData,
                f"test_{sample.name}_{frontend}_round_trip",
                lambda self, sample=sample, frontend=frontend: self.check_round_trip(sample, frontend),
            )


_add_tests()


# --------------------------------------------------------------------------- grad modes

GRAD_MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
}


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_every_sample_runs_under_each_grad_mode(sample, mode):
    # Serving code runs models under torch.inference_mode(), whose tensors have no version
    # counter; inputs made there are inference tensors too.
    inputs = detached(sample.inputs(0))
    with GRAD_MODES[mode]():
        got = sample.program(*inputs)
        made_inside = detached(sample.inputs(1))
        got_inside = sample.program(*made_inside)
    torch.testing.assert_close(got, sample.reference(*inputs))
    torch.testing.assert_close(got_inside, sample.reference(*made_inside))


def test_a_body_writing_into_its_input_is_refused_under_inference_mode():
    def step(c, x):
        c.add_(x)
        return c, x

    with torch.inference_mode(), pytest.raises(ValueError, match="writes into"):
        hops.scan(step, torch.zeros(3), torch.ones(4, 3))


# --------------------------------------------------------------------------- the package's HOPs


def package_hops() -> dict[str, object]:
    """Every HOP object a module of the ``hops`` package defines, by its registered name."""
    import importlib
    import pkgutil

    from torch._ops import HigherOrderOperator

    found = {}
    for module_info in pkgutil.iter_modules(hops.__path__):
        module = importlib.import_module(f"hops.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, HigherOrderOperator):
                found[value.__name__] = value
    return found


def test_every_hop_of_the_package_is_public_and_has_a_sample():
    found = package_hops()
    assert "hops_scan" in found and "hops_kernel_einsum_linear" in found  # the walk sees the modules
    public = {id(getattr(hops, name)) for name in hops.__all__}
    assert sorted(name for name, hop in found.items() if id(hop) not in public) == []
    sampled = {id(sample.hop) for sample in SAMPLES}
    # Kernels of user code (the sample's scaled_cube) are not the package's.
    assert sorted(name for name, hop in found.items() if id(hop) not in sampled) == []
