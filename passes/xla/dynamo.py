"""``torch.compile(model, backend="hops_xla")``: Dynamo (HOPs kept) -> AOTAutograd (forward
and backward graphs with the HOPs) -> ``check_placements`` -> ``lower_to_xla`` -> the lowered
graphs run on the caller's XLA tensors (no copies: XLA tensors in, XLA tensors out).

They run as lazy tensor programs: torch_xla traces each call on the host and compiles each
distinct graph once (its cache is keyed by the graph's hash). They are not replayed through
torch_xla's Dynamo bridge (``extract_compiled_graph``, what ``backend="openxla"`` uses):
under SPMD, torch_xla 2.9's bridge returns wrong values once an input's sharding changes
between calls (measured here: a plain two-layer model trained with ``backend="openxla"``
under SPMD departs from eager at the third SGD step; without SPMD it does not).

``hops_inductor``: every HOP inlined, then inductor (the default backend). Both backends are
found by name through the ``torch_dynamo_backends`` entry point group: ``import passes`` is
not needed to use them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

__all__ = ["hops_xla", "hops_inductor"]


def _lowered_to_xla(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    from functorch.compile import make_boxed_func

    from passes.check import check_placements
    from passes.xla import lower_to_xla

    return make_boxed_func(lower_to_xla(check_placements(gm)))


def hops_xla(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The Dynamo backend ``"hops_xla"`` (see the module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_lowered_to_xla)(gm, example_inputs)


def hops_inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The Dynamo backend ``"hops_inductor"``: inductor, whose own trace receives each HOP as
    what it computes (``hops/_inductor.py``); the same as the default backend, under a name
    that says the HOPs are inlined for a single device."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
