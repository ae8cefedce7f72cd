"""The ``torch.compile`` backends of this package that need no lowering target.

``backend="hops_inductor"``: inductor (the default backend), which receives the HOP nodes
and lowers each itself (``hops/_inductor.py``: a scan is one loop), under a name that says
the program runs on a single device. Backends are found by name through the
``torch_dynamo_backends`` entry point group (``setup.cfg``): ``import passes`` is not needed
to use them. The XLA backend ``hops_xla`` belongs to the XLA target: ``passes/xla/backend.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

__all__ = ["hops_inductor"]


def hops_inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The Dynamo backend ``"hops_inductor"``: inductor, which receives the HOP nodes and
    lowers each itself; the same as the default backend, named."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
