"""The ATen ops of target ``"jax"``: one small rule per op, written with ``jax.numpy`` / ``lax``.

``ATEN`` maps an ``OpOverload`` (or, for every overload of an op, its ``OpOverloadPacket``) to
a function of the node's arguments, tensors being ``jax.Array``s (or tracers) and everything
else as the graph holds it (ints, floats, dtypes, lists). The table holds the core ATen ops the
decomposed graphs of this package's programs hold (``make_fx`` / AOTAutograd graphs of the
samples and the examples: arithmetic, reductions, views, matmuls, creation ops, the backward
ops of activations and softmax); ``rule_of`` refuses any other op with ``NoJaxRule`` naming it,
when the graph is lowered, before anything runs.

Why a table of our own and not torchax's (measured on this machine, ``../shared/RESEARCH.md``):
torchax 0.0.13, the newest release on the registry, fails at import on torch 2.13
(``aten.prod.dim_Dimname``: an overload torch removed) and its unreleased main still fails on
2.15 (``aten.qr``); and importing it renames torch's PrivateUse1 backend to ``jax``, after
which every new Dynamo trace in the process fails. This table imports nothing of torch's
dispatch and changes nothing in torch.

Rules follow torch's semantics where jax's differ: ``view``-like ops copy (jax arrays are
values), ``div`` with ``rounding_mode``, ``sum`` of a bool tensor counts in int, a Python
scalar operand keeps the tensor's dtype (jax's weak types do the same), a tensor made from Python
numbers gets torch's dtype, not jax's guess. jax runs in 32 bits unless ``jax_enable_x64`` is
set: an int64 tensor becomes int32 there, as in any jax program (``hops_jax`` and
``assume_pure_on_jax`` set it for their calls).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from passes._infra import PassError
from passes.jax.checks import factored, holds, in_range, nonzero

aten = torch.ops.aten

# OpOverload or OpOverloadPacket -> function(*args, **kwargs) on jax values
ATEN: dict[Any, Callable[..., Any]] = {}

# Python functions a traced graph calls on sizes (SymInts) or containers: run as they are.
PYTHON_FUNCTIONS = frozenset(
    {
        operator.getitem,
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.mod,
        operator.neg,
        operator.pow,
        operator.eq,
        operator.ne,
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
        math.ceil,
        math.floor,
        math.sqrt,
    }
)


class NoJaxRule(PassError):
    """An op in a graph lowered to JAX that target ``"jax"`` has no rule for; ``op`` names it."""

    def __init__(self, message: str, op: Any) -> None:
        super().__init__(message)
        self.op = op


def register(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the JAX rule of each of ``ops``."""

    def add(rule: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            ATEN[op] = rule
        return rule

    return add


def rule_of(op: Any, where: str) -> Callable[..., Any]:
    """The JAX rule of ``op`` (its overload's, else its packet's); ``NoJaxRule`` naming the op
    and ``where`` (the node) if it has none."""
    rule = ATEN.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = ATEN.get(op.overloadpacket)
    if rule is None and op in PYTHON_FUNCTIONS:
        rule = op
    if rule is None and isinstance(op, torch._ops.OpOverload) and op.overloadpacket.__name__.endswith("_copy"):
        # a view op's copying variant (``view_copy``, ``slice_copy``: functionalized graphs
        # that removed the views): the view's rule, views being copies here
        view = getattr(getattr(aten, op.overloadpacket.__name__.removesuffix("_copy"), None), op._overloadname, None)
        rule = ATEN.get(view) or ATEN.get(getattr(view, "overloadpacket", None))
    if rule is None and isinstance(op, type) and issubclass(op, tuple):
        rule = _as_tuple  # a decomposition's named result (``torch.return_types``): its fields
    if rule is None:
        rule = _decomposed(op)
    if rule is None:
        raise NoJaxRule(
            f"lower_to_jax: {where}: no JAX rule for {op} (target 'jax' has its own table of core ATen ops, "
            "passes/jax/aten.py); add one with passes.jax.aten.register",
            op,
        )
    return rule


def _as_tuple(*fields: Any) -> tuple:
    return tuple(fields)


def jnp() -> Any:
    import jax.numpy

    return jax.numpy


def lax() -> Any:
    import jax.lax

    return jax.lax


_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}


def jax_dtype(dtype: torch.dtype | None) -> Any:
    """The jax dtype of a torch dtype (``None`` stays ``None``); ``TypeError`` naming it if it has none."""
    if dtype is None:
        return None
    name = _DTYPES.get(dtype)
    if name is None:
        raise TypeError(f"lower_to_jax: the torch dtype {dtype} has no jax dtype here")
    return getattr(jnp(), name)


def _int64() -> Any:
    """torch's int64 as jax has it: int32 without x64 (asked for so: jax warns when asked for int64 there)."""
    import jax

    return jax.dtypes.canonicalize_dtype(jnp().int64)


def _dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        return None  # torch: an empty dim list reduces over every dim
    return tuple(d % max(ndim, 1) for d in dims)


def _creation_dtype(kwargs: dict[str, Any], default: Any = None) -> Any:
    dtype = kwargs.get("dtype")
    return jax_dtype(dtype) if dtype is not None else (default if default is not None else jnp().float32)


# ---------------------------------------------------------------- elementwise


def _unary(name: str) -> Callable[..., Any]:
    return lambda x: getattr(jnp(), name)(x)


def _binary(name: str) -> Callable[..., Any]:
    return lambda x, y: getattr(jnp(), name)(x, y)


for _op, _name in (
    (aten.sin, "sin"),
    (aten.cos, "cos"),
    (aten.tan, "tan"),
    (aten.tanh, "tanh"),
    (aten.exp, "exp"),
    (aten.expm1, "expm1"),
    (aten.log, "log"),
    (aten.log1p, "log1p"),
    (aten.log2, "log2"),
    (aten.sqrt, "sqrt"),
    (aten.neg, "negative"),
    (aten.abs, "abs"),
    (aten.sign, "sign"),
    (aten.sgn, "sign"),
    (aten.floor, "floor"),
    (aten.ceil, "ceil"),
    (aten.reciprocal, "reciprocal"),
    (aten.logical_not, "logical_not"),
    (aten.bitwise_not, "invert"),
    (aten.isnan, "isnan"),
    (aten.isinf, "isinf"),
):
    ATEN[_op] = _unary(_name)


@register(aten.erf)
def _erf(x):
    import jax.scipy.special

    return jax.scipy.special.erf(x)


@register(aten.rsqrt)
def _rsqrt(x):
    return lax().rsqrt(x)


@register(aten.sigmoid)
def _sigmoid(x):
    import jax

    return jax.nn.sigmoid(x)


@register(aten.relu)
def _relu(x):
    return jnp().maximum(x, 0).astype(x.dtype)


@register(aten.gelu)
def _gelu(x, approximate="none"):
    import jax

    return jax.nn.gelu(x, approximate=approximate == "tanh")


@register(aten.silu)
def _silu(x):
    import jax

    return jax.nn.silu(x)


@register(aten.add)
def _add(x, y, alpha=1):
    return jnp().add(x, y if alpha == 1 else y * alpha)


@register(aten.sub)
def _sub(x, y, alpha=1):
    return jnp().subtract(x, y if alpha == 1 else y * alpha)


@register(aten.rsub)
def _rsub(x, y, alpha=1):
    return jnp().subtract(y, x if alpha == 1 else x * alpha)


@register(aten.mul)
def _mul(x, y):
    return jnp().multiply(x, y)


@register(aten.div)
def _div(x, y, rounding_mode=None):
    if rounding_mode is not None:
        nonzero(x, y, f"aten.div, rounding_mode={rounding_mode!r}")
    if rounding_mode == "floor":
        return _floor_divide(x, y)
    quotient = jnp().true_divide(x, y)
    if rounding_mode == "trunc":
        quotient = jnp().trunc(quotient)
        dtype = jnp().result_type(x, y)
        return quotient.astype(dtype)
    return quotient


# torch's aliases of the arithmetic ops (traced as they are under dynamic shapes' decompositions)
ATEN[aten.true_divide] = ATEN[aten.divide] = _div
ATEN[aten.multiply] = _mul
ATEN[aten.subtract] = _sub


@register(aten.pow)
def _pow(x, y):
    return jnp().power(x, y)


for _op, _name in (
    (aten.maximum, "maximum"),
    (aten.minimum, "minimum"),
    (aten.eq, "equal"),
    (aten.ne, "not_equal"),
    (aten.lt, "less"),
    (aten.le, "less_equal"),
    (aten.gt, "greater"),
    (aten.ge, "greater_equal"),
    (aten.logical_and, "logical_and"),
    (aten.logical_or, "logical_or"),
    (aten.bitwise_and, "bitwise_and"),
    (aten.bitwise_or, "bitwise_or"),
    (aten.atan2, "arctan2"),
):
    ATEN[_op] = _binary(_name)


@register(aten.where)
def _where(condition, x, y):
    return jnp().where(condition, x, y)


@register(aten.clamp)
def _clamp(x, min=None, max=None):
    return jnp().clip(x, min, max)


@register(aten.masked_fill)
def _masked_fill(x, mask, value):
    return jnp().where(mask, jnp().asarray(value, dtype=x.dtype), x)


@register(aten.lerp)
def _lerp(x, end, weight):
    return x + weight * (end - x)


# ---------------------------------------------------------------- backward ops of activations


@register(aten.tanh_backward)
def _tanh_backward(grad, output):
    return grad * (1 - output * output)


@register(aten.sigmoid_backward)
def _sigmoid_backward(grad, output):
    return grad * output * (1 - output)


@register(aten.threshold_backward)
def _threshold_backward(grad, x, threshold):
    return jnp().where(x <= threshold, jnp().zeros_like(grad), grad)


@register(aten.gelu_backward)
def _gelu_backward(grad, x, approximate="none"):
    import jax

    return jax.vjp(lambda v: _gelu(v, approximate), x)[1](grad)[0]


@register(aten.silu_backward)
def _silu_backward(grad, x):
    import jax

    sigmoid = jax.nn.sigmoid(x)
    return grad * sigmoid * (1 + x * (1 - sigmoid))


@register(aten._softmax)
def _softmax(x, dim, half_to_float=False):
    import jax

    return jax.nn.softmax(x, axis=dim)


@register(aten._log_softmax)
def _log_softmax(x, dim, half_to_float=False):
    import jax

    return jax.nn.log_softmax(x, axis=dim)


