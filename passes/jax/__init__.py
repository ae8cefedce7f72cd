"""The JAX target: ``lower_to_jax(gm)`` makes a traced graph a JAX function of its inputs.

Like every target it is a table of rules, one per HOP (``passes/jax/rules.py``): an
annotation becomes ``jax.lax.with_sharding_constraint`` (Shardy's ``sdy.sharding_constraint``),
a ``local_map`` region ``jax.shard_map`` (``sdy.manual_computation``), a scan ``jax.lax.scan``
(``stablehlo.while``), a named scope ``jax.named_scope``, a kernel its ``jax=`` implementation
(else its torch function through this target), einsum ``jnp.einsum``. ``assume_pure_on_jax(fn)``
(``passes/jax/pure.py``) runs a ``hops.assume_pure`` function as one jitted ``jax.vjp`` call on
torch tensors, its backward the vjp function's. The ATen ops between them have rules of their own
(``passes/jax/aten.py``: why not torchax's table is said there); an op without one is refused
with ``NoJaxRule`` naming it when the graph is lowered. ``passes/jax/graph.py`` evaluates the
lowered graph on jax values.

jax is imported when a lowered graph first runs, not when this module is: registering the table
(``passes._infra.hop_tables``) needs no jax. On CPU, a mesh of N devices needs
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported. The shardings
reach XLA as Shardy's unless something switched jax to GSPMD process-wide: torch_xla 2.9 does when
one of its jax features first imports jax (``jax_use_shardy_partitioner`` off,
``torch_xla/_internal/jax_workarounds.py``); the partitioning is the same, the text differs.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.fx as fx

from passes.jax.aten import NoJaxRule, random_key
from passes.jax.graph import jax_function
from passes.jax.pure import assume_pure_on_jax
from passes.jax.rules import TARGET, lower_hops

__all__ = ["lower_to_jax", "assume_pure_on_jax", "random_key", "NoJaxRule", "TARGET"]


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` to lower, sharing its tensors (constants, parameters): lowering rewrites
    nodes, never a tensor, and copying one fails where a fake mode is active (a backend called by
    AOTAutograd: a model's tensor constant, HF's rotary ``inv_freq``, cannot be cloned there)."""
    memo: dict[int, Any] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    return copy.deepcopy(gm, memo)


def lower_to_jax(gm: fx.GraphModule) -> Callable[..., Any]:
    """The JAX function ``gm`` computes: it takes the graph's inputs as ``jax.Array``s (or
    numpy arrays, or anything ``jnp`` takes) and returns its outputs as ``jax.Array``s, in the
    graph's output structure. ``gm`` itself is left as it is (its copy is lowered; the copy is
    the function's ``graph_module``). ``PassError`` naming the node for a HOP the target cannot
    take, ``NoJaxRule`` for an ATen op without a rule; both before anything runs.

    Dtypes are jax's, under the caller's jax config, as in any JAX function: with x64 on
    (``with jax.enable_x64(True):`` or ``jax_enable_x64``) each output has the graph's dtype and an
    int64 / float64 / complex128 program is computed exactly; with x64 off (jax's default) jax
    computes those dtypes as int32 / float32 / complex64 (values past 2**31 wrap). ``hops_jax``
    and ``assume_pure_on_jax`` turn x64 on for their own calls only."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"lower_to_jax: gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    lowered = lower_hops(_copy(gm))
    run = jax_function(lowered)

    def function(*args: Any) -> Any:
        return run(*args)

    function.__name__ = function.__qualname__ = f"jax_{type(gm).__name__}"
    function.graph_module = lowered
    return function
