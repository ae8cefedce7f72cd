"""ATen ops whose meaning a graph holds but torch_xla does not give, rewritten into ops it runs as torch does.

- Ops only the device a graph was traced on runs: ``torch.nn.functional.scaled_dot_product_attention``
  on CPU records ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), which torch_xla
  has no kernel for (the process aborts). Each is given a function of ordinary ops with the same
  outputs, the backward one computed from the saved ``logsumexp`` as the CPU kernel does.
- Reductions given an empty ``dim`` list (decompositions write ``sum(x, [])``): torch reduces over
  every dim, torch_xla 2.9 over none (a loss of shape ``[32]`` instead of a scalar). A node with
  an empty list gets every dim of its input, counted when it runs.
- Ops torch_xla has no kernel for, which it runs by copying their inputs to the host
  (``native_layer_norm_backward``, in every LayerNorm model's backward): in a computation staged
  once (a scan's ``While`` body, a ``hops_xla`` graph) the inputs are placeholders with no data,
  and reading one aborts the process. Each such op with a decomposition in torch's table runs
  as that decomposition (``falls_back_to_host``; asked of the dispatcher, so torch_xla's own
  list decides).
Tables keyed by the op, like the target's rules.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

aten = torch.ops.aten


def _query_heads(t, query):
    """``t`` (a key or value) with one head per query head: with fewer heads (grouped-query
    attention, which the CPU kernel takes as it is), query head ``h`` reads head ``h // group``."""
    heads = query.shape[-3]
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _fold_heads(grad, like):
    """A gradient taken per query head, summed back onto ``like``'s heads (``_query_heads``'s adjoint)."""
    heads = like.shape[-3]
    return grad if grad.shape[-3] == heads else grad.unflatten(-3, (heads, -1)).sum(-3)


def _scores(query, key, is_causal, attn_mask, scale):
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        length, source = scores.shape[-2:]
        keep = torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:  # the CPU kernel takes only a mask of the query's dtype: added
        scores = scores + attn_mask
    return scores, scale


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            "lower_to_xla: CPU flash attention with dropout_p > 0 has no portable form (its mask is "
            "drawn by the CPU kernel); trace the model with dropout off, or on the target device"
        )


def _kernel_strides(query, key, value, is_causal, attn_mask, scale) -> tuple[int, ...]:
    """The strides the CPU kernel gives its output for these shapes, from its meta rule: the
    graph's later views were traced on that layout (it differs between torch versions)."""

    def meta(t):
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")

    output, _ = aten._scaled_dot_product_flash_attention_for_cpu(
        meta(query), meta(key), meta(value), 0.0, is_causal, attn_mask=meta(attn_mask), scale=scale
    )
    return output.stride()


def flash_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu``: ``(output, logsumexp)``, the output laid
    out as the CPU kernel lays it out."""
    _check_no_dropout(dropout_p)
    scores, _ = _scores(query, _query_heads(key, query), is_causal, attn_mask, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    output = torch.matmul(torch.exp(scores - logsumexp.unsqueeze(-1)), _query_heads(value, query))
    strides = _kernel_strides(query, key, value, is_causal, attn_mask, scale)
    if output.stride() != strides:
        output = torch.empty_strided(output.shape, strides, dtype=output.dtype, device=output.device).copy_(output)
    return output, logsumexp


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu_backward``: ``(grad_query, grad_key,
    grad_value)`` from the probabilities recomputed with the saved ``logsumexp``."""
    _check_no_dropout(dropout_p)
    keys, values = _query_heads(key, query), _query_heads(value, query)
    scores, scale = _scores(query, keys, is_causal, attn_mask, scale)
    probabilities = torch.exp(scores - logsumexp.unsqueeze(-1))
    grad_value = torch.matmul(probabilities.transpose(-2, -1), grad_out)
    grad_probabilities = torch.matmul(grad_out, values.transpose(-2, -1))
    row = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - row)
    grad_query = torch.matmul(grad_scores, keys) * scale
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query) * scale
    return grad_query, _fold_heads(grad_key, key), _fold_heads(grad_value, value)


PORTABLE: dict[Any, Callable[..., Any]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_attention_backward,
}


# Reductions torch_xla 2.9 runs over no dim when given ``dim=[]``, where torch reduces over
# every dim (each measured against the CPU on torch_xla 2.9; ``any.dims`` / ``all.dims`` agree).
REDUCE_EVERY_DIM_WHEN_EMPTY = frozenset(
    {
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.amax.default,
        aten.amin.default,
        aten.var.correction,
        aten.std.correction,
        aten.var_mean.correction,
        aten.std_mean.correction,
        aten.linalg_vector_norm.default,
    }
)


