"""``hops.assume_pure`` on target ``"jax"``: a pure function as one jitted JAX function whose
backward is ``jax.vjp``'s (the design pytorch/xla#8923 gave torch_xla's ``assume_pure``).

``assume_pure_on_jax(fn)`` (``fn`` a function or a ``hops.assume_pure`` function) traces ``fn``
once per input signature (the pytree structure; each tensor's shape and dtype; each other leaf's
value) into an ATen graph, lowers it with ``lower_to_jax`` and calls it on torch CPU tensors:

- forward: one jitted call of ``jax.vjp(f, *inputs)``, which returns the outputs and the vjp
  function (a pytree of residuals: jax keeps what the backward needs, torch's autograd saves
  nothing but that);
- backward (``torch.autograd.Function``): one jitted call of that vjp function on the outputs'
  cotangents.

``fn``'s Python runs once per signature, when traced: as with ``hops.assume_pure``, it must be
pure in its tensors (on this target the promise is taken, not checked). Tensors cross to jax
and back through DLPack (``passes.jax.backend``), without a copy where the memory can be shared;
as the backend, under jax's 64-bit mode scoped to these calls (outputs and gradients with eager's
dtypes and values), and a complex gradient in torch's convention (the conjugate of jax's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from hops.lowering import jax_x64

__all__ = ["assume_pure_on_jax", "JaxPureFunction"]


@dataclasses.dataclass
class _Entry:
    """One signature: the lowered graph's jitted forward (with its vjp) and backward."""

    forward: Callable
    backward: Callable
    positions: tuple[int, ...]
    out_spec: Any
    differentiable: tuple[bool, ...]
    graph: Any
    over_mesh: bool
    dtypes: tuple[torch.dtype, ...]


def _to_jax(tensor: torch.Tensor, where: str, over_mesh: bool) -> Any:
    """As the backend hands tensors over: DLPack's array (committed to one device), or for a
    program over a mesh a numpy view the compiled program places."""
    from passes.jax.backend import _host_view
    from passes.jax.backend import _to_jax as convert

    return _host_view(tensor, where) if over_mesh else convert(tensor, {"in": 0, "out": 0}, where)


def _to_torch(value: Any, dtype: torch.dtype) -> torch.Tensor:
    from passes.jax.backend import _to_torch as convert

    return convert(value, {"in": 0, "out": 0}, dtype)


class _Vjp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, entry: _Entry, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # jax's 64-bit mode for our calls only (as the backend's): int64 / float64 cross and are computed exactly.
        with jax_x64():
            outputs, vjp = entry.forward(*[_to_jax(t, f"input {i}", entry.over_mesh) for i, t in enumerate(tensors)])
            result = tuple(_to_torch(o, dtype) for o, dtype in zip(outputs, entry.dtypes))
        ctx.entry, ctx.vjp = entry, vjp
        ctx.shapes = [(o.shape, o.dtype) for o in outputs]
        ctx.input_dtypes = [t.dtype for t in tensors]
        ctx.mark_non_differentiable(*[o for o, d in zip(result, entry.differentiable) if not d])
        return result

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        import jax
        import numpy as np

        with jax_x64():
            cotangents = []
            for grad, (shape, dtype), differentiable in zip(grads, ctx.shapes, ctx.entry.differentiable):
                if not differentiable:
                    cotangents.append(np.zeros(shape, jax.dtypes.float0))
                elif grad is None:
                    cotangents.append(np.zeros(shape, dtype))
                else:
                    cotangents.append(_to_jax(grad, "a gradient", ctx.entry.over_mesh))
            gradients = ctx.entry.backward(ctx.vjp, tuple(cotangents))
            # a gradient has its input's dtype
            return (None, *[_to_torch(g, d) if g.dtype != jax.dtypes.float0 else None for g, d in zip(gradients, ctx.input_dtypes)])


class JaxPureFunction:
    """``fn`` traced once per signature and run as one jitted JAX function (module docstring)."""

    def __init__(self, fn: Callable) -> None:
        from hops.assume_pure import PureFunction

        if isinstance(fn, PureFunction):
            fn = fn.fn
        if not callable(fn):
            raise TypeError(f"assume_pure_on_jax: fn must be callable, got {type(fn).__name__} {fn!r}")
        self.fn = fn
        self._cache: dict[tuple, _Entry] = {}
        self.traces = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        key = (treedef, *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._trace(leaves, treedef)
        outputs = _Vjp.apply(entry, *[leaves[i] for i in entry.positions])
        return pytree.tree_unflatten(list(outputs), entry.out_spec)

    def _trace(self, leaves: list, treedef: Any) -> _Entry:
        import jax
        from torch.fx.experimental.proxy_tensor import make_fx

        from passes.jax import lower_to_jax
        from passes.jax.backend import _replicated_on_mesh

        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        out_spec: list = [None]

        def flat_fn(*tensors: torch.Tensor) -> tuple:
            full = list(leaves)
            for i, tensor in zip(positions, tensors):
                full[i] = tensor
            args, kwargs = pytree.tree_unflatten(full, treedef)
            outputs, out_spec[0] = pytree.tree_flatten(self.fn(*args, **kwargs))
            return tuple(outputs)

        examples = [leaves[i].detach() for i in positions]
        graph = make_fx(flat_fn, tracing_mode="fake")(*examples)
        function = lower_to_jax(graph)
        self.traces += 1
        values = [node.meta.get("val") for node in next(iter(graph.graph.find_nodes(op="output"))).args[0]]
        differentiable = tuple(v.is_floating_point() or v.is_complex() for v in values)

        def forward(*inputs: Any) -> tuple:
            outputs, vjp = jax.vjp(lambda *xs: tuple(function(*xs)), *inputs)
            return outputs, vjp

        def backward(vjp: Any, cotangents: tuple) -> tuple:
            # torch's gradient of a complex value is the conjugate of jax's cotangent (torch takes
            # dL/d(conj z), jax dL/dz): conjugated in and out, jax's vjp is torch's backward.
            return tuple(map(_conj, vjp(tuple(map(_conj, cotangents)))))

        return _Entry(
            jax.jit(forward), jax.jit(backward), positions, out_spec[0], differentiable, graph,
            _replicated_on_mesh(function.graph_module) is not None,
            tuple(v.dtype for v in values),
        )


def _conj(value: Any) -> Any:
    import jax.numpy as jnp

    return jnp.conj(value) if jnp.iscomplexobj(value) else value


def assume_pure_on_jax(fn: Callable) -> JaxPureFunction:
    """``fn`` (or a ``hops.assume_pure`` function) run on target ``"jax"``: see the module docstring."""
    return JaxPureFunction(fn)
