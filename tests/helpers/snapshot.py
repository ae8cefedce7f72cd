"""Snapshot helpers: graph text that holds on every supported torch version, and a TestCase."""

from __future__ import annotations

import re

import expecttest
import torch
import torch.fx as fx

from hops._body_hop.subgraph import strip_detach  # noqa: F401  (re-exported for tests)

# Comments differ between torch versions (stack traces, 2.15's backward provenance).
_DROP = re.compile(r"^\s*(#|# No stacktrace found.*|# File: .*|# Annotation: .*|# Backward of forward node: .*)$")
# The codegen frees each value after its last use (";  a = b = None"): noise for a reader.
_FREES = re.compile(r";  (\w+ = )+None$")


def normalize(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = _FREES.sub("", line.rstrip())
        if not line.strip() or _DROP.match(line):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def readable(gm: fx.GraphModule) -> str:
    """``gm.print_readable`` without stack traces, blank lines, trailing spaces or the
    statements that free values after their last use."""
    return normalize(gm.print_readable(print_output=False))


def hop_nodes(gm: fx.GraphModule, hop) -> list[fx.Node]:
    """The nodes calling ``hop`` in ``gm`` and in every subgraph it holds."""
    return [
        node
        for module in gm.modules()
        if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and node.target is hop
    ]


def delete_meta(gm: fx.GraphModule) -> None:
    """Delete every ``node.meta`` and ``gm.meta`` in ``gm`` and its subgraphs."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.meta.clear()
            for node in module.graph.nodes:
                node.meta.clear()


class TestCase(expecttest.TestCase):
    """``expecttest.TestCase`` whose ``assertEqual`` compares tensors (and pytrees of them)."""

    def assertEqual(self, actual, expected, msg=None):  # noqa: N802  (unittest's name)
        import torch.utils._pytree as pytree

        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((actual, expected))):
            torch.testing.assert_close(actual, expected, msg=msg)
        else:
            super().assertEqual(actual, expected, msg)



def aot_trace(fn, *args):
    """AOTAutograd's forward and backward graphs of ``fn`` and its outputs, after one
    backward of the sum of every output."""
    import torch.utils._pytree as pytree
    from functorch.compile import aot_function, make_boxed_func

    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    outputs = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(*args)
    sum(o.sum() for o in pytree.tree_leaves(outputs)).backward()
    return graphs["forward"], graphs["backward"], outputs


def compile_trace(fn, *args):
    """The graphs ``torch.compile(fn, fullgraph=True)`` produces ("dynamo", "forward",
    "backward") and its outputs, after one backward of the sum of every output."""
    import torch.utils._pytree as pytree
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compile_graph(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compile_graph

    def backend(gm, example_inputs):
        graphs["dynamo"] = gm
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))(gm, example_inputs)

    outputs = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    sum(o.sum() for o in pytree.tree_leaves(outputs)).backward()
    return graphs, outputs


# --------------------------------------------------------------------------- XLA (torch_xla imported on use)


def device():
    """The XLA device (SPMD's one virtual device)."""
    import torch_xla

    return torch_xla.device()


def hlo_text(*tensors):
    """The HLO torch_xla would compile for ``tensors`` (pending computations), as text."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def sharding_of(t):
    """The sharding torch_xla records on ``t`` ("" when none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)
