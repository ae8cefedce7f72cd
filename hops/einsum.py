"""``hops.einsum`` and ``hops.patch_linear``: contractions that stay einsum through tracing.

AOTAutograd decomposes ``torch.einsum`` into permute/view/``bmm``/view, and ``nn.Linear``
into view/``mm``/view: both flatten the non-contracting dims into one, which is exactly the
dim a 2-D sharding needs to keep apart. Here einsum is a kernel (``hops.kernel``):
``hops.einsum("bsd,fd->bsf", x, w)`` emits one node::

    hops_kernel_einsum(x, w, hops.KernelParams.of(equation='bsd,fd->bsf'))

whose backward is again einsum nodes (one per operand that needs a gradient, with the
equation derived from the forward one), and whose XLA lowering is ``aten.einsum``, which
torch_xla compiles to one ``dot`` that keeps every batch dim.

``hops.einsum_linear(x, weight, bias)`` is a linear layer as one kernel with the bias inside
(a separate broadcast add would bring back ``sum``/``view`` in the backward);
``hops.patch_linear(module)`` switches every ``nn.Linear`` in a module to it. Off by default.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from hops._body_hop.subgraph import shares_storage as _shares_storage
from hops._errors import call_prefix
from hops.kernel import kernel

__all__ = ["einsum", "einsum_linear", "patch_linear", "EinsumLinear", "einsum_kernel", "einsum_linear_kernel"]

ELLIPSIS = "..."


# --------------------------------------------------------------------------- equations


def _tokens(subscripts: str) -> list[str]:
    """``'b...ij'`` -> ``['b', '...', 'i', 'j']``."""
    head, sep, tail = subscripts.partition(ELLIPSIS)
    return [*head, *([ELLIPSIS] if sep else []), *tail]


def _check_subscripts(subscripts: str, where: str) -> list[str]:
    if subscripts.count(ELLIPSIS) > 1 or subscripts.replace(ELLIPSIS, "").count(".") > 0:
        raise ValueError(f"{where}: {subscripts!r} may contain '...' at most once and no other '.'")
    tokens = _tokens(subscripts)
    for token in tokens:
        if token != ELLIPSIS and not (token.isascii() and token.isalpha()):
            raise ValueError(f"{where}: {subscripts!r} has {token!r}; subscripts are letters a-z, A-Z and '...'")
    letters = [t for t in tokens if t != ELLIPSIS]
    repeated = sorted({t for t in letters if letters.count(t) > 1})
    if repeated:
        raise ValueError(
            f"{where}: {subscripts!r} repeats {repeated[0]!r} (a diagonal), which hops.einsum does not "
            "support; take torch.diagonal first"
        )
    return tokens


def canonical_equation(equation: Any, operands: Sequence[Any]) -> str:
    """``equation`` in explicit form (``'ij,jk->ik'``, no spaces), checked against the operands.

    Raises ``TypeError``/``ValueError`` naming the operand for a non-str equation, a wrong
    number of subscripts, a subscript count that does not match an operand's rank, a
    repeated subscript in one operand (diagonals), or an output subscript no input has.
    """
    if not isinstance(equation, str):
        raise TypeError(f"einsum: equation must be a str, got {type(equation).__name__} {equation!r}")
    call = call_prefix("einsum", repr(equation))
    text = "".join(equation.split())
    if text.count("->") > 1:
        raise ValueError(f"{call}: the equation has more than one '->'")
    lhs, arrow, rhs = text.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(operands):
        raise ValueError(
            f"{call}: the equation has {len(inputs)} operand subscripts but "
            f"{len(operands)} operands were given"
        )
    for i, (subscripts, operand) in enumerate(zip(inputs, operands)):
        where = f"{call}: operands[{i}]"
        if not isinstance(operand, (torch.Tensor, torch.fx.Proxy)):
            raise TypeError(f"{where} must be a Tensor, got {type(operand).__name__}")
        tokens = _check_subscripts(subscripts, where)
        letters = len(tokens) - (ELLIPSIS in tokens)
        if isinstance(operand, torch.Tensor) and (
            operand.dim() < letters if ELLIPSIS in tokens else operand.dim() != letters
        ):
            raise ValueError(f"{where} has rank {operand.dim()}, but its subscripts {subscripts!r} name {letters} dims")
    input_letters = [t for s in inputs for t in _tokens(s) if t != ELLIPSIS]
    has_ellipsis = any(ELLIPSIS in s for s in inputs)
    if arrow:
        output = _check_subscripts(rhs, f"{call}: the output")
        for token in output:
            if token == ELLIPSIS and not has_ellipsis:
                raise ValueError(f"{call}: the equation has '...' in the output but in no input")
            if token != ELLIPSIS and token not in input_letters:
                raise ValueError(f"{call}: output subscript {token!r} is in no input")
    else:
        once = sorted(t for t in set(input_letters) if input_letters.count(t) == 1)
        rhs = (ELLIPSIS if has_ellipsis else "") + "".join(once)
    return ",".join(inputs) + "->" + rhs


def check_operands(equation: str, operands: Sequence[Any]) -> None:
    """Refuse operands ``torch.einsum`` would refuse deep inside, naming them: a subscript
    letter (or a dim under ``...``, counted from the right) whose sizes differ between
    operands where neither is 1 (``ValueError``), or operands of different dtypes
    (``TypeError``). ``equation`` is canonical (``canonical_equation``); symbolic sizes are
    left to torch."""
    tensors = [(i, o) for i, o in enumerate(operands) if isinstance(o, torch.Tensor)]
    for i, operand in tensors[1:]:
        first, like = tensors[0]
        if operand.dtype != like.dtype:
            raise TypeError(
                f"einsum({equation!r}): operands[{i}] is {operand.dtype} but operands[{first}] is {like.dtype}; "
                "einsum operands must have one dtype (cast one with .to())"
            )
    inputs, _ = _split_equation(equation)
    seen: dict[Any, tuple[int, int]] = {}  # letter, or (ELLIPSIS, dim from the right) -> (operand, size)
    for i, operand in tensors:
        tokens = _tokens(inputs[i])
        named = len(tokens) - (ELLIPSIS in tokens)
        width = operand.dim() - named
        dims: list[tuple[Any, int]] = []
        position = 0
        for token in tokens:
            if token == ELLIPSIS:
                dims += [((ELLIPSIS, width - k), position + k) for k in range(width)]
                position += width
            else:
                dims.append((token, position))
                position += 1
        for key, dim in dims:
            size = operand.shape[dim]
            if not isinstance(size, int):
                continue
            if key not in seen or seen[key][1] == 1:
                seen[key] = (i, size)
                continue
            other, other_size = seen[key]
            if size != other_size and size != 1:
                what = f"subscript {key!r}" if isinstance(key, str) else f"dim {key[1]} from the right under '...'"
                raise ValueError(
                    f"einsum({equation!r}): {what} has size {other_size} in operands[{other}] but {size} in "
                    f"operands[{i}] (dim {dim} of shape {tuple(operand.shape)}); sizes of one subscript must match "
                    "(or be 1, broadcast)"
                )


def _split_equation(equation: str) -> tuple[list[str], str]:
    lhs, _, rhs = equation.partition("->")
    return lhs.split(","), rhs


def operand_gradient_equation(equation: str, k: int) -> tuple[str, list[str]]:
    """The einsum that gives operand ``k``'s gradient: ``(grad, *other operands) -> subscripts``.

    Returns the equation and the subscripts tokens of operand ``k`` that it does not produce
    (named by no other operand and not by the output: the gradient is constant along them).
    """
    inputs, output = _split_equation(equation)
    others = [s for j, s in enumerate(inputs) if j != k]
    named = {t for s in (output, *others) for t in _tokens(s)}
    target = [t for t in _tokens(inputs[k]) if t in named]
    return ",".join([output, *others]) + "->" + "".join(target), [t for t in _tokens(inputs[k]) if t not in named]


def _fit_to_operand(grad: torch.Tensor, operand: torch.Tensor, subscripts: str, target: str) -> torch.Tensor:
    """Shape the gradient ``grad`` (subscripts ``target``) like ``operand`` (``subscripts``):
    sum extra broadcast ellipsis dims and size-1 dims the operand broadcast, insert the dims
    nothing else named (constant gradient) and expand them."""
    tokens, target_tokens = _tokens(subscripts), _tokens(target)
    operand_ellipsis = operand.dim() - (len(tokens) - (ELLIPSIS in tokens))
    if ELLIPSIS in target_tokens:
        grad_ellipsis = grad.dim() - (len(target_tokens) - 1)
        start = target_tokens.index(ELLIPSIS)
        if grad_ellipsis > operand_ellipsis:
            grad = grad.sum(dim=list(range(start, start + grad_ellipsis - operand_ellipsis)))
    position = 0
    for token in tokens:
        width = operand_ellipsis if token == ELLIPSIS else 1
        if token not in target_tokens:
            for _ in range(width):
                grad = grad.unsqueeze(position)
        position += width
    broadcast = [d for d in range(operand.dim()) if operand.shape[d] == 1 and grad.shape[d] != 1]
    if broadcast:
        grad = grad.sum(dim=broadcast, keepdim=True)
    if grad.shape != operand.shape:
        grad = grad.expand(operand.shape)
    return grad


# --------------------------------------------------------------------------- the einsum kernel


def _fresh_einsum(equation: str, operands: Sequence[torch.Tensor]) -> torch.Tensor:
    result = torch.einsum(equation, *operands)
    # One operand may come back as a view of itself ("ij->ji"); a kernel returns new tensors.
    return result.clone() if len(operands) == 1 and _shares_storage(result, operands[0]) else result


def _einsum_shapes(*operands: torch.Tensor, equation: str) -> torch.Tensor:
    return _fresh_einsum(equation, operands)


def _einsum_backward(*values: torch.Tensor, equation: str, needs_input_grad: Sequence[bool]):
    operands, grad = values[: len(needs_input_grad)], values[-1]
    inputs, _ = _split_equation(equation)
    grads = []
    for k, need in enumerate(needs_input_grad):
        if not need:
            grads.append(None)
            continue
        gradient_equation, _ = operand_gradient_equation(equation, k)
        others = [o for j, o in enumerate(operands) if j != k]
        partial = einsum_kernel(grad, *others, equation=gradient_equation)
        grads.append(_fit_to_operand(partial, operands[k], inputs[k], gradient_equation.partition("->")[2]))
    return tuple(grads)


def _einsum(*operands: torch.Tensor, equation: str) -> torch.Tensor:
    """The einsum kernel: ``torch.einsum(equation, *operands)`` as one opaque node."""
    return _fresh_einsum(equation, operands)


def _einsum_jvp(*values: torch.Tensor, equation: str) -> torch.Tensor:
    # Multilinear: the tangent is the sum of the einsums with one operand's tangent each.
    operands, tangents = values[: len(values) // 2], values[len(values) // 2 :]
    terms = [
        einsum_kernel(*operands[:k], tangent, *operands[k + 1 :], equation=equation) for k, tangent in enumerate(tangents)
    ]
    return functools.reduce(torch.add, terms)


einsum_kernel = kernel(_einsum, abstract=_einsum_shapes, backward=_einsum_backward, jvp=_einsum_jvp, name="einsum")
einsum_kernel.hops_transparent = True  # inductor gets torch.einsum (hops/_inductor.py)


def einsum(equation: str, *operands: Any) -> torch.Tensor:
    """``torch.einsum(equation, *operands)`` that every tracer keeps as one einsum node.

    Forward and backward (AOTAutograd, ``torch.compile``, export, inside ``hops.scan``)
    hold ``hops_kernel_einsum`` nodes instead of view/``bmm``/view; lowered to XLA it is one
    ``dot`` that keeps the batch dims. Operands may also be given as one list. Equations
    may use ``...`` and implicit output; a subscript repeated within one operand
    (diagonals) raises ``ValueError``, as do subscripts that do not match the operands
    and a subscript whose sizes differ between operands (neither 1); operands of different
    dtypes raise ``TypeError``. Each error names the operand.
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if (
        torch.compiler.is_dynamo_compiling()
        or not isinstance(equation, str)
        or not all(isinstance(o, torch.Tensor) for o in operands)
    ):
        canonical = canonical_equation(equation, operands)
    else:
        # Eager: an equation is parsed once per operand ranks.
        key = (equation, tuple(o.dim() for o in operands))
        canonical = _CANONICAL.get(key)
        if canonical is None:
            canonical = _CANONICAL[key] = canonical_equation(equation, operands)
    check_operands(canonical, operands)
    return einsum_kernel(*operands, equation=canonical)