@functools.cache
def every_dim(op: Any) -> Callable[..., Any]:
    """``op`` with its ``dim`` argument replaced by every dim of its input (``[]``'s meaning in torch)."""
    position = [argument.name for argument in op._schema.arguments].index("dim")

    def reduce_every_dim(*args: Any, **kwargs: Any) -> Any:
        dims = list(range(args[0].dim()))
        if "dim" in kwargs:
            kwargs["dim"] = dims
        else:
            args = (*args[:position], dims, *args[position + 1 :])
        return op(*args, **kwargs)

    reduce_every_dim.__name__ = f"{op.__name__.replace('.', '_')}_every_dim"
    return reduce_every_dim


def _empty_dims(node: fx.Node) -> bool:
    arguments = node.target._schema.arguments
    position = [argument.name for argument in arguments].index("dim")
    if "dim" in node.kwargs:
        dim = node.kwargs["dim"]
    elif position < len(node.args):
        dim = node.args[position]
    else:  # not written: the schema's default (``amax``'s is ``[]``)
        dim = arguments[position].default_value if arguments[position].has_default_value() else None
    return isinstance(dim, (list, tuple)) and len(dim) == 0


# Dispatch keys whose kernel runs an op on XLA tensors without torch_xla's copy to the host.
_DEVICE_KEYS = ("XLA", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")


@functools.cache
def falls_back_to_host(op: Any) -> bool:
    """Whether torch_xla runs ``op`` by copying its inputs to the host: an ATen op with no
    kernel for XLA tensors. False where torch_xla is not loaded (its kernels are unknown)."""
    if not isinstance(op, torch._ops.OpOverload) or "torch_xla" not in sys.modules:
        return False
    return not any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) for key in _DEVICE_KEYS)


@functools.cache
def device_decomposition(op: Any) -> Callable[..., Any] | None:
    """torch's decomposition of ``op`` when torch_xla would run ``op`` on the host, else None."""
    from torch._decomp import decomposition_table

    if not falls_back_to_host(op):
        return None
    decomposition = decomposition_table.get(op)
    if decomposition is None:
        return None

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        return decomposition(*args, **kwargs)

    decomposed.__name__ = f"{op.__name__.replace('.', '_')}_decomposed"
    return decomposed


class HostOnlyOpError(NotImplementedError):
    """An op torch_xla runs only by copying its inputs to the host, with no decomposition in
    torch's table, in a computation staged once (a scan's ``While`` body, a ``hops_xla``
    graph), where its inputs have no data: refused before staging (the copy aborts the process)."""


def refuse_host_only_ops(gm: fx.GraphModule, where: str) -> None:
    """Raise ``HostOnlyOpError`` naming the first op of ``gm`` (or of a subgraph) that torch_xla
    would run on the host; ``where`` names the staged computation for the message."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and falls_back_to_host(node.target):
                raise HostOnlyOpError(
                    f"{where}: {node.target} has no XLA kernel and no decomposition in torch's table. "
                    "torch_xla runs such an op by copying its inputs to the host, which a computation "
                    "staged as one XLA program cannot do. Compute it outside the staged computation "
                    "(before or after the scan, or outside the compiled function)."
                )


def _portable_target(node: fx.Node) -> Callable[..., Any] | None:
    if node.op != "call_function":
        return None
    if node.target in PORTABLE:
        return PORTABLE[node.target]
    if node.target in REDUCE_EVERY_DIM_WHEN_EMPTY and _empty_dims(node):
        return every_dim(node.target)
    return device_decomposition(node.target)


def replace_non_portable_ops(gm: fx.GraphModule) -> bool:
    """Point every node of ``gm`` and its subgraphs that torch_xla would not run as torch does
    (an op of ``PORTABLE``; a reduction of ``REDUCE_EVERY_DIM_WHEN_EMPTY`` given ``dim=[]``; an
    op it runs on the host, ``device_decomposition``) at its portable function (in place).
    Whether any was."""
    changed = False
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        replaced = 0
        for node in module.graph.nodes:
            target = _portable_target(node)
            if target is not None:
                node.target = target
                replaced += 1
        if replaced:
            module.recompile()
            changed = True
    return changed