@register(aten._softmax_backward_data)
def _softmax_backward_data(grad, output, dim, input_dtype):
    return output * (grad - (grad * output).sum(axis=dim, keepdims=True))


@register(aten._log_softmax_backward_data)
def _log_softmax_backward_data(grad, output, dim, input_dtype):
    return grad - jnp().exp(output) * grad.sum(axis=dim, keepdims=True)


# ---------------------------------------------------------------- reductions


@register(aten.sum)
def _sum(x, dim=None, keepdim=False, *, dtype=None):
    dtype = jax_dtype(dtype)
    if dtype is None and x.dtype == jnp().bool_:
        dtype = _int64()  # torch counts a bool tensor's True values in int64
    return jnp().sum(x, axis=_dims(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@register(aten.mean)
def _mean(x, dim=None, keepdim=False, *, dtype=None):
    return jnp().mean(x, axis=_dims(dim, x.ndim), keepdims=keepdim, dtype=jax_dtype(dtype))


@register(aten.prod)
def _prod(x, dim=None, keepdim=False, *, dtype=None):
    return jnp().prod(x, axis=_dims(dim, x.ndim), keepdims=keepdim, dtype=jax_dtype(dtype))


@register(aten.amax)
def _amax(x, dim=(), keepdim=False):
    return jnp().max(x, axis=_dims(dim, x.ndim), keepdims=keepdim)


@register(aten.amin)
def _amin(x, dim=(), keepdim=False):
    return jnp().min(x, axis=_dims(dim, x.ndim), keepdims=keepdim)


@register(aten.argmax)
def _argmax(x, dim=None, keepdim=False):
    return jnp().argmax(x, axis=dim, keepdims=keepdim)


@register(aten.argmin)
def _argmin(x, dim=None, keepdim=False):
    return jnp().argmin(x, axis=dim, keepdims=keepdim)


@register(aten.var)
def _var(x, dim=None, *, correction=1, keepdim=False):
    return jnp().var(x, axis=_dims(dim, x.ndim), ddof=1 if correction is None else correction, keepdims=keepdim)


@register(aten.var_mean)
def _var_mean(x, dim=None, *, correction=1, keepdim=False):
    return _var(x, dim, correction=correction, keepdim=keepdim), _mean(x, dim, keepdim)


@register(torch.ops.prims.var)  # (the reference decompositions of the norms record it)
def _prims_var(x, dims, correction=1, *, output_dtype=None):
    return _var(x, dims, correction=correction)


@register(torch.ops.prims.sum)
def _prims_sum(x, dims, *, output_dtype=None):
    return _sum(x, dims, dtype=output_dtype)


@register(torch.ops.prims.broadcast_in_dim)
def _broadcast_in_dim(x, shape, broadcast_dimensions):
    return lax().broadcast_in_dim(x, tuple(shape), tuple(broadcast_dimensions))


@register(aten.any)
def _any(x, dim=None, keepdim=False):
    return jnp().any(x, axis=_dims(dim, x.ndim), keepdims=keepdim)


@register(aten.all)
def _all(x, dim=None, keepdim=False):
    return jnp().all(x, axis=_dims(dim, x.ndim), keepdims=keepdim)


# ---------------------------------------------------------------- matmuls


@register(aten.mm, aten.bmm, aten.matmul, aten.dot)
def _matmul(x, y):
    return jnp().matmul(x, y)


@register(aten.addmm, aten.baddbmm)
def _addmm(bias, x, y, *, beta=1, alpha=1):
    product = jnp().matmul(x, y)
    return (bias if beta == 1 else beta * bias) + (product if alpha == 1 else alpha * product)


@register(aten.einsum)
def _einsum(equation, operands, path=None):
    return jnp().einsum(equation, *operands)


# ---------------------------------------------------------------- views and shapes (values: copies)


@register(aten.view, aten._unsafe_view, aten.reshape)
def _view(x, shape):
    return jnp().reshape(x, tuple(shape))


@register(aten.expand)
def _expand(x, shape, *, implicit=False):
    shape = tuple(shape)
    offset = len(shape) - x.ndim
    sizes = tuple(x.shape[i - offset] if size == -1 else size for i, size in enumerate(shape))
    return jnp().broadcast_to(x, sizes)


@register(aten.permute)
def _permute(x, dims):
    return jnp().transpose(x, tuple(dims))


@register(aten.t, aten.numpy_T)
def _t(x):
    return x.T


@register(aten.transpose)
def _transpose(x, dim0, dim1):
    return jnp().swapaxes(x, dim0, dim1)


@register(aten.unsqueeze)
def _unsqueeze(x, dim):
    return jnp().expand_dims(x, dim % (x.ndim + 1))


@register(aten.squeeze)
def _squeeze(x, dim=None):
    if dim is None:
        return jnp().squeeze(x)
    # (an empty list of dims squeezes none, unlike a reduction's; a 0-d tensor has none to squeeze)
    dims = [d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)] if x.ndim else []
    return jnp().squeeze(x, axis=tuple(d for d in dims if x.shape[d] == 1))


@register(aten.slice)
def _slice(x, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


@register(aten.select)
def _select(x, dim, index):
    return jnp().take(x, index, axis=dim)


@register(aten.slice_scatter)
def _slice_scatter(x, source, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x.at[tuple(index)].set(source)


@register(aten.slice_backward)
def _slice_backward(grad, input_sizes, dim, start, end, step):
    return _slice_scatter(jnp().zeros(tuple(input_sizes), grad.dtype), grad, dim, start, end, step)


@register(aten.select_scatter)
def _select_scatter(x, source, dim, index):
    where = [slice(None)] * x.ndim
    where[dim] = index
    return x.at[tuple(where)].set(source)


@register(aten.select_backward)
def _select_backward(grad, input_sizes, dim, index):
    return _select_scatter(jnp().zeros(tuple(input_sizes), grad.dtype), grad, dim, index)


@register(aten.index_select)
def _index_select(x, dim, index):
    in_range(index, 0, _size(x, dim), f"aten.index_select, dim {dim}")
    return jnp().take(x, index, axis=dim)


def _size(x: Any, dim: int) -> int:
    """``x.size(dim)`` as torch's index ops read it: a 0-d tensor's one element along dim 0 or -1."""
    return x.shape[dim] if x.ndim else 1


def _along(index: Any, dim: int) -> tuple:
    """The full index of ``torch.gather``/``scatter_add``'s ``index`` along ``dim``: ``index``
    there, each other dim its own position (``index`` may be smaller than the input there)."""
    grid = [
        jnp().broadcast_to(jnp().arange(size).reshape([-1 if d == k else 1 for k in range(index.ndim)]), index.shape)
        for d, size in enumerate(index.shape)
    ]
    grid[dim] = index
    return tuple(grid)


@register(aten.gather)
def _gather(x, dim, index, sparse_grad=False):
    in_range(index, 0, _size(x, dim), f"aten.gather, dim {dim}")
    return x[_along(index, dim % max(x.ndim, 1))]


@register(aten.scatter_add)
def _scatter_add(x, dim, index, source):
    # (torch reads only the part of ``source`` that ``index`` covers)
    in_range(index, 0, _size(x, dim), f"aten.scatter_add, dim {dim}")
    covered = source[tuple(slice(0, size) for size in index.shape)]
    return x.at[_along(index, dim % max(x.ndim, 1))].add(covered)


@register(aten.cat)
def _cat(tensors, dim=0):
    # torch skips a 1-d empty tensor among others (what HF's OPT and Llama concatenate onto)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors)[:1]
    return jnp().concatenate(kept, axis=dim)


@register(aten.stack)
def _stack(tensors, dim=0):
    return jnp().stack(list(tensors), axis=dim)


@register(aten.split)
def _split(x, split_size, dim=0):
    if not isinstance(split_size, int):
        return _split_with_sizes(x, split_size, dim)
    size = x.shape[dim]
    return _split_with_sizes(x, [min(split_size, size - start) for start in range(0, size, split_size)], dim)


@register(aten.unbind)
def _unbind(x, dim=0):
    return [jnp().take(x, i, axis=dim) for i in range(x.shape[dim])]


@register(aten.split_with_sizes)
def _split_with_sizes(x, sizes, dim=0):
    points = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    return list(jnp().split(x, points, axis=dim))


@register(aten.roll)
def _roll(x, shifts, dims=()):
    if not dims:  # (the tensor rolled as one flat row, its shape kept)
        return jnp().roll(jnp().reshape(x, -1), shifts[0]).reshape(x.shape)
    return jnp().roll(x, tuple(shifts), axis=tuple(dims))


@register(aten.searchsorted)
def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    import jax

    if sorter is not None:
        sorted_sequence = jnp().take_along_axis(sorted_sequence, sorter, axis=-1)
    side = side or ("right" if right else "left")

    def search(row, row_values):
        return jnp().searchsorted(row, row_values, side=side)

    # (an N-d sequence: each row of its last dim searched for the same row of ``values``)
    for _ in range(sorted_sequence.ndim - 1):
        search = jax.vmap(search)
    return search(sorted_sequence, jnp().asarray(values)).astype(jax_dtype(torch.int32 if out_int32 else torch.int64))


@register(aten.flip)
def _flip(x, dims):
    return jnp().flip(x, axis=tuple(dims))


@register(aten.embedding)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    in_range(indices, 0, weight.shape[0], "aten.embedding")
    return jnp().take(weight, indices, axis=0)


@register(aten.clone, aten.alias, aten.detach, aten.lift_fresh_copy, aten.contiguous)
def _identity(x, *args, **kwargs):
    return x


@register(aten._to_copy)
def _to_copy(x, *, dtype=None, **kwargs):
    return x if dtype is None else x.astype(jax_dtype(dtype))


@register(torch.ops.prims.convert_element_type)  # (decompositions under dynamic shapes record it)
def _convert_element_type(x, dtype):
    return jnp().asarray(x).astype(jax_dtype(dtype))


@register(aten.copy)
def _copy(destination, source, non_blocking=False):
    return jnp().broadcast_to(source, destination.shape).astype(destination.dtype)


@register(aten.sym_size)
def _sym_size(x, dim):
    return x.shape[dim]


@register(aten.sym_numel)
def _sym_numel(x):
    return x.size


# ---------------------------------------------------------------- creation


@register(aten.zeros)
def _zeros(size, **kwargs):
    return jnp().zeros(tuple(size), _creation_dtype(kwargs))


@register(aten.ones)
def _ones(size, **kwargs):
    return jnp().ones(tuple(size), _creation_dtype(kwargs))


def _dtype_of_numbers(kwargs: dict[str, Any], *values: Any) -> Any:
    """The dtype torch gives a tensor made from Python numbers without a ``dtype``: bool, int64, or
    its default float (complex) dtype for a float (complex) among them. jax's own guess would be
    a 64-bit float under x64 (the backend runs its calls so), where torch's is float32. Without
    x64, jax's 32-bit counterpart (asked for as such: jax warns when asked for a 64-bit dtype)."""
    import jax

    if kwargs.get("dtype") is not None:
        return jax_dtype(kwargs["dtype"])
    default = torch.get_default_dtype()
    if any(isinstance(v, complex) for v in values):
        dtype = torch.complex128 if default == torch.float64 else torch.complex64
    elif any(isinstance(v, float) for v in values):
        dtype = default
    else:
        dtype = torch.bool if values and all(isinstance(v, bool) for v in values) else torch.int64
    return jax.dtypes.canonicalize_dtype(jax_dtype(dtype))


@register(aten.full)
def _full(size, value, **kwargs):
    return jnp().full(tuple(size), value, _dtype_of_numbers(kwargs, value))


@register(aten.scalar_tensor)
def _scalar_tensor(value, **kwargs):
    return jnp().asarray(value, _creation_dtype(kwargs))


@register(aten.arange)
def _arange(*args, **kwargs):
    return jnp().arange(*args, dtype=_dtype_of_numbers(kwargs, *args))


@register(aten.empty)
def _empty(size, **kwargs):
    return jnp().zeros(tuple(size), _creation_dtype(kwargs))  # any value will do: zeros


@register(aten.zeros_like, aten.new_zeros, aten.empty_like, aten.new_empty)
def _zeros_like(x, size=None, **kwargs):
    return jnp().zeros(x.shape if size is None else tuple(size), _creation_dtype(kwargs, x.dtype))


@register(aten.ones_like, aten.new_ones)
def _ones_like(x, size=None, **kwargs):
    return jnp().ones(x.shape if size is None else tuple(size), _creation_dtype(kwargs, x.dtype))


@register(aten.full_like)
def _full_like(x, value, **kwargs):
    return jnp().full(x.shape, value, _creation_dtype(kwargs, x.dtype))


@register(aten.new_full)
def _new_full(x, size, value, **kwargs):
    return jnp().full(tuple(size), value, _creation_dtype(kwargs, x.dtype))


@register(aten.fill)
def _fill(x, value):
    return jnp().full(x.shape, value, x.dtype)


# ---------------------------------------------------------------- what real models' graphs hold


@register(aten.chunk)
def _chunk(x, chunks, dim=0):
    size = -(-x.shape[dim] // chunks)  # torch: chunks of ceil(n / chunks), the last smaller
    return _split(x, size, dim)


@register(aten.embedding_dense_backward)
def _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    if scale_grad_by_freq:
        raise NotImplementedError("lower_to_jax: aten.embedding_dense_backward with scale_grad_by_freq=True has no rule yet")
    rows = indices.reshape(-1)
    grad = grad.reshape(rows.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp().where((rows == padding_idx)[:, None], 0, grad)
    return jnp().zeros((num_weights, grad.shape[1]), grad.dtype).at[rows].add(grad)


def _nll_weights(x, target, weight, ignore_index):
    kept = target != ignore_index
    safe = jnp().where(kept, target, 0)
    w = jnp().ones(target.shape, x.dtype) if weight is None else jnp().take(weight, safe)
    return safe, jnp().where(kept, w, 0).astype(x.dtype)


@register(aten.nll_loss_forward)
def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    safe, w = _nll_weights(x, target, weight, ignore_index)
    picked = -jnp().take_along_axis(x, safe[..., None], axis=-1)[..., 0] * w
    total = w.sum()
    if reduction == 0:  # none
        return picked, total
    return (picked.sum() / total if reduction == 1 else picked.sum()), total


@register(aten.nll_loss_backward)
def _nll_loss_backward(grad_output, x, target, weight, reduction, ignore_index, total_weight):
    safe, w = _nll_weights(x, target, weight, ignore_index)
    scale = grad_output / total_weight if reduction == 1 else grad_output
    per_item = -w * scale
    one_hot = jnp().arange(x.shape[-1]) == safe[..., None]
    return jnp().where(one_hot, per_item[..., None], 0).astype(x.dtype)


def _attention(query, key, value, is_causal, attn_mask, scale):
    # Grouped-query attention (fewer key/value heads, which the CPU kernel takes as they are):
    # query head h reads key/value head h // group; jax.vjp sums the group's gradients back.
    group = query.shape[-3] // key.shape[-3]
    key, value = (jnp().repeat(t, group, axis=-3) for t in (key, value)) if group > 1 else (key, value)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp().matmul(query, jnp().swapaxes(key, -1, -2)) * scale
    if is_causal:
        length, source = scores.shape[-2:]
        scores = jnp().where(jnp().tril(jnp().ones((length, source), bool)), scores, -jnp().inf)
    if attn_mask is not None:
        scores = jnp().where(attn_mask, scores, -jnp().inf) if attn_mask.dtype == jnp().bool_ else scores + attn_mask
    # A query every key is masked from (a left-padded row under a -inf mask): the CPU kernel
    # gives it output 0 and logsumexp 0, and no gradient; softmax over it would be NaN.
    blind = jnp().all(scores == -jnp().inf, axis=-1)
    scores = jnp().where(blind[..., None], 0, scores)
    logsumexp = __import__("jax").nn.logsumexp(scores, axis=-1)
    weights = jnp().where(blind[..., None], 0, jnp().exp(scores - logsumexp[..., None]))
    return jnp().matmul(weights, value), jnp().where(blind, 0, logsumexp)


@register(aten._scaled_dot_product_flash_attention_for_cpu)
def _flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p:
        raise NotImplementedError("lower_to_jax: scaled dot product attention with dropout has no rule yet")
    return _attention(query, key, value, is_causal, attn_mask, scale)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    import jax

    _, vjp = jax.vjp(lambda q, k, v: _attention(q, k, v, is_causal, attn_mask, scale)[0], query, key, value)
    return vjp(grad_out)


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    rstd = lax().rsqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


@register(aten.native_layer_norm)
def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    return _layer_norm(x, normalized_shape, weight, bias, eps)


@register(aten.native_layer_norm_backward)
def _native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    batch = tuple(range(x.ndim - len(normalized_shape)))
    normalized = (x - mean) * rstd
    g = grad_out if weight is None else grad_out * weight
    dx = rstd * (g - g.mean(axis=axes, keepdims=True) - normalized * (g * normalized).mean(axis=axes, keepdims=True))
    dw = None if weight is None else (grad_out * normalized).sum(axis=batch)
    db = None if bias is None else grad_out.sum(axis=batch)
    return tuple(g if wanted else None for g, wanted in zip((dx, dw, db), output_mask))


@register(aten.view_as_complex)
def _view_as_complex(x):
    return lax().complex(x[..., 0], x[..., 1])


@register(aten.view_as_real)
def _view_as_real(x):
    return jnp().stack([jnp().real(x), jnp().imag(x)], axis=-1)


@register(aten._conj, aten.conj_physical, aten._conj_physical)
def _conj(x):
    return jnp().conj(x)


@register(aten.permute_copy)
def _permute_copy(x, dims):
    return jnp().transpose(x, tuple(dims))


# ---------------------------------------------------------------- ops by torch's decompositions


_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_DECOMPOSED: dict[Any, "_Decomposition"] = {}


class _Decomposition:
    """The rule of an op without one of its own that torch decomposes (``mse_loss``, ``glu``,
    ``logsumexp``, ``linalg_vector_norm``, ``tril``, ``native_group_norm``, the backward ops of
    activations...): torch's decomposition traced at the arguments' shapes and dtypes (once per
    signature; ``make_fx``, fake tensors) into a graph of ATen ops, which is lowered in turn.
    An op of that graph without a rule is refused then (``NoJaxRule`` naming it), when the
    lowered function is first traced."""

    def __init__(self, op: Any, decomposition: Callable[..., Any]) -> None:
        self.op, self.decomposition = op, decomposition
        self.graphs: dict[Any, Callable[..., Any]] = {}

    def _graph(self, args: Any, kwargs: Any) -> Callable[..., Any]:
        import torch.utils._pytree as pytree
        from torch.fx.experimental.proxy_tensor import make_fx

        from passes.jax.graph import jax_function

        leaves, spec = pytree.tree_flatten((args, kwargs))
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        key = (spec, tuple((tuple(leaf.shape), str(leaf.dtype)) if i in arrays else (type(leaf), repr(leaf)) for i, leaf in enumerate(leaves)))
        made = self.graphs.get(key)
        if made is not None:
            return made

        def call(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, tensor in zip(arrays, tensors):
                filled[i] = tensor
            a, k = pytree.tree_unflatten(filled, spec)
            return self.decomposition(*a, **k)

        examples = [torch.empty(tuple(leaves[i].shape), dtype=_TORCH_DTYPES[str(leaves[i].dtype)]) for i in arrays]
        graph = make_fx(call, tracing_mode="fake")(*examples)
        if any(_writes(node.target) for node in graph.graph.nodes):
            # a decomposition writing into its own buffers (copy_, index_put_): functionalized
            graph = make_fx(torch.func.functionalize(call), tracing_mode="fake")(*examples)
        if any(node.target is self.op for node in graph.graph.nodes):
            raise NoJaxRule(f"lower_to_jax: no JAX rule for {self.op}, and torch's decomposition of it calls it again", self.op)
        made = jax_function(graph)
        self.graphs[key] = made
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch.utils._pytree as pytree

        args, kwargs = _mutable((args, kwargs))  # (some decompositions edit their list arguments)

        arrays = [jnp().asarray(leaf) for leaf in pytree.tree_leaves((args, kwargs)) if _is_array(leaf)]
        return self._graph(args, kwargs)(*arrays)


def _mutable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _mutable(v) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_mutable(v) for v in value)
    if isinstance(value, list):
        return [_mutable(v) for v in value]
    return value


def _writes(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(argument.alias_info is not None and argument.alias_info.is_write for argument in target._schema.arguments)


def _is_array(value: Any) -> bool:
    import jax
    import numpy

    return isinstance(value, (jax.Array, jax.core.Tracer, numpy.ndarray))


def _decomposed(op: Any) -> _Decomposition | None:
    """The decomposition rule of ``op`` (torch's core ATen decompositions first, then its other
    ATen ones), or None: for an op without one, or a random one (its values would be torch's
    generator's, which a jax program does not have)."""
    if not isinstance(op, torch._ops.OpOverload) or is_random(op):
        return None
    made = _DECOMPOSED.get(op)
    if made is None:
        from torch._decomp import core_aten_decompositions, decomposition_table

        decomposition = core_aten_decompositions().get(op) or decomposition_table.get(op)
        if decomposition is None:
            return None
        made = _DECOMPOSED[op] = _Decomposition(op, decomposition)
    return made


# ---------------------------------------------------------------- elementwise families, the rest


def _special(name: str) -> Callable[..., Any]:
    def rule(x):
        import jax.scipy.special

        return getattr(jax.scipy.special, name)(x)

    return rule


for _op, _name in (
    (aten.asin, "arcsin"),
    (aten.acos, "arccos"),
    (aten.atan, "arctan"),
    (aten.sinh, "sinh"),
    (aten.cosh, "cosh"),
    (aten.asinh, "arcsinh"),
    (aten.acosh, "arccosh"),
    (aten.atanh, "arctanh"),
    (aten.trunc, "trunc"),
    (aten.exp2, "exp2"),
    (aten.log10, "log10"),
    (aten.isfinite, "isfinite"),
    (aten.isneginf, "isneginf"),
    (aten.isposinf, "isposinf"),
    (aten.signbit, "signbit"),
    (aten.square, "square"),
    (aten.angle, "angle"),
    (aten.real, "real"),
    (aten.imag, "imag"),
):
    ATEN[_op] = _unary(_name)

for _op, _name in ((aten.erfc, "erfc"), (aten.erfinv, "erfinv"), (aten.lgamma, "gammaln"), (aten.digamma, "digamma"), (aten.special_i0e, "i0e"), (aten.i0, "i0")):
    ATEN[_op] = _special(_name)

for _op, _name in (
    (aten.bitwise_xor, "bitwise_xor"),
    (aten.bitwise_left_shift, "left_shift"),
    (aten.__lshift__, "left_shift"),
    (aten.bitwise_right_shift, "right_shift"),
    (aten.__rshift__, "right_shift"),
    (aten.hypot, "hypot"),
    (aten.copysign, "copysign"),
    (aten.logaddexp, "logaddexp"),
    (aten.logaddexp2, "logaddexp2"),
    (aten.nextafter, "nextafter"),
    (aten.logical_xor, "logical_xor"),
    (aten.fmax, "fmax"),
    (aten.fmin, "fmin"),
):
    ATEN[_op] = _binary(_name)


def _floor_divide(x: Any, y: Any) -> Any:
    # torch's: a float over zero is x / 0 (an inf; NaN for 0 / 0), which jax 0.7's floor_divide makes NaN
    quotient = jnp().floor_divide(x, y)
    if jnp().issubdtype(quotient.dtype, jnp().floating):
        quotient = jnp().where(jnp().asarray(y) == 0, jnp().true_divide(x, y), quotient)
    return quotient


def _dividing(op: Any, divide: Callable[..., Any]) -> Callable[..., Any]:
    """The rule of a binary op dividing ``x`` by ``y``: torch raises on an integer divided by zero."""

    def rule(x, y):
        nonzero(x, y, str(op))
        return divide(x, y)

    return rule


for _op, _divide in ((aten.remainder, lambda x, y: jnp().remainder(x, y)), (aten.fmod, lambda x, y: jnp().fmod(x, y)), (aten.floor_divide, _floor_divide)):
    ATEN[_op] = _dividing(_op, _divide)


@register(aten.polygamma)
def _polygamma(n, x):
    import jax.scipy.special

    return jax.scipy.special.polygamma(n, x)


@register(aten.polar)
def _polar(magnitude, angle):
    return lax().complex(magnitude * jnp().cos(angle), magnitude * jnp().sin(angle))


@register(aten.round)
def _round(x, *, decimals=0):
    # half to even, as torch's; with ``decimals``, at that many places (negative: tens, hundreds)
    return jnp().round(x, decimals)


@register(aten.complex)
def _complex(real, imag):
    return lax().complex(*jnp().broadcast_arrays(real, imag))  # (torch broadcasts the parts)


# ---------------------------------------------------------------- indexing (int64 indices as jax's ints)


def _index_tuple(indices: Any, x: Any = None, what: str = "") -> tuple:
    # torch's advanced indexing is numpy's: ``None`` in the list is a full slice of that dim.
    # With ``x``: each integer index in torch's range for its dim, negative ones counting from the end.
    dim = 0
    for index in indices if x is not None else ():
        if index is not None and jnp().issubdtype(index.dtype, jnp().bool_):
            dim += index.ndim  # (a mask: the dims it covers)
            continue
        if index is not None:
            in_range(index, -x.shape[dim], x.shape[dim], f"{what}, dim {dim}")
        dim += 1
    return tuple(slice(None) if index is None else index for index in indices)


@register(aten.index)
def _index(x, indices):
    return x[_index_tuple(indices, x, "aten.index")]


@register(aten._unsafe_index)
def _unsafe_index(x, indices):
    return x[_index_tuple(indices)]


@register(aten.index_put)
def _index_put(x, indices, values, accumulate=False):
    return _put(x.at[_index_tuple(indices, x, "aten.index_put")], values, x.dtype, accumulate)


@register(aten._unsafe_index_put)
def _unsafe_index_put(x, indices, values, accumulate=False):
    return _put(x.at[_index_tuple(indices)], values, x.dtype, accumulate)


def _put(where: Any, values: Any, dtype: Any, accumulate: bool) -> Any:
    values = jnp().asarray(values, dtype=dtype)
    return where.add(values) if accumulate else where.set(values)


@register(aten.put)
def _put_flat(x, index, source, accumulate=False):
    # (``take``'s backward) ``source`` written at the flat ``index`` of ``x``, negative ones from the end
    size = math.prod(x.shape)
    in_range(index, -size, size, "aten.put")
    flat = jnp().reshape(index, -1)
    flat = jnp().where(flat < 0, flat + size, flat)
    return _put(jnp().reshape(x, -1).at[flat], jnp().reshape(source, -1), x.dtype, accumulate).reshape(x.shape)


@register(aten.index_add)
def _index_add(x, dim, index, source, *, alpha=1):
    in_range(index, 0, _size(x, dim), f"aten.index_add, dim {dim}")
    return x.at[_at_dim(x, dim, index)].add(source if alpha == 1 else source * alpha)


@register(aten.index_copy)
def _index_copy(x, dim, index, source):
    in_range(index, 0, _size(x, dim), f"aten.index_copy, dim {dim}")
    return x.at[_at_dim(x, dim, index)].set(source)


def _at_dim(x: Any, dim: int, index: Any) -> tuple:
    """The index of the entries ``index`` picks along ``dim`` of ``x``."""
    return (slice(None),) * (dim % x.ndim) + (index,)


@register(aten.scatter)
def _scatter(x, dim, index, source, *, reduce=None):
    in_range(index, 0, _size(x, dim), f"aten.scatter, dim {dim}")
    where = x.at[_along(index, dim % max(x.ndim, 1))]
    if isinstance(source, (int, float, bool)) or getattr(source, "ndim", 1) == 0:
        values = jnp().broadcast_to(jnp().asarray(source, x.dtype), index.shape)
    else:
        values = source[tuple(slice(0, size) for size in index.shape)]
    if reduce is None:
        return where.set(values)
    if reduce == "add":
        return where.add(values)
    if reduce == "multiply":
        return where.multiply(values)
    raise ValueError(f"lower_to_jax: aten.scatter with reduce={reduce!r}: torch takes 'add' or 'multiply'")


@register(aten.scatter_reduce)
def _scatter_reduce(x, dim, index, source, reduce, *, include_self=True):
    in_range(index, 0, _size(x, dim), f"aten.scatter_reduce, dim {dim}")
    grid = _along(index, dim % max(x.ndim, 1))
    values = source[tuple(slice(0, size) for size in index.shape)]
    identity = {"sum": 0, "mean": 0, "prod": 1, "amax": -jnp().inf, "amin": jnp().inf}.get(reduce)
    if identity is None:
        raise ValueError(f"lower_to_jax: aten.scatter_reduce with reduce={reduce!r}: torch takes sum, prod, mean, amax or amin")
    if reduce in ("amax", "amin") and not jnp().issubdtype(x.dtype, jnp().floating):
        info = jnp().iinfo(x.dtype)
        identity = info.min if reduce == "amax" else info.max
    base = x if include_self else x.at[grid].set(jnp().asarray(identity, x.dtype))
    at = base.at[grid]
    if reduce in ("sum", "mean"):
        total = at.add(values)
        if reduce == "sum":
            return total
        counts = jnp().zeros(x.shape, x.dtype).at[grid].add(1) + (1 if include_self else 0)
        mean = total / jnp().maximum(counts, 1)
        return mean.astype(x.dtype) if jnp().issubdtype(x.dtype, jnp().floating) else jnp().floor_divide(total, jnp().maximum(counts, 1))
    return {"prod": at.multiply, "amax": at.max, "amin": at.min}[reduce](values)


@register(aten.as_strided)
def _as_strided(x, size, stride, storage_offset=None):
    # a jax value has no storage: ``x``'s own elements, in row-major order, stand for it (as
    # for a contiguous tensor, which is what a functionalized graph's base is)
    return jnp().reshape(x, -1)[_strided_positions(size, stride, storage_offset)]


@register(aten.as_strided_scatter)
def _as_strided_scatter(x, source, size, stride, storage_offset=None):
    flat = jnp().reshape(x, -1).at[_strided_positions(size, stride, storage_offset)].set(source)
    return flat.reshape(x.shape)


def _strided_positions(size, stride, storage_offset):
    positions = jnp().asarray(storage_offset or 0)
    for d, (length, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = length
        positions = positions + (jnp().arange(length) * step).reshape(shape)
    return positions


@register(aten.constant_pad_nd)
def _constant_pad_nd(x, pad, value=0):
    # torch: (low, high) pairs from the last dim backwards; negative pads cut
    widths = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        widths[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax().pad(x, jnp().asarray(value, x.dtype), widths)


# ---------------------------------------------------------------- sorting, selection, scans along a dim


@register(aten.sort)
def _sort(x, dim=-1, descending=False, *, stable=False):
    if isinstance(dim, bool):  # sort.stable(x, *, stable, dim=-1, descending=False) traced positionally
        dim = -1
    order = jnp().argsort(x, axis=dim, stable=True, descending=descending)
    return jnp().take_along_axis(x, order, axis=dim), order


@register(aten.argsort)
def _argsort(x, dim=-1, descending=False, *, stable=False):
    return _sort(x, dim, descending)[1]


@register(aten.topk)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    moved = jnp().moveaxis(x, dim, -1)
    values, indices = lax().top_k(moved if largest else -moved, k)
    values = values if largest else -values
    return jnp().moveaxis(values, -1, dim), jnp().moveaxis(indices, -1, dim).astype(_int64())


def _with_indices(reduce: str, arg: str) -> Callable[..., Any]:
    def rule(x, dim=None, keepdim=False):
        if dim is None:  # max.default / min.default: the value only
            return getattr(jnp(), reduce)(x)
        return getattr(jnp(), reduce)(x, axis=dim, keepdims=keepdim), getattr(jnp(), arg)(x, axis=dim, keepdims=keepdim)

    return rule


ATEN[aten.max.dim] = ATEN[aten.max.default] = _with_indices("max", "argmax")
ATEN[aten.min.dim] = ATEN[aten.min.default] = _with_indices("min", "argmin")
ATEN[aten.max.other] = ATEN[aten.maximum]
ATEN[aten.min.other] = ATEN[aten.minimum]


def _cumulative_dtype(x, dtype):
    if dtype is not None:
        return jax_dtype(dtype)
    if not jnp().issubdtype(x.dtype, jnp().inexact):
        return _int64()  # torch: an integer or bool tensor accumulates in int64
    return None


@register(aten.cumsum)
def _cumsum(x, dim, *, dtype=None):
    return jnp().cumsum(x, axis=dim % max(x.ndim, 1), dtype=_cumulative_dtype(x, dtype))


@register(aten.cumprod)
def _cumprod(x, dim, *, dtype=None):
    return jnp().cumprod(x, axis=dim % max(x.ndim, 1), dtype=_cumulative_dtype(x, dtype))


@register(aten.logcumsumexp)
def _logcumsumexp(x, dim):
    return lax().cumlogsumexp(x, axis=dim % max(x.ndim, 1))


def _running(name: str) -> Callable[..., Any]:
    def rule(x, dim):
        dim = dim % max(x.ndim, 1)
        values = getattr(lax(), name)(x, axis=dim)
        # torch's index: the last position holding the running extreme
        positions = lax().broadcasted_iota(_int64(), x.shape, dim)
        return values, lax().cummax(jnp().where(x == values, positions, -1), axis=dim)

    return rule


ATEN[aten.cummax] = _running("cummax")
ATEN[aten.cummin] = _running("cummin")


def _scalar_as_vector(rule: Callable[..., Any]) -> Callable[..., Any]:
    """``rule`` taking a 0-d ``x`` as a vector of one element, its results made 0-d again: torch
    reads dim 0 (or -1) of a 0-d tensor as a dim of size one; jax has no axis there."""

    def scalar_as_vector(x, *args, **kwargs):
        if getattr(x, "ndim", None) != 0:
            return rule(x, *args, **kwargs)
        out = rule(jnp().reshape(x, (1,)), *args, **kwargs)
        return tuple(jnp().reshape(o, ()) for o in out) if isinstance(out, (tuple, list)) else jnp().reshape(out, ())

    return scalar_as_vector


# (the reductions, scans and sorts along a dim; the index ops reading and writing entries along one)
for _op in (aten.sum, aten.mean, aten.prod, aten.amax, aten.amin, aten.argmax, aten.argmin, aten.var, aten.any, aten.all):
    ATEN[_op] = _scalar_as_vector(ATEN[_op])
for _op in (aten.max.dim, aten.min.dim, aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin, aten._softmax, aten._log_softmax, aten.sort):
    ATEN[_op] = _scalar_as_vector(ATEN[_op])
for _op in (aten.index_select, aten.index_add, aten.index_copy):
    ATEN[_op] = _scalar_as_vector(ATEN[_op])


# ---------------------------------------------------------------- Fourier transforms
#
# torch's FFT ops transform over ``dim`` unnormalized and then scale by ``normalization``: 0 none,
# 1 one over the root of the signal's size, 2 one over its size (an inverse transform with the
# default norm is ``normalization=2``).


def _fft_scaled(out: Any, sizes: Any, normalization: int) -> Any:
    n = math.prod(sizes)
    return out if normalization == 0 else out * (1 / math.sqrt(n) if normalization == 1 else 1 / n)


@register(aten._fft_r2c)
def _fft_r2c(x, dim, normalization, onesided):
    axes = tuple(d % x.ndim for d in dim)
    out = jnp().fft.rfftn(x, axes=axes) if onesided else jnp().fft.fftn(x, axes=axes)
    return _fft_scaled(out, [x.shape[d] for d in axes], normalization)


@register(aten._fft_c2c)
def _fft_c2c(x, dim, normalization, forward):
    axes = tuple(d % x.ndim for d in dim)
    out = jnp().fft.fftn(x, axes=axes) if forward else jnp().fft.ifftn(x, axes=axes, norm="forward")
    return _fft_scaled(out, [x.shape[d] for d in axes], normalization)


@register(aten._fft_c2r)
def _fft_c2r(x, dim, normalization, last_dim_size):
    axes = tuple(d % x.ndim for d in dim)
    sizes = [x.shape[d] for d in axes[:-1]] + [last_dim_size]
    return _fft_scaled(jnp().fft.irfftn(x, s=sizes, axes=axes, norm="forward"), sizes, normalization)


# Cosine windows (torch 2.9 does not decompose them): sums of cos(k * 2 pi n / (N - 1)); a periodic
# window is the symmetric one of length + 1 less its last point.


def _cosine_window(length: int, periodic: bool, terms: tuple, kwargs: dict) -> Any:
    dtype = _creation_dtype(kwargs)
    if length <= 1:
        return jnp().ones((length,), dtype)
    angle = 2 * math.pi * jnp().arange(length, dtype=dtype) / (length if periodic else length - 1)
    return sum(c * jnp().cos(k * angle) for k, c in enumerate(terms)).astype(dtype)


@register(aten.hann_window)
def _hann_window(length, periodic=True, **kwargs):
    return _cosine_window(length, periodic, (0.5, -0.5), kwargs)


@register(aten.hamming_window)
def _hamming_window(length, periodic=True, alpha=0.54, beta=0.46, **kwargs):
    return _cosine_window(length, periodic, (alpha, -beta), kwargs)


@register(aten.blackman_window)
def _blackman_window(length, periodic=True, **kwargs):
    return _cosine_window(length, periodic, (0.42, -0.5, 0.08), kwargs)


# ---------------------------------------------------------------- linear algebra
#
# torch's linalg ops as jnp.linalg / jax.scipy.linalg computes them. Where torch also returns an LU
# factorization (det, slogdet, solve: their backwards read it), it is jax's, its pivots 1-based as
# torch's. ``info`` is torch's status, worked out from the factorization (jax has none): the first
# zero on U's diagonal (1-based), else 0; for a Cholesky factor, 1 where jax's is NaN (jax does not
# say which minor failed). ``_linalg_check_errors`` raises on it as torch does (``factored``).


def _mT(x: Any) -> Any:
    return jnp().swapaxes(x, -1, -2)


def _lu(a: Any) -> tuple:
    import jax.scipy.linalg

    lu, pivots = jax.scipy.linalg.lu_factor(a)
    return lu, (pivots + 1).astype(jnp().int32)


def _lu_info(lu: Any) -> Any:
    zero = jnp().diagonal(lu, axis1=-2, axis2=-1) == 0
    if zero.shape[-1] == 0:  # (an empty matrix factors)
        return jnp().zeros(zero.shape[:-1], jnp().int32)
    return jnp().where(zero.any(-1), jnp().argmax(zero, -1) + 1, 0).astype(jnp().int32)


@register(aten._linalg_check_errors)
def _linalg_check_errors(info, api_name, *, is_matrix):
    factored(info, api_name)
    return None


@register(aten.linalg_inv_ex)
def _linalg_inv_ex(a, *, check_errors=False):
    # (the inverse solved from the factors its status is read from: one factorization)
    lu, pivots = _lu(a)
    return _lu_solve(lu, pivots, jnp().eye(a.shape[-1], dtype=a.dtype), 0), _lu_info(lu)


@register(aten.linalg_cholesky_ex)
def _linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    lower = jnp().linalg.cholesky(a)
    info = jnp().isnan(lower).any((-2, -1)).astype(jnp().int32)
    return (jnp().conj(jnp().swapaxes(lower, -1, -2)) if upper else lower), info


# det and slogdet return the LU factors of A's transpose, as torch's do (their backwards solve with
# them), and are read from those factors (det(A) = det(A^T)): the product of U's diagonal, its sign
# flipped by each row swap.
def _signed_diagonal(lu: Any, pivots: Any) -> tuple:
    """(the sign the row swaps give, U's diagonal) of an LU factorization with 1-based pivots."""
    swaps = jnp().sum(pivots != jnp().arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), -1)
    return jnp().where(swaps % 2 == 1, -1, 1).astype(lu.dtype), jnp().diagonal(lu, axis1=-2, axis2=-1)


@register(aten._linalg_det)
def _linalg_det(a):
    lu, pivots = _lu(_mT(a))
    parity, diagonal = _signed_diagonal(lu, pivots)
    return parity * jnp().prod(diagonal, -1), lu, pivots


@register(aten._linalg_slogdet)
def _linalg_slogdet(a):
    lu, pivots = _lu(_mT(a))
    parity, diagonal = _signed_diagonal(lu, pivots)
    size = jnp().abs(diagonal)
    signs = jnp().where(size == 0, 0, diagonal / jnp().where(size == 0, 1, size))
    return parity * jnp().prod(signs, -1), jnp().sum(jnp().log(size), -1), lu, pivots


@register(aten.linalg_lu_factor_ex)
def _linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, pivots = _lu(a)
    return lu, pivots, _lu_info(lu)


@register(aten.linalg_lu_solve)
def _linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    if left:  # A X = B (A^H X = B)
        return _lu_solve(lu, pivots, b, 2 if adjoint else 0)
    # X A = B is A^T X^T = B^T; X A^H = B is A X^H = B^H
    if adjoint:
        return jnp().conj(_mT(_lu_solve(lu, pivots, jnp().conj(_mT(b)), 0)))
    return _mT(_lu_solve(lu, pivots, _mT(b), 1))


def _lu_solve(lu: Any, pivots: Any, b: Any, trans: int) -> Any:
    """jax's LU solve, the batch dims of the factors and of ``b`` broadcast together, as torch's."""
    import jax.scipy.linalg

    batch = jnp().broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu, pivots = jnp().broadcast_to(lu, batch + lu.shape[-2:]), jnp().broadcast_to(pivots, batch + pivots.shape[-1:])
    return jax.scipy.linalg.lu_solve((lu, pivots.astype(jnp().int32) - 1), jnp().broadcast_to(b, batch + b.shape[-2:]), trans=trans)


@register(aten.lu_unpack)
def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    import jax

    m, n = lu.shape[-2:]
    k = min(m, n)
    # torch's P: A = P L U. jax's permutation lists the rows of A that L U's rows are.
    order = jax.lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp().int32) - 1, m)
    permutation = jnp().swapaxes(jax.nn.one_hot(order, m, dtype=lu.dtype), -1, -2)
    lower = jnp().tril(lu[..., :, :k], -1) + jnp().eye(m, k, dtype=lu.dtype)
    upper = jnp().triu(lu[..., :k, :])
    empty = jnp().zeros((0,), lu.dtype)
    return (permutation if unpack_pivots else empty), (lower if unpack_data else empty), (upper if unpack_data else empty)


@register(aten._linalg_solve_ex)
def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    from hops.lowering import SOLVE_RETURNS_TRANSPOSED_FACTORS

    # (torch 2.9's backward reads the factors of A's transpose for a real A: solved with them, as
    # the adjoint's, so one factorization serves)
    transposed = SOLVE_RETURNS_TRANSPOSED_FACTORS and not jnp().iscomplexobj(a)
    lu, pivots = _lu(_mT(a) if transposed else a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])  # (torch's reading: B (a batch of) vectors)
    x = _linalg_lu_solve(lu, pivots, b[..., None] if vector else b, left=left, adjoint=transposed)
    return (x[..., 0] if vector else x), lu, pivots, _lu_info(lu)


@register(aten.linalg_solve_triangular)
def _linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    import jax.scipy.linalg

    if left:
        return jax.scipy.linalg.solve_triangular(a, b, lower=not upper, unit_diagonal=unitriangular)
    # X A = B is A^T X^T = B^T
    return _mT(jax.scipy.linalg.solve_triangular(a, _mT(b), lower=not upper, unit_diagonal=unitriangular, trans=1))


@register(aten.linalg_pinv)
def _linalg_pinv(a, atol=None, rtol=None, hermitian=False):
    # torch's cutoff: singular values at most max(atol, rtol * the largest) count as zero; rtol is
    # eps * max(m, n) where neither is given, 0 where only atol is
    if rtol is None:
        rtol = 0.0 if atol is not None else float(jnp().finfo(a.dtype).eps) * max(a.shape[-2:])
    if hermitian:
        values, vectors = jnp().linalg.eigh(a, UPLO="L", symmetrize_input=False)  # (its lower triangle, as torch reads it)
        singular = jnp().abs(values)
    else:
        left, singular, right = jnp().linalg.svd(a, full_matrices=False)
    largest = singular.max(-1, keepdims=True, initial=0.0)
    cutoff = jnp().maximum(jnp().asarray(0.0 if atol is None else atol)[..., None], jnp().asarray(rtol)[..., None] * largest)
    if hermitian:
        inverted = jnp().where(singular > cutoff, 1 / jnp().where(singular > cutoff, values, 1), 0)
        return (vectors * inverted[..., None, :]) @ jnp().conj(_mT(vectors))
    inverted = jnp().where(singular > cutoff, 1 / jnp().where(singular > cutoff, singular, 1), 0)
    return (jnp().conj(_mT(right)) * inverted[..., None, :]) @ jnp().conj(_mT(left))


@register(aten._linalg_eigh)
def _linalg_eigh(a, UPLO="L", compute_v=True):
    values, vectors = jnp().linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return values, (vectors if compute_v else jnp().zeros((0,), a.dtype))


@register(aten._linalg_svd)
def _linalg_svd(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        empty = jnp().zeros((0,), a.dtype)
        return empty, jnp().linalg.svd(a, compute_uv=False), empty
    return tuple(jnp().linalg.svd(a, full_matrices=full_matrices))


@register(aten.linalg_qr)
def _linalg_qr(a, mode="reduced"):
    if mode == "r":
        return jnp().zeros((0,), a.dtype), jnp().linalg.qr(a, mode="r")
    return tuple(jnp().linalg.qr(a, mode=mode))


# ---------------------------------------------------------------- convolution


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    spatial = x.ndim - 2
    stride, padding, dilation = (tuple(v) * (spatial if len(v) == 1 else 1) for v in (stride, padding, dilation))
    letters = "DHW"[-spatial:] if spatial <= 3 else None
    if letters is None:
        raise NotImplementedError(f"lower_to_jax: aten.convolution over {spatial} spatial dims has no rule")
    numbers = ("NC" + letters, "OI" + letters, "NC" + letters)

    if not transposed:
        out = lax().conv_general_dilated(
            x, weight, stride, [(p, p) for p in padding], rhs_dilation=dilation, dimension_numbers=numbers, feature_group_count=groups
        )
    else:
        # A transposed convolution as a forward one over ``x`` dilated by the stride, with the
        # kernel flipped and its in / out swapped within each group (torch's layout for it is
        # (in, out / groups, k...)), padded by d (k - 1) - p, plus the output padding at the end.
        # (Not as the forward convolution's transpose: with an output padding past the stride,
        # torch allows it below the dilation, the forward one does not reach the rows it adds.)
        output_padding = tuple(output_padding) * (spatial if len(output_padding) == 1 else 1)
        k = weight.shape[2:]
        kernel = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
        kernel = jnp().swapaxes(kernel, 1, 2).reshape(weight.shape[1] * groups, weight.shape[0] // groups, *k)
        kernel = jnp().flip(kernel, axis=tuple(range(2, 2 + spatial)))
        pads = [(d * (n - 1) - p, d * (n - 1) - p + o) for n, p, d, o in zip(k, padding, dilation, output_padding)]
        out = lax().conv_general_dilated(
            x, kernel, (1,) * spatial, pads, lhs_dilation=stride, rhs_dilation=dilation, dimension_numbers=numbers, feature_group_count=groups
        )
    if bias is not None:
        out = out + bias.reshape((-1,) + (1,) * spatial)
    return out


register(aten.convolution)(_convolution)


@register(aten.convolution_backward)
def _convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    import jax

    _, vjp = jax.vjp(lambda y, w: _convolution(y, w, None, stride, padding, dilation, transposed, output_padding, groups), x, weight)
    grad_x, grad_w = vjp(grad)
    grad_b = grad.sum(axis=(0, *range(2, grad.ndim))) if bias_sizes is not None else None
    return tuple(g if wanted else None for g, wanted in zip((grad_x, grad_w, grad_b), output_mask))


# ---------------------------------------------------------------- pooling
#
# The ops torch's pooling modules reach ATen as (``max_pool1d`` / ``avg_pool1d`` /
# ``adaptive_*_pool1d`` are torch's compositions of the 2-d ops on an unsqueezed input). The
# pooled dims are the last ``spatial`` ones; any dims before them (batch, channels, or channels
# alone) are planes pooled alike. A max pool's indices are torch's: the flat index of the chosen
# element within its input plane, the first of equal maxima in the window's row-major order, the
# last NaN if the window holds one; the backward ops scatter the gradient to those indices, and
# ``jax.grad`` of a lowered forward does the same (the value is gathered at the index).


def _pool_sizes(value: Any, spatial: int, default: Any = None) -> tuple[int, ...]:
    """A pooling op's size argument, one int per pooled dim (torch takes one for all; an empty
    ``stride`` means the kernel's)."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return default
    values = (value,) if isinstance(value, int) else tuple(value)
    return values * spatial if len(values) == 1 else values


def _pooled_length(length: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """torch's output length of a pooled dim: with ``ceil_mode`` the last window may overhang the
    end, but must start inside the input or its left padding."""
    extent = dilation * (kernel - 1) + 1
    span = length + 2 * pad - extent + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= length + pad:
        out -= 1
    return out


def _pool_geometry(x: Any, spatial: int, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool) -> tuple:
    kernel = _pool_sizes(kernel_size, spatial)
    stride = _pool_sizes(stride, spatial, kernel)
    padding = _pool_sizes(padding, spatial, (0,) * spatial)
    dilation = _pool_sizes(dilation, spatial, (1,) * spatial)
    lengths = tuple(x.shape[x.ndim - spatial :])
    out = tuple(_pooled_length(n, k, s, p, d, ceil_mode) for n, k, s, p, d in zip(lengths, kernel, stride, padding, dilation))
    # the padding that makes the last window end where it ends (negative: it cuts)
    high = tuple((o - 1) * s + d * (k - 1) + 1 - n - p for o, s, d, k, n, p in zip(out, stride, dilation, kernel, lengths, padding))
    return kernel, stride, padding, dilation, lengths, out, high


def _windows(x: Any, spatial: int, init: Any, computation: Callable[..., Any], kernel, stride, dilation, low, high) -> Any:
    """``lax.reduce_window`` of ``x`` (an array or a tuple of them) over the last ``spatial``
    dims, padded with ``init`` by ``low`` before and ``high`` after (negative: cut)."""
    import numpy

    lead = x[0].ndim - spatial if isinstance(x, tuple) else x.ndim - spatial
    widths = [(0, 0, 0)] * lead + [(lo, hi, 0) for lo, hi in zip(low, high)]
    # (initial values as numpy's, known when traced: jax differentiates a sum's reduce_window
    # only when it sees its initial value is 0)
    if isinstance(x, tuple):
        init = tuple(numpy.array(i, v.dtype) for v, i in zip(x, init))
        padded = tuple(lax().pad(v, i, widths) for v, i in zip(x, init))
    else:
        init = numpy.array(init, x.dtype)
        padded = lax().pad(x, init, widths)
    ones = (1,) * lead
    return lax().reduce_window(padded, init, computation, ones + tuple(kernel), ones + tuple(stride), "VALID", window_dilation=ones + tuple(dilation))


def _lowest(dtype: Any) -> Any:
    return -jnp().inf if jnp().issubdtype(dtype, jnp().inexact) else jnp().iinfo(dtype).min


def _plane_positions(x: Any, spatial: int) -> Any:
    """Each element's flat index within its plane (the last ``spatial`` dims), in jax's default int."""
    plane = x.shape[x.ndim - spatial :]
    return jnp().broadcast_to(jnp().arange(math.prod(plane)).reshape(plane), x.shape)


def _better(a: tuple, b: tuple) -> tuple:
    """The element torch's max pool keeps of two (value, index) pairs: a NaN over any number (of
    two NaNs, the later), else the larger value (of equals, the earlier). A total order, so the
    reduction's order does not matter."""
    (va, ia), (vb, ib) = a, b
    if jnp().issubdtype(va.dtype, jnp().inexact):
        nan_a, nan_b = jnp().isnan(va), jnp().isnan(vb)
        take_a = jnp().where(nan_a | nan_b, nan_a & (~nan_b | (ia > ib)), (va > vb) | ((va == vb) & (ia < ib)))
    else:
        take_a = (va > vb) | ((va == vb) & (ia < ib))
    return jnp().where(take_a, va, vb), jnp().where(take_a, ia, ib)


def _gather_planes(x: Any, spatial: int, indices: Any) -> Any:
    """``x``'s elements at ``indices`` (flat indices within each plane; ``indices`` has ``x``'s
    leading dims and any pooled shape)."""
    lead = x.shape[: x.ndim - spatial]
    flat = x.reshape(*lead, -1)
    picked = jnp().take_along_axis(flat, indices.reshape(*lead, -1), axis=-1)
    return picked.reshape(indices.shape)


def _scatter_planes(grad: Any, x: Any, spatial: int, indices: Any) -> Any:
    """The gradient of ``_gather_planes``: ``grad`` added into a zero ``x`` at ``indices``."""
    lead = x.shape[: x.ndim - spatial]
    rows = math.prod(lead)
    flat = jnp().zeros((rows, math.prod(x.shape[x.ndim - spatial :])), grad.dtype)
    at = indices.reshape(rows, -1)
    flat = flat.at[jnp().arange(rows)[:, None], at].add(grad.reshape(rows, -1))
    return flat.reshape(x.shape)


def _max_pool_with_indices(spatial: int) -> Callable[..., Any]:
    def rule(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        kernel, stride, padding, dilation, lengths, out, high = _pool_geometry(x, spatial, kernel_size, stride, padding, dilation, ceil_mode)
        import jax

        values = jax.lax.stop_gradient(x)
        beyond = math.prod(lengths)  # a padded position's index: loses every tie to a real element
        _, indices = _windows(
            (values, _plane_positions(x, spatial)), spatial, (_lowest(x.dtype), beyond), _better, kernel, stride, dilation, padding, high
        )
        return _gather_planes(x, spatial, indices), indices

    return rule


def _max_pool_backward(spatial: int) -> Callable[..., Any]:
    def rule(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _scatter_planes(grad, x, spatial, indices)

    return rule


def _adaptive_max_pool_backward(spatial: int) -> Callable[..., Any]:
    def rule(grad, x, indices):
        return _scatter_planes(grad, x, spatial, indices)

    return rule


for _spatial, (_forward, _backward) in {
    2: (aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward),
    3: (aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward),
}.items():
    ATEN[_forward] = _max_pool_with_indices(_spatial)
    ATEN[_backward] = _max_pool_backward(_spatial)


def _max_unpool(spatial: int) -> Callable[..., Any]:
    def rule(x, indices, output_size, *stride_and_padding):
        # Each value written at its flat index within its output plane, zeros elsewhere (not
        # torch's decomposition: it checks that the indices are int64, which jax's are not
        # without x64). torch raises on an index outside the plane (``in_range``; elsewhere jax
        # drops it). Of repeated indices torch keeps either value (nondeterministic), as jax does.
        in_range(indices, 0, math.prod(output_size), f"aten.max_unpool{spatial}d")
        lead = x.shape[: x.ndim - spatial]
        rows = math.prod(lead)
        flat = jnp().zeros((rows, math.prod(output_size)), x.dtype)
        flat = flat.at[jnp().arange(rows)[:, None], indices.reshape(rows, -1)].set(x.reshape(rows, -1), mode="drop")
        return flat.reshape(*lead, *output_size)

    return rule


ATEN[aten.max_unpool2d] = _max_unpool(2)
ATEN[aten.max_unpool3d] = _max_unpool(3)


def _avg_pool(spatial: int) -> Callable[..., Any]:
    def rule(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
        import numpy

        kernel, stride, padding, _, lengths, out, high = _pool_geometry(x, spatial, kernel_size, stride, padding, 1, ceil_mode)
        total = _windows(x, spatial, 0, lax().add, kernel, stride, (1,) * spatial, padding, high)
        if divisor_override:
            return _pool_divide(total, numpy.asarray(divisor_override))
        # torch's divisor, per window: the window clipped to the padded input (count_include_pad)
        # or to the input; separable, so one count per pooled dim, multiplied out
        divisor = numpy.ones((), numpy.float64)
        for o, k, s, p, n in zip(out, kernel, stride, padding, lengths):
            start = numpy.arange(o) * s - p
            end = numpy.minimum(start + k, n + p)
            count = end - start if count_include_pad else numpy.minimum(end, n) - numpy.maximum(start, 0)
            divisor = numpy.multiply.outer(divisor, count)
        return _pool_divide(total, divisor)

    return rule


def _pool_divide(total: Any, divisor: Any) -> Any:
    """A window's sum over its divisor, as torch divides: an integer sum in integers, rounding
    toward zero (a float32 quotient would lose the digits past 2**24 and round them)."""
    divisor = jnp().broadcast_to(jnp().asarray(divisor, total.dtype), total.shape)
    if jnp().issubdtype(total.dtype, jnp().integer):
        return lax().div(total, divisor)
    return total / divisor


def _avg_pool_backward(spatial: int) -> Callable[..., Any]:
    def rule(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
        import jax

        forward = _avg_pool(spatial)
        return jax.vjp(lambda v: forward(v, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override), x)[1](grad)[0]

    return rule


for _spatial, (_forward, _backward) in {
    2: (aten.avg_pool2d, aten.avg_pool2d_backward),
    3: (aten.avg_pool3d, aten.avg_pool3d_backward),
}.items():
    ATEN[_forward] = _avg_pool(_spatial)
    ATEN[_backward] = _avg_pool_backward(_spatial)


def _adaptive_windows(length: int, out: int) -> tuple[Any, Any]:
    """torch's adaptive windows of a dim: output i pools [floor(i n / o), ceil((i + 1) n / o))."""
    import numpy

    i = numpy.arange(out)
    return (i * length) // out, -((-(i + 1) * length) // out)


def _adaptive_avg_pool(spatial: int) -> Callable[..., Any]:
    def rule(x, output_size):
        import numpy

        # one averaging matrix per pooled dim (the windows overlap and differ in size)
        for d, o in enumerate(_pool_sizes(output_size, spatial)):
            axis = x.ndim - spatial + d
            n = x.shape[axis]
            start, end = _adaptive_windows(n, o)
            j = numpy.arange(n)
            weights = ((j >= start[:, None]) & (j < end[:, None])) / (end - start)[:, None]
            x = jnp().moveaxis(jnp().tensordot(x, jnp().asarray(weights.T, x.dtype), axes=[[axis], [0]]), -1, axis)
        return x

    return rule


def _adaptive_avg_pool_backward(spatial: int) -> Callable[..., Any]:
    def rule(grad, x):
        import jax

        return jax.vjp(lambda v: _adaptive_avg_pool(spatial)(v, grad.shape[grad.ndim - spatial :]), x)[1](grad)[0]

    return rule


for _spatial, (_forward, _backward) in {
    2: (aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward),
    3: (aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward),
}.items():
    ATEN[_forward] = _adaptive_avg_pool(_spatial)
    ATEN[_backward] = _adaptive_avg_pool_backward(_spatial)


def _adaptive_max_pool(spatial: int) -> Callable[..., Any]:
    def rule(x, output_size):
        import numpy

        # Each output's window, padded to the longest by repeating its last element (a repeat
        # never wins a tie: it comes later), gathered as a trailing window dim per pooled dim.
        lead = x.ndim - spatial
        flat_index = numpy.zeros((), numpy.int64)
        shape_out = []
        for d, o in enumerate(_pool_sizes(output_size, spatial)):
            n = x.shape[lead + d]
            start, end = _adaptive_windows(n, o)
            positions = numpy.minimum(start[:, None] + numpy.arange((end - start).max()), end[:, None] - 1)
            # this dim's (output, window) axes next to the earlier dims'
            flat_index = flat_index[..., None, None] * n + positions.reshape((1,) * flat_index.ndim + positions.shape)
            shape_out.append(o)
        # (o0, k0, o1, k1, ...) -> (o0, o1, ..., k0 k1 ...): the window in row-major order
        order = [2 * d for d in range(spatial)] + [2 * d + 1 for d in range(spatial)]
        return _max_of_windows(x, spatial, flat_index.transpose(order).reshape(*shape_out, -1))

    return rule


def _max_of_windows(x: Any, spatial: int, candidates: Any) -> tuple[Any, Any]:
    """The max of each window of ``x`` and its index, torch's (the first of equal maxima, the
    last NaN): ``candidates`` holds each window's flat indices within the plane, in row-major
    order, in a last dim after the pooled shape (with or without ``x``'s leading dims)."""
    import jax

    lead = x.shape[: x.ndim - spatial]
    indices = jnp().broadcast_to(jnp().asarray(candidates), (*lead, *candidates.shape[candidates.ndim - spatial - 1 :]))
    values = _gather_planes(jax.lax.stop_gradient(x), spatial, indices)
    if jnp().issubdtype(x.dtype, jnp().inexact):
        nan = jnp().isnan(values)
        last_nan = jnp().argmax(jnp().where(nan, indices, -1), axis=-1)
        chosen = jnp().where(nan.any(axis=-1), last_nan, jnp().argmax(jnp().where(nan, _lowest(x.dtype), values), axis=-1))
    else:
        chosen = jnp().argmax(values, axis=-1)
    index = jnp().take_along_axis(indices, chosen[..., None], axis=-1)[..., 0]
    return _gather_planes(x, spatial, index), index


for _spatial, (_forward, _backward) in {
    2: (aten.adaptive_max_pool2d, aten.adaptive_max_pool2d_backward),
    3: (aten.adaptive_max_pool3d, aten.adaptive_max_pool3d_backward),
}.items():
    ATEN[_forward] = _adaptive_max_pool(_spatial)
    ATEN[_backward] = _adaptive_max_pool_backward(_spatial)


def _fractional_starts(samples: Any, length: int, out: int, kernel: int) -> Any:
    """torch's fractional windows of a dim, one sample ``u`` per plane: output ``i`` starts at
    ``trunc((i + u) a) - trunc(u a)`` with ``a = (n - k) / (o - 1)``, the last at ``n - k``;
    worked in the samples' dtype, as torch's CPU kernels do (the truncations make any other
    rounding pick other windows: float64 samples, float32 without x64, did in 12 of 287 random
    cases)."""
    import numpy

    dtype = samples.dtype
    i = numpy.arange(out)
    alpha = jnp().asarray(length - kernel, dtype) / jnp().asarray(max(out - 1, 1), dtype)
    u = samples[..., None]
    starts = jnp().trunc((jnp().asarray(i, dtype) + u) * alpha) - jnp().trunc(u * alpha)
    return jnp().where(i < out - 1, starts.astype(jnp().int32), length - kernel)


# Which of a plane's samples each pooled dim's windows take: torch's 2-d kernels list them
# width first, its 3-d ones depth first (measured against eager's indices).
_SAMPLE_ORDER = {2: (1, 0), 3: (0, 1, 2)}


def _fractional_max_pool(spatial: int) -> Callable[..., Any]:
    def rule(x, kernel_size, output_size, random_samples):
        # Each plane's windows start where its samples say (samples a caller did not give are
        # drawn by an aten.rand before this op: from the random key); a window's elements by
        # flat index, as the adaptive pool's.
        lead = x.shape[: x.ndim - spatial]
        samples = random_samples.reshape(*lead, spatial)  # (a plane without batch: samples (1, C, spatial))
        kernel, out = _pool_sizes(kernel_size, spatial), _pool_sizes(output_size, spatial)
        lengths = x.shape[x.ndim - spatial :]
        flat_index = jnp().zeros((*lead,) + (1, 1) * spatial, jnp().int32)
        for d, (n, k, o) in enumerate(zip(lengths, kernel, out)):
            positions = _fractional_starts(samples[..., _SAMPLE_ORDER[spatial][d]], n, o, k)[..., None] + jnp().arange(k)
            # this dim's (output, window) axes, after the earlier dims'
            shape = (*lead,) + (1, 1) * d + (o, k) + (1, 1) * (spatial - 1 - d)
            flat_index = flat_index * n + positions.reshape(shape)
        order = [*range(len(lead))] + [len(lead) + 2 * d for d in range(spatial)] + [len(lead) + 2 * d + 1 for d in range(spatial)]
        return _max_of_windows(x, spatial, flat_index.transpose(order).reshape(*lead, *out, -1))

    return rule


def _fractional_max_pool_backward(spatial: int) -> Callable[..., Any]:
    def rule(grad, x, kernel_size, output_size, indices):
        return _scatter_planes(grad, x, spatial, indices)

    return rule


for _spatial, (_forward, _backward) in {
    2: (aten.fractional_max_pool2d, aten.fractional_max_pool2d_backward),
    3: (aten.fractional_max_pool3d, aten.fractional_max_pool3d_backward),
}.items():
    ATEN[_forward] = _fractional_max_pool(_spatial)
    ATEN[_backward] = _fractional_max_pool_backward(_spatial)

# ---------------------------------------------------------------- checks and storage-less creation


@register(aten._assert_scalar, aten.sym_constrain_range, aten.sym_constrain_range_for_size, aten._assert_tensor_metadata)
def _check(*args, **kwargs):
    return None  # a check of sizes and metadata: in a jax program they are fixed when it is traced


@register(aten._assert_async)
def _assert_async(condition, message="Expected Tensor with single nonzero value, but got zero"):
    # a tensor condition (Dynamo's reading of a Python ``assert``): raised after the call under
    # hops_jax (``holds``), as torch raises
    holds(condition, message)
    return None


@register(aten.empty_strided)
def _empty_strided(size, stride, **kwargs):
    return jnp().zeros(tuple(size), _creation_dtype(kwargs))


@register(aten.new_empty_strided)
def _new_empty_strided(x, size, stride, **kwargs):
    return jnp().zeros(tuple(size), _creation_dtype(kwargs, x.dtype))


@register(aten.diagonal)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp().diagonal(x, offset, dim1 % x.ndim, dim2 % x.ndim)


def _diagonal_positions(length: int, offset: int) -> tuple:
    """(rows, columns) of the ``length`` elements of a matrix's diagonal at ``offset``."""
    steps = jnp().arange(length)
    return steps + max(-offset, 0), steps + max(offset, 0)


@register(aten.diagonal_scatter)
def _diagonal_scatter(x, source, offset=0, dim1=0, dim2=1):
    moved = jnp().moveaxis(x, (dim1 % x.ndim, dim2 % x.ndim), (-2, -1))
    rows, columns = _diagonal_positions(source.shape[-1], offset)
    return jnp().moveaxis(moved.at[..., rows, columns].set(source), (-2, -1), (dim1 % x.ndim, dim2 % x.ndim))


@register(aten.diag_embed)
def _diag_embed(x, offset=0, dim1=-2, dim2=-1):
    size = x.shape[-1] + abs(offset)
    rows, columns = _diagonal_positions(x.shape[-1], offset)
    out = jnp().zeros((*x.shape[:-1], size, size), x.dtype).at[..., rows, columns].set(x)
    return jnp().moveaxis(out, (-2, -1), (dim1 % out.ndim, dim2 % out.ndim))


@register(aten.diagonal_backward)
def _diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    import jax

    return jax.vjp(lambda x: _diagonal(x, offset, dim1, dim2), jnp().zeros(tuple(input_sizes), grad.dtype))[1](grad)[0]


# ---------------------------------------------------------------- random ops

# The keys random ops draw from, innermost last (``random_key``); each cell holds the key the
# next draw splits.
_KEYS: list[list[Any]] = []


class random_key:
    """``with random_key(key):`` random ops of lowered graphs run inside draw from ``key`` (a
    ``jax.random.key``), each from a fresh split of it, as a JAX function takes its key: torch's
    generator is not jax's. Backend ``"hops_jax"`` draws each call's key from torch's generator
    (``torch.manual_seed`` reproduces a run); a scan gives each step a key of its own."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __enter__(self) -> None:
        _KEYS.append([self.key])

    def __exit__(self, *exc: Any) -> None:
        _KEYS.pop()


def is_random(op: Any) -> bool:
    """Whether ``op`` is an ATen op that draws random numbers."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def has_key() -> bool:
    return bool(_KEYS)


def split_key(count: int) -> Any:
    """``count`` fresh keys from the active one (for a scan's steps)."""
    import jax

    cell = _KEYS[-1]
    keys = jax.random.split(cell[0], count + 1)
    cell[0] = keys[0]
    return keys[1:]


def _next_key(op: Any) -> Any:
    if not _KEYS:
        raise NoJaxRule(
            f"lower_to_jax: {op} draws random numbers: run the lowered function inside "
            "passes.jax.random_key(jax.random.key(seed)) (backend 'hops_jax' does, with a seed from torch's generator)",
            op,
        )
    return split_key(1)[0]


def _uniform(op: Any, shape: Any, dtype: Any) -> Any:
    import jax

    return jax.random.uniform(_next_key(op), tuple(shape), dtype)


@register(aten.native_dropout)
def _native_dropout(x, p, train):
    if train is False or p == 0:
        return x, jnp().ones(x.shape, bool)
    if p >= 1:
        return jnp().zeros_like(x), jnp().zeros(x.shape, bool)
    keep = _uniform(aten.native_dropout, x.shape, jnp().float32) >= p
    return jnp().where(keep, x * (1.0 / (1.0 - p)), 0).astype(x.dtype), keep


@register(aten.native_dropout_backward)
def _native_dropout_backward(grad, mask, scale):
    return (grad * mask * scale).astype(grad.dtype)


@register(aten.bernoulli.p, aten.bernoulli_.float)
def _bernoulli_p(x, p=0.5, **kwargs):
    return (_uniform(aten.bernoulli, x.shape, jnp().float32) < p).astype(x.dtype)


@register(aten.bernoulli.default)
def _bernoulli(probabilities, **kwargs):
    return (_uniform(aten.bernoulli, probabilities.shape, jnp().float32) < probabilities).astype(probabilities.dtype)


@register(aten.rand)
def _rand(size, **kwargs):
    return _uniform(aten.rand, size, _creation_dtype(kwargs))


@register(aten.rand_like)
def _rand_like(x, **kwargs):
    return _uniform(aten.rand_like, x.shape, _creation_dtype(kwargs, x.dtype))


@register(aten.randint)
def _randint(*args, **kwargs):
    # randint(high, size) / randint.low(low, high, size)
    low, high, size = (0, *args) if len(args) == 2 else args
    return _integers(aten.randint, tuple(size), low, high, _creation_dtype(kwargs, _int64()))


@register(aten.randint_like)
def _randint_like(x, *args, **kwargs):
    # randint_like(x, high) / randint_like.low_dtype(x, low, high)
    low, high = (0, *args) if len(args) == 1 else args
    return _integers(aten.randint_like, x.shape, low, high, _creation_dtype(kwargs, x.dtype))


def _integers(op: Any, shape: tuple, low: Any, high: Any, dtype: Any) -> Any:
    """Integers uniform in ``[low, high)`` of ``dtype`` (drawn as int64 where it is a float's, as torch's are)."""
    import jax

    drawn = dtype if jnp().issubdtype(dtype, jnp().integer) else _int64()
    return jax.random.randint(_next_key(op), shape, low, high, drawn).astype(dtype)


@register(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor)
def _normal(mean, std=1.0, **kwargs):
    import jax

    shape = jnp().broadcast_shapes(jnp().shape(mean), jnp().shape(std))
    dtype = jnp().result_type(mean, std) if hasattr(mean, "dtype") or hasattr(std, "dtype") else jnp().float32
    return mean + std * jax.random.normal(_next_key(aten.normal), shape, dtype)


@register(aten.normal.float_float)
def _normal_of_size(mean, std, size, **kwargs):
    import jax

    return mean + std * jax.random.normal(_next_key(aten.normal), tuple(size), _creation_dtype(kwargs))


@register(aten.randn)
def _randn(size, **kwargs):
    import jax

    return jax.random.normal(_next_key(aten.randn), tuple(size), _creation_dtype(kwargs))


@register(aten.randn_like)
def _randn_like(x, **kwargs):
    import jax

    return jax.random.normal(_next_key(aten.randn_like), x.shape, _creation_dtype(kwargs, x.dtype))