_CANONICAL: dict[tuple[Any, tuple[int, ...]], str] = {}


# --------------------------------------------------------------------------- linear


_LINEAR = "...i,oi->...o"


def _linear_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.result_type(x, weight))


def _linear_backward(x, weight, bias, out, grad, *, needs_input_grad):
    need_x, need_weight, need_bias = needs_input_grad
    return (
        einsum_kernel(grad, weight, equation="...o,oi->...i") if need_x else None,
        einsum_kernel(grad, x, equation="...o,...i->oi") if need_weight else None,
        einsum_kernel(grad, equation="...o->o") if need_bias else None,
    )


def _einsum_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + bias`` as one einsum that keeps the leading dims of ``x``."""
    return torch.einsum(_LINEAR, x, weight) + bias


def _linear_jvp(x, weight, bias, tx, tweight, tbias):
    return (
        einsum_kernel(tx, weight, equation=_LINEAR)
        + einsum_kernel(x, tweight, equation=_LINEAR)
        + tbias
    )


einsum_linear_kernel = kernel(
    _einsum_linear, abstract=_linear_shapes, backward=_linear_backward, jvp=_linear_jvp, name="einsum_linear"
)
einsum_linear_kernel.hops_transparent = True


def einsum_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` as einsum: ``hops_kernel_einsum_linear(x, weight, bias)``
    (or ``hops_kernel_einsum`` without bias); its backward is three einsum nodes.

    Raises ``TypeError``/``ValueError`` naming the argument for non-tensors, dtypes that
    differ, a weight that is not 2-D, a bias that is not 1-D of the weight's output size, or mismatched features.
    """
    for argument, value in (("x", x), ("weight", weight), ("bias", bias)):
        if not (value is None and argument == "bias") and not isinstance(value, (torch.Tensor, torch.fx.Proxy)):
            raise TypeError(f"einsum_linear: {argument} must be a Tensor, got {type(value).__name__}")
    if isinstance(weight, torch.Tensor) and weight.dim() != 2:
        raise ValueError(f"einsum_linear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and (x.dim() == 0 or x.shape[-1] != weight.shape[1]):
        raise ValueError(
            f"einsum_linear: x has shape {tuple(x.shape)}, but weight {tuple(weight.shape)} takes "
            f"{weight.shape[1]} input features in the last dim"
        )
    for argument, value in (("weight", weight), ("bias", bias)):
        if isinstance(value, torch.Tensor) and isinstance(x, torch.Tensor) and value.dtype != x.dtype:
            raise TypeError(
                f"einsum_linear: x is {x.dtype} but {argument} is {value.dtype}; x, weight and bias must have one dtype"
            )
    if isinstance(bias, torch.Tensor) and isinstance(weight, torch.Tensor) and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"einsum_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if bias is None:
        return einsum_kernel(x, weight, equation=_LINEAR)
    return einsum_linear_kernel(x, weight, bias)


class EinsumLinear(torch.nn.Linear):
    """An ``nn.Linear`` computing ``hops.einsum_linear``: same parameters and state dict."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return einsum_linear(input, self.weight, self.bias)


def patch_linear(module: torch.nn.Module) -> torch.nn.Module:
    """Make every ``nn.Linear`` in ``module`` (itself included) compute with einsum; in place.

    Each module whose type is exactly ``nn.Linear`` becomes an ``EinsumLinear`` (a subclass:
    parameters, state dict and ``isinstance`` checks are unchanged), so leading dims are never
    flattened and forward and backward graphs hold einsum nodes. Subclasses of ``nn.Linear``
    are left alone (their ``forward`` may differ). Returns ``module``. Undo with
    ``m.__class__ = torch.nn.Linear``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"patch_linear: module must be a torch.nn.Module, got {type(module).__name__}")
    for submodule in module.modules():
        if type(submodule) is torch.nn.Linear:
            submodule.__class__ = EinsumLinear
    return module
