"""The earlier home of the ``torch.compile`` backends, kept so that its import paths keep
working (``from passes.xla.dynamo import hops_xla``, and ``torch_dynamo_backends`` entry
points installed from an earlier version name ``passes.xla.dynamo:hops_xla``).

The backends live where their names say: ``hops_xla`` in ``passes/xla/backend.py``,
``hops_inductor`` (no XLA in it) in ``passes/backends.py``.
"""

from passes.backends import hops_inductor
from passes.xla.backend import StagedGraph, hops_xla, lowered_and_staged, prepare_autograd_for_xla

__all__ = ["hops_xla", "hops_inductor", "lowered_and_staged", "prepare_autograd_for_xla", "StagedGraph"]
