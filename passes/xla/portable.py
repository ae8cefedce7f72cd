"""ATen ops that only the device a graph was traced on runs, rewritten into ops every device runs.

A graph traced on CPU holds CPU-only ops: ``torch.nn.functional.scaled_dot_product_attention``
records ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), which torch_xla
has no kernel for (the process aborts). Each such op is given a function of ordinary ops with
the same outputs, the backward one computed from the saved ``logsumexp`` as the CPU kernel does.
A table keyed by the op, like the target's rules.
"""

from __future__ import annotations

import math
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


def replace_host_only_ops(gm: fx.GraphModule) -> bool:
    """Point every node of ``gm`` and its subgraphs calling an op of ``PORTABLE`` at its
    portable function (in place). Whether any was."""
    changed = False
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target in PORTABLE]
        for node in nodes:
            node.target = PORTABLE[node.target]
        if nodes:
            module.recompile()
            changed = True
    return changed
