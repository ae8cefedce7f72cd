"""What the default ``torch.compile`` backend (inductor) receives for each HOP.

Inductor lowers ATen ops only. Its AOTAutograd trace consults inductor's decomposition
table, and each HOP's proxy rule asks the trace's table for the HOP before recording a node
(``_compat.proxy_decomposition``), as it would for any op. Registered here, for inductor
alone (make_fx, AOTAutograd, export and the ``aot_eager`` backend keep the HOP nodes):

- an annotation: the value (a copy inductor fuses away);
- ``named_scope``: the body inlined;
- ``local_map``: its eager semantics per device: the inputs sliced, the body once per
  device, the outputs reassembled (the SPMD program on one device);
- ``scan``: its eager semantics, a loop unrolled into the trace (inductor has no loop of
  its own on every supported torch version; a long scan compiles in time linear in its
  length);
- a kernel: its ``torch.library`` op (``Kernel.op``), which inductor calls as an opaque
  fallback; the einsum kernels: ``torch.einsum``, which inductor optimizes.

Each runs below autograd (the forward and backward HOP calls of the traced joint each
decompose), so inductor compiles the same forward and backward the HOP nodes describe.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hops import _compat

_INSTALLED: set[Any] = set()


def _bodied(hop: Any) -> Callable:
    def decompose(body: Callable, *args: Any) -> Any:
        operands, spec = hop.split_args(args)
        return hop.run(body, operands, spec)

    return decompose


def _annotation(x: torch.Tensor, spec: Any) -> torch.Tensor:
    return x.clone()


def _kernel(kernel_hop: Any) -> Callable:
    def decompose(*tensors_and_params: Any) -> Any:
        *tensors, params = tensors_and_params
        if getattr(kernel_hop, "hops_transparent", False):
            # Plain torch ops inductor knows (einsum): let it see and fuse them.
            return kernel_hop.implementation(*tensors, **params.as_dict())
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with disable_proxy_modes_tracing():
            single = isinstance(kernel_hop.abstract_rule(*tensors, **params.as_dict()), torch.Tensor)
        result = kernel_hop.op(list(tensors), repr(params))
        return result[0] if single else tuple(result)

    return decompose


def install(hop: Any) -> None:
    """Register ``hop``'s decomposition into inductor's table (once)."""
    if hop in _INSTALLED:
        return
    from hops.kernel import Kernel
    from hops.sharding_annotation import sharding_annotation_hop

    if isinstance(hop, Kernel):
        decomposition = _kernel(hop)
    elif hop is sharding_annotation_hop:
        decomposition = _annotation
    else:
        decomposition = _bodied(hop)
    _compat.register_inductor_decomposition(hop, decomposition)
    _INSTALLED.add(hop)
