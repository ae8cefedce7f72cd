"""``scan_hop``: ``jax.lax.scan`` over dim 0, whose body keeps every HOP of this package.

``hops.scan(fn, init, xs)`` with ``fn(carry, x) -> (new_carry, y)`` returns
``(final_carry, ys)``: xs are sliced along dim 0, ys stacked along dim 0; carries, xs and ys
are pytrees of tensors (Python numbers become 0-d tensors). torch's ``dim=`` is a movedim of
xs and ys around the call: the node and every lowering scan dim 0. One node is emitted::

    hops_scan(body, *init, *xs, *additional, hops.ScanSpec(num_carry, num_xs, ...))

``body(*carry, *x, *additional)`` returns ``(new_carry, y)`` whose leaves are
``(*new_carry, *y)``. Tensors ``fn`` reads from its closure are lifted into ``additional``
while traced (so they get gradients); Dynamo lifts them itself.

Rules:
- eager: a Python loop (the reference); above autograd its gradients are autograd's own,
  with ``remat`` each step is checkpointed (recomputed in backward with its random draws);
- fake: one step on fake slices, ys stacked;
- functionalization / proxy: the step must not write into its inputs (refused, naming the
  leaf); it is traced once into a subgraph named after the user function;
- traced autograd: one step's joint is traced and split (``hops._body_hop.joint``). The forward scan
  also stacks each step's residuals (with ``remat``, only the carries entering each step and
  the random values), the backward is a reverse ``scan_hop`` over them, so HOPs in the body
  (annotations, local_map regions, kernels, scopes) appear in forward and backward bodies.

``hops.scan`` in detail (its docstring is the contract):

- ys are stacked along dim 0 in slice order, also when ``reverse``. ``dim`` (torch's scan)
  scans xs along ``dim`` instead (negative counts from the first xs leaf's last dim; every xs
  leaf needs it) and stacks each y leaf along ``dim`` where the stacked leaf has it (along
  dim 0 otherwise, as torch's scan does). ``y=None`` gives no ys.
- xs with no tensor leaves: ``xs=None`` needs ``length`` and gives ``x=None`` (JAX and torch
  agree). An empty container (``()``, ``[]``, ``{}``) without ``length`` returns ``(init, [])``
  without calling ``fn``, as torch's scan does (JAX refuses it); with ``length`` the step gets
  ``x=None``, as in torch (``jax.lax.scan`` would pass the empty container itself; a JAX step
  ignoring ``x`` is unaffected).
- A scan of length 0 returns its init and empty ys shaped as one step would give them (the
  step runs on fake tensors only); backward gives zero gradients (xs's shape for xs) to what
  one step's outputs depend on. ``length`` may be a symbolic size (``torch.compile`` with
  ``dynamic=True`` of a function taking it as an int): one graph serves every length.
- Python numbers in ``init`` or returned as carry or y become 0-d tensors. A number in
  ``init`` takes the dtype one step gives it when the step sees the number itself (as JAX's
  weak types do: ``scan(f, 0, int8_xs)`` with ``c + x`` carries int8); a number returned as
  carry keeps its init's dtype, one returned as y gets torch's default dtype.
- ``unroll`` runs that many steps per loop iteration where the scan lowers to a loop
  (``True``: all of them), with the same values; by default (``None``) the lowering chooses
  (XLA and inductor run one step per iteration). ``remat`` recomputes each step in the
  backward instead of saving its activations.
- torch_xla's ``scan(fn, init, xs, partition_fn, is_fn_pure)`` works too:
  ``functorch.compile.min_cut_rematerialization_partition`` as ``partition_fn`` means
  ``remat=True``, ``default_partition`` means saving activations.
- Called eagerly on XLA tensors, the step is traced, split and lowered once and reused by
  later calls whose step has the same code and reads the same Python state (closure,
  defaults, globals: keyed by value, tensors by identity; see ``hops/_body_hop/code_key.py``),
  with inputs of the same shapes, dtypes and ``requires_grad``; a step reading state with no
  key (an object's attributes) is traced on every call, and so is every step with
  ``is_fn_pure=False``.
- Errors name the leaf by its key path in the argument (``xs['a']``, ``init[1]``; tensors on
  different devices raise ``hops.DeviceMismatchError``); a carry changing shape, dtype or
  structure raises ``TypeError``, as in JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hops import _compat, _dynamo, _inductor
from hops._body_hop.autograd import AutogradPlan
from hops._body_hop.base import BodyHOP
from hops._body_hop.body import at_boundary, run_on_stand_ins
from hops._body_hop.body_record import plan_body, set_trace_key
from hops._body_hop.caches import cached_plan
from hops._body_hop.call import call_body_hop
from hops._body_hop.flat_body import flat_body
from hops._body_hop.joint import body_output_examples, is_differentiable, split_joint, trace_connected_joint
from hops._body_hop.subgraph import body_name, fresh_outputs, inline_graph, named, rename_inner_function
from hops._errors import call_prefix, hop_prefix, leaf_name
from hops.specs import _FxLiteral, register_spec_type

__all__ = ["scan", "scan_hop", "ScanSpec"]


@dataclasses.dataclass(frozen=True, repr=False)
class ScanSpec(_FxLiteral):
    """The static part of a scan node: how its flat inputs split, and how it runs.

    ``num_carry`` / ``num_xs`` count the leading carry and xs inputs (the rest are
    additional inputs, the same at every step); ``length`` is the number of steps when it
    is static (always when there are no xs; ``None`` for a symbolic length);
    ``reverse`` runs the steps from the last slice to the first (ys stay in slice order);
    ``remat`` makes the backward recompute each step instead of saving its residuals;
    ``unroll`` is how many steps one loop iteration runs where the scan lowers to a loop
    (values do not depend on it, as in ``jax.lax.scan``); ``None`` leaves it to the
    lowering (XLA and inductor run one step per iteration).
    """

    none_when_symbolic: ClassVar[tuple[str, ...]] = ("length",)  # see hops/_dynamo.py

    num_carry: int
    num_xs: int
    length: int | None = None
    reverse: bool = False
    remat: bool = False
    unroll: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_carry", "num_xs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"ScanSpec({name}=...) must be an int >= 0, got {value!r}")
        if self.length is not None and (isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0):
            raise TypeError(f"ScanSpec(length=...) must be an int >= 0 or None, got {self.length!r}")
        for name in ("reverse", "remat"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ScanSpec({name}=...) must be a bool, got {getattr(self, name)!r}")
        if self.unroll is not None and (isinstance(self.unroll, bool) or not isinstance(self.unroll, int) or self.unroll < 1):
            raise TypeError(f"ScanSpec(unroll=...) must be an int >= 1 or None, got {self.unroll!r}")

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)!r}"
            for name, default in (("length", None), ("reverse", False), ("remat", False), ("unroll", None))
            if getattr(self, name) != default
        )
        return f"hops.ScanSpec({self.num_carry}, {self.num_xs}{extra})"


register_spec_type("ScanSpec", ScanSpec)


class Scan(BodyHOP):
    """HOP ``hops_scan(body, *init, *xs, *additional, spec)``."""

    spec_type = ScanSpec

    def __init__(self) -> None:
        super().__init__("hops_scan")

    def check(self, body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> None:
        _check_inputs(body, inputs, spec)

    def body_operands(self, inputs: Sequence[Any], spec: ScanSpec) -> tuple:
        """What the body sees: carries and additional inputs whole, one slice of each xs."""
        carry, xs, additional = split_scan_operands(inputs, spec)
        return (*carry, *scan_step_examples(xs), *additional)

    def check_outputs(self, body: Callable, outputs: Sequence[Any], inputs: Sequence[Any], spec: ScanSpec) -> None:
        _check_step(body_name(body), outputs, split_scan_operands(inputs, spec)[0])

    def outputs_from_body(self, outputs: Sequence[Any], inputs: Sequence[Any], spec: ScanSpec) -> tuple:
        carry, xs, _ = split_scan_operands(inputs, spec)
        step = _check_step(None, outputs, carry)
        length = scan_length(xs, spec)
        return (
            *(c.new_empty(c.size()) for c in carry),
            *(y.new_empty((length, *y.shape)) for y in step[spec.num_carry :]),
        )

    def run(self, body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> tuple:
        return run_scan_steps(body, inputs, spec)

    def fold_lifted(self, inputs: Sequence[Any], spec: ScanSpec, lifted: Sequence[Any]) -> tuple[list, ScanSpec]:
        # What the body closed over is an additional input: the same at every step.
        return [*inputs, *lifted], spec

    def autograd_plan(self, body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> AutogradPlan:
        return cached_plan(lambda: _ScanPlan(body, inputs, spec), body, inputs, spec)


scan_hop = Scan()


def split_scan_operands(inputs: Sequence[Any], spec: ScanSpec) -> tuple[list[Any], list[Any], list[Any]]:
    """A scan node's operands as ``(init, xs, additional)``, counted by ``spec``."""
    carry_end = spec.num_carry
    xs_end = carry_end + spec.num_xs
    return list(inputs[:carry_end]), list(inputs[carry_end:xs_end]), list(inputs[xs_end:])


def scan_length(xs: Sequence[torch.Tensor], spec: ScanSpec) -> Any:
    """The number of steps: the xs' leading dim, or ``spec.length`` when there are no xs."""
    return xs[0].shape[0] if xs else spec.length


def _operand_names(spec: ScanSpec, count: int) -> list[str]:
    """The HOP's flat operands named as the node holds them: ``init[i]``, ``xs[i]``,
    ``additional_inputs[i]`` (the public ``scan`` names them by key path instead)."""
    return [
        *(f"init[{i}]" for i in range(spec.num_carry)),
        *(f"xs[{i}]" for i in range(spec.num_xs)),
        *(f"additional_inputs[{i}]" for i in range(count - spec.num_carry - spec.num_xs)),
    ]


def _check_inputs(body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> None:
    where = hop_prefix(scan_hop, body)
    if len(inputs) < spec.num_carry + spec.num_xs:
        raise ValueError(
            f"{where}: {len(inputs)} inputs but the spec counts {spec.num_carry} carries and {spec.num_xs} xs"
        )
    names = _operand_names(spec, len(inputs))
    carry, xs, _ = split_scan_operands(inputs, spec)
    for i, value in enumerate([*carry, *xs]):
        if not isinstance(value, (torch.Tensor, torch.fx.Proxy)):
            raise TypeError(f"{where}: {names[i]} must be a tensor, got {type(value).__name__}")
    devices = [(i, value.device.type) for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
    if "xla" in [device for _, device in devices] and any(device != "xla" for _, device in devices):
        # One While runs the scan on XLA: every input must be an operand of it.
        i, device = next((i, device) for i, device in devices if device != "xla")
        raise ValueError(f"{where}: {names[i]} is a {device} tensor; a scan on XLA tensors needs every input on the XLA device")
    if not xs and spec.length is None:
        raise ValueError(f"{where}: no xs to scan over and no length: pass length=")
    if any(isinstance(x, torch.fx.Proxy) for x in xs):
        return
    _check_xs(where, xs, names=names[spec.num_carry : spec.num_carry + spec.num_xs])
    if xs and spec.length is not None and spec.length != xs[0].shape[0]:
        raise ValueError(f"{where}: length={spec.length} but the xs have length {xs[0].shape[0]}")


def scan_step_examples(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One step's slice of each xs leaf (shape without dim 0), valid even for length 0.

    Tracers only read a stand-in's metadata: fake and functional xs get a new tensor with
    the slice's sizes and strides (a functional ``select`` costs a view replay per call);
    real xs (``make_fx`` in real mode runs the body) get their first slice.
    """
    return [
        x.new_empty_strided(x.shape[1:], x.stride()[1:])
        if isinstance(x, (FakeTensor, FunctionalTensor)) or x.shape[0] == 0
        else x.select(0, 0)
        for x in xs
    ]


def _check_step(name: str | None, outputs: Sequence[Any], carry: Sequence[Any]) -> tuple:
    """The step returned tensors, and each new carry matches its init (a ``TypeError``, as
    ``jax.lax.scan`` raises for a carry whose type changes). Flat: leaves are named as the
    node holds them (``init[i]``); the public ``scan``'s step checks its carry first, by key
    path."""
    where = call_prefix("scan", name)
    if len(outputs) < len(carry):
        raise TypeError(f"{where}: the body returned {len(outputs)} leaves for {len(carry)} carries")
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            what = f"the carry at init[{i}]" if i < len(carry) else f"y[{i - len(carry)}]"
            raise TypeError(f"{where}: the body returned {type(value).__name__} for {what}; the body must return tensors")
    for i, (new, old) in enumerate(zip(outputs, carry)):
        if new.shape != old.shape or new.dtype != old.dtype:
            raise TypeError(_carry_change(where, f"init[{i}]", old, new))
    return tuple(outputs)


def _carry_change(where: str, leaf: str, old: torch.Tensor, new: torch.Tensor) -> str:
    return (
        f"{where}: the carry at {leaf} changes from {tuple(old.shape)} {old.dtype} to {tuple(new.shape)} "
        f"{new.dtype} in one step; a carry must keep its shape and dtype"
    )


def _check_xs(where: str, xs: Sequence[torch.Tensor], dim: int = 0, names: Sequence[str] | None = None) -> None:
    """Every xs leaf (already moved so that it is scanned along dim 0) has a dim 0, and all
    have the same length. ``dim`` is the user's scan dim, ``names`` name the leaves (by key
    path; ``xs[i]`` by default), for the message."""
    names = list(names) if names else [f"xs[{i}]" for i in range(len(xs))]
    for x, what in zip(xs, names):
        if x.dim() == 0:
            raise ValueError(f"{where}: {what} is a 0-d tensor; xs are sliced along dim {dim}")
        if x.shape[0] != xs[0].shape[0]:
            raise ValueError(
                f"{where}: {what} has length {x.shape[0]} but {names[0]} has {xs[0].shape[0]} along dim {dim}; "
                f"every xs leaf is sliced along dim {dim} and needs the same length"
            )


# --------------------------------------------------------------------------- public API


class ScanArgumentError(TypeError, ValueError):
    """A bad argument to ``hops.scan`` (a step that is not callable, an xs leaf that is not
    a tensor). Both a ``TypeError``, as torch and JAX raise for these, and a ``ValueError``,
    as torch_xla's scan raises."""


class ScanDimError(ValueError, IndexError):
    """A ``dim`` an xs leaf does not have: a ``ValueError``, and an ``IndexError`` as torch
    raises for a dim out of range."""


def _as_tensor_leaf(value: Any, what: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """A Python number as a 0-d tensor (``like``'s dtype and device when given, else torch's
    default for it; ``_promote_weak_init`` may then change an init's); a tensor as itself."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float, complex)):
        if like is not None:
            return torch.tensor(value, dtype=like.dtype, device=like.device)
        return torch.tensor(value)
    raise TypeError(f"{what} is a {type(value).__name__}, not a tensor or a Python number")


def scan(
    fn: Callable,
    init: Any,
    xs: Any = None,
    length: Any = None,
    reverse: bool = False,
    unroll: int | bool | None = None,
    *,
    dim: int = 0,
    additional_inputs: Sequence[torch.Tensor] = (),
    remat: bool = False,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = True,
) -> tuple[Any, Any]:
    """``jax.lax.scan``: ``fn(carry, x, *additional_inputs) -> (new_carry, y)`` over dim 0 of ``xs``.

    ``init``, ``xs``: pytrees of tensors (numbers become 0-d tensors); ``length``: the number
    of steps when xs has no tensor leaf; ``reverse``; ``unroll``: steps per loop iteration
    (``True``: all); ``dim``: scan xs along it (torch's scan); ``remat``: recompute each step in
    the backward; ``partition_fn`` / ``is_fn_pure``: torch_xla's scan's. Returns ``(final_carry,
    ys)``, ys stacked along dim 0 (``dim`` where a y has it) in slice order; ``None`` if
    ``y=None``. Errors start with ``scan(<fn's name>): `` and name the leaf by key path
    (``xs['a']``): a carry changing shape, dtype or structure (``TypeError``), xs of
    different lengths, a ``dim`` an xs leaf lacks, non-tensor outputs, a step writing into
    its inputs or closure; ``hops.DeviceMismatchError`` for devices. Details: module docstring.

    >>> last, ys = hops.scan(lambda c, x: (c + x, c * x), torch.zeros(3), torch.ones(4, 3))
    """
    fn = _compat.compiled_function_inside(fn)  # a torch.compile'd step, in compiled code
    name = body_name(fn)
    if callable(length):
        # torch_xla's positional order: scan(fn, init, xs, partition_fn, is_fn_pure).
        partition_fn, is_fn_pure, length, reverse = length, reverse, None, False
    remat = remat or _remat_of(partition_fn, name)
    if not callable(fn):
        raise ScanArgumentError(f"scan: fn must be callable, got {type(fn).__name__}")
    raw_init, init_leaves, init_names, carry_treespec = _flatten_init(init, name)
    xs_leaves, xs_names, xs_treespec, additional, additional_names = _flatten_operands(xs, additional_inputs, name)
    _check_length(length, name)
    if not xs_leaves and xs is not None and length is None:
        # torch's scan(fn, init, []): nothing to scan over and no length: no step runs.
        return init, []
    dim = _resolve_dim(dim, xs_leaves, xs_names, name)
    if dim != 0:
        # Scanning along ``dim`` is scanning the xs moved to dim 0: the node and every
        # lowering see dim 0 only.
        xs_leaves = [torch.movedim(x, dim, 0) for x in xs_leaves]
    _check_xs(f"scan({name})", xs_leaves, dim=dim, names=xs_names)
    xs_leaves, xs_treespec, static_length = _scanned_length(xs_leaves, xs_treespec, length, dim, [*init_leaves, *additional], name)
    spec = ScanSpec(len(init_leaves), len(xs_leaves), static_length, reverse, remat, _resolve_unroll(unroll, static_length, name))
    weak = [i for i, leaf in enumerate(raw_init) if not isinstance(leaf, torch.Tensor)]
    if weak and not torch.compiler.is_dynamo_compiling():
        init_leaves = _promote_weak_init(fn, raw_init, init_leaves, weak, carry_treespec, xs_treespec, [*xs_leaves, *additional], spec, name)
    # Under Dynamo the code-object rename cannot be traced; hops/_dynamo.py names the
    # subgraph after the step's closure variable fn instead.
    make_step = _make_step if torch.compiler.is_dynamo_compiling() else _named_step_factories(name)
    step = make_step(fn, carry_treespec, xs_treespec, len(xs_leaves), init_leaves, name, init_names)
    set_trace_key(step, fn, carry_treespec, xs_treespec, len(xs_leaves), len(additional), across_calls=bool(is_fn_pure))
    # Leaves are named by key path (a phantom xs, made on init's device, is "xs").
    path_names = [*init_names, *(xs_names or ["xs"] * len(xs_leaves)), *additional_names]
    result = call_body_hop(
        scan_hop,
        step,
        [*init_leaves, *xs_leaves, *additional],
        spec,
        what=f"scan({name})",
        input_names=lambda i: path_names[i] if i < len(path_names) else f"input {i}",
        user_function=fn,
        device_names=lambda i: path_names[i],
    )
    # The results have the step's structure: (carry, ys), or (carry,) for a step without y.
    # (Returned as they come: Dynamo names graph values after the locals holding them.)
    if dim == 0:
        return result[0], (result[1] if len(result) == 2 else None)
    return result[0], (
        pytree.tree_map(lambda y: torch.movedim(y, 0, dim) if dim < y.dim() else y, result[1]) if len(result) == 2 else None
    )


def _flatten_init(init: Any, name: str) -> tuple[list[Any], list[torch.Tensor], list[str], Any]:
    """``init``'s leaves as given, as tensors (numbers become 0-d tensors), their key-path
    names, and its structure."""
    paths, treespec = pytree.tree_flatten_with_path(init)
    raw = [leaf for _, leaf in paths]
    names = [leaf_name("init", path) for path, _ in paths]
    return raw, [_as_tensor_leaf(leaf, f"scan({name}): {names[i]}") for i, leaf in enumerate(raw)], names, treespec


def _flatten_operands(
    xs: Any, additional_inputs: Sequence[Any], name: str
) -> tuple[list[torch.Tensor], list[str], Any, list[torch.Tensor], list[str]]:
    """``xs``'s leaves, their key-path names and its structure, and the additional inputs
    with their names; each must be a tensor."""
    paths, xs_treespec = ([], None) if xs is None else pytree.tree_flatten_with_path(xs)
    xs_leaves = [leaf for _, leaf in paths]
    xs_names = [leaf_name("xs", path) for path, _ in paths]
    additional = list(additional_inputs)
    additional_names = [f"additional_inputs[{i}]" for i in range(len(additional))]
    for names, leaves in ((xs_names, xs_leaves), (additional_names, additional)):
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise ScanArgumentError(f"scan({name}): {names[i]} is a {type(leaf).__name__}, not a tensor")
    return xs_leaves, xs_names, xs_treespec, additional, additional_names


def _check_length(length: Any, name: str) -> None:
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, (int, torch.SymInt)) or (isinstance(length, int) and length < 0)
    ):
        raise TypeError(f"scan({name}): length must be an int >= 0, got {length!r}")


def _scanned_length(
    xs_leaves: list[torch.Tensor], xs_treespec: Any, length: Any, dim: int, others: Sequence[torch.Tensor], name: str
) -> tuple[list[torch.Tensor], Any, int | None]:
    """The xs leaves and structure the node gets, and the length its spec holds (``None``
    where the length may be symbolic). Without xs the step gets ``x=None``."""
    static_length = length
    if xs_leaves and isinstance(xs_leaves[0].shape[0], int):
        # Under Dynamo a symbolic size passes too; its rule makes ScanSpec.length None then.
        static_length = xs_leaves[0].shape[0]
    if xs_leaves and length is not None and length != xs_leaves[0].shape[0]:
        raise ValueError(f"scan({name}): length={length} but xs have length {xs_leaves[0].shape[0]} along dim {dim}")
    if not xs_leaves and length is None:
        raise ValueError(f"scan({name}): no xs to scan over and no length: pass length=")
    if not xs_leaves:
        xs_treespec = None  # the step gets x=None
        if torch.compiler.is_dynamo_compiling() or isinstance(length, torch.SymInt):
            # A length that may be symbolic (Dynamo shows a symbolic int as an int) cannot be
            # a spec constant: it is the length of an xs of empty slices the step never sees,
            # made on the device of the other operands.
            xs_leaves = [torch.empty((length, 0), device=_device_of(others))]
            static_length = None
    return xs_leaves, xs_treespec, static_length


def _resolve_unroll(unroll: Any, static_length: int | None, name: str) -> int | None:
    """``unroll`` as steps per iteration (``True``: every step; ``False``: one), or ``None``."""
    if unroll is True:
        return max(static_length or 1, 1)
    if unroll is False:
        return 1
    if unroll is not None and (isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1):
        raise TypeError(f"scan({name}): unroll must be an int >= 1, a bool or None, got {unroll!r}")
    return unroll


def _resolve_dim(dim: Any, xs_leaves: Sequence[torch.Tensor], xs_names: Sequence[str], name: str) -> int:
    """``dim`` as a dim >= 0 of every xs leaf (negative counts from the first leaf's last
    dim, as torch's scan does). With no xs, only dim 0 (or -1) means anything."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"scan({name}): dim must be an int, got {dim!r}")
    if dim == 0:
        return 0
    if not xs_leaves:
        if dim != -1:
            raise ScanDimError(f"scan({name}): dim={dim} but there are no xs to scan along it; ys stack along dim 0")
        return 0
    rank = xs_leaves[0].dim()
    resolved = dim + rank if dim < 0 else dim
    for x, what in zip(xs_leaves, xs_names):
        if not 0 <= resolved < x.dim():
            raise ScanDimError(
                f"scan({name}): dim={dim} but {what} has shape {tuple(x.shape)} ({x.dim()} dims); "
                f"xs are scanned along dim, which every xs leaf needs"
            )
    return resolved


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _promote_weak_init(
    fn: Callable,
    raw_init: list[Any],
    init_leaves: list[torch.Tensor],
    weak: list[int],
    carry_treespec: Any,
    xs_treespec: Any,
    xs_and_additional: list[torch.Tensor],
    spec: ScanSpec,
    name: str,
) -> list[torch.Tensor]:
    """JAX's weakly typed init: a Python number in ``init`` takes the dtype one step gives
    its carry when the step sees the number itself (``0`` plus an int8 x is int8, ``1.0``
    times a float64 value float64), so a step written for JAX keeps a consistent carry.

    The step runs once on fake inputs for this; if it cannot (it calls a tensor method on
    the number), the leaves keep torch's default dtypes and the real trace reports any
    mismatch."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from hops._body_hop.body import inspect_body

    step = _make_step(fn, carry_treespec, xs_treespec, spec.num_xs, init_leaves, name)

    def probe(*leaves: Any) -> list[Any]:
        # The step on the numbers themselves where init has them.
        return pytree.tree_leaves(step(*(raw_init[i] if i in weak else leaf for i, leaf in enumerate(leaves)))[0])

    with disable_proxy_modes_tracing():
        examples = scan_hop.body_inputs([*init_leaves, *xs_and_additional], spec)
    try:
        info = inspect_body(probe, examples, what=f"scan({name})", input_names=lambda i: f"input {i}", eager=True)
    except Exception:  # the step needs tensors where it got numbers: keep the defaults
        return init_leaves
    if not info.complete or len(info.outputs) != len(init_leaves):
        return init_leaves
    promoted = list(init_leaves)
    for i in weak:
        out = info.outputs[i]
        if isinstance(out, torch.Tensor) and out.dtype != init_leaves[i].dtype:
            promoted[i] = torch.tensor(raw_init[i], dtype=out.dtype, device=init_leaves[i].device)
    return promoted


def _remat_of(partition_fn: Callable | None, name: str) -> bool:
    """Whether torch_xla's ``partition_fn`` asks to recompute activations (its min-cut
    partitioner) or to save them (its default one)."""
    if partition_fn is None:
        return False
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    if partition_fn is min_cut_rematerialization_partition:
        return True
    if partition_fn is default_partition:
        return False
    raise TypeError(
        f"scan({name}): partition_fn={getattr(partition_fn, '__name__', partition_fn)!r} is not one this "
        "scan can honour: it saves a step's activations (default_partition) or recomputes them "
        "(min_cut_rematerialization_partition, or remat=True)"
    )


@functools.lru_cache(maxsize=None)
def _named_step_factories(name: str) -> Callable:
    return rename_inner_function(_make_step, "step", name)


def _make_step(
    fn: Callable,
    carry_treespec: Any,
    xs_treespec: Any,
    num_xs: int,
    init_leaves: Sequence[Any],
    name: str,
    init_names: Sequence[str] | None = None,
) -> Callable:
    """The scan body: ``fn`` on flat leaves, returning ``(new_carry, y)`` (``(new_carry,)``
    for ``y=None``) with Python numbers made tensors and the carry's structure checked (and,
    given ``init_names``, each carry leaf's shape and dtype, naming it by key path).
    ``xs_treespec=None``: ``fn`` gets ``x=None`` (the ``num_xs`` xs leaves, if any, only
    count the steps)."""
    num_carry = carry_treespec.num_leaves
    carry_like = [(leaf.dtype, leaf.device) for leaf in init_leaves]

    def step(*leaves: Any) -> tuple[Any, Any]:
        carry = pytree.tree_unflatten(list(leaves[:num_carry]), carry_treespec)
        x = None if xs_treespec is None else pytree.tree_unflatten(list(leaves[num_carry : num_carry + num_xs]), xs_treespec)
        result = fn(carry, x, *leaves[num_carry + num_xs :])
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"scan({name}): fn must return (new_carry, y), got {type(result).__name__}")
        new_carry, y = result
        carry_leaves, new_treespec = pytree.tree_flatten(new_carry)
        if new_treespec != carry_treespec:
            raise TypeError(
                f"scan({name}): the carry changes structure in one step: {carry_treespec} -> {new_treespec}"
            )
        carry_leaves = [
            leaf if isinstance(leaf, torch.Tensor) else torch.tensor(leaf, dtype=dtype, device=device)
            for leaf, (dtype, device) in zip(carry_leaves, carry_like)
        ]
        if init_names is not None:
            # The check the HOP makes on the flat outputs too; here the leaf has its key path.
            for carry_name, new, old in zip(init_names, carry_leaves, leaves[:num_carry]):
                if isinstance(old, torch.Tensor) and (new.shape != old.shape or new.dtype != old.dtype):
                    raise TypeError(_carry_change(f"scan({name})", carry_name, old, new))
        new_carry = pytree.tree_unflatten(carry_leaves, carry_treespec)
        if y is None:  # no ys, as in jax.lax.scan
            return (new_carry,)
        if not all(isinstance(leaf, (torch.Tensor, bool, int, float, complex)) for leaf in pytree.tree_leaves(y)):
            path, leaf = next(
                (path, leaf)
                for path, leaf in pytree.tree_flatten_with_path(y)[0]
                if not isinstance(leaf, (torch.Tensor, bool, int, float, complex))
            )
            _as_tensor_leaf(leaf, f"scan({name}): {leaf_name('y', path)}")
        y = pytree.tree_map(lambda leaf: _as_tensor_leaf(leaf, f"scan({name}): y"), y)
        return new_carry, y

    return step


# --------------------------------------------------------------------------- eager


def run_scan_steps(body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> tuple[torch.Tensor, ...]:
    """The reference: a Python loop. Above autograd it is differentiated by autograd itself;
    with ``remat`` each step is checkpointed (recomputed in backward, random draws replayed)."""
    # Operands and results in the boundary's layout (``at_boundary``), whoever runs the loop.
    carry, xs, additional = (list(at_boundary(values)) for values in split_scan_operands(inputs, spec))
    name = body_name(body)
    length = scan_length(xs, spec)
    flat = flat_body(body)
    # Under torch.func, which refuses checkpoint's saved-tensor hooks, steps are not
    # checkpointed: remat saves memory only, the values and gradients are the same.
    checkpointed = (
        spec.remat
        and torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        and not _compat.functorch_active()
    )
    ys_per_step: list[Any] = [None] * length
    order = range(length - 1, -1, -1) if spec.reverse else range(length)
    for i in order:
        step_inputs = (*carry, *(_compat.select_step(x, i) for x in xs), *additional)
        if checkpointed:
            outputs = torch.utils.checkpoint.checkpoint(flat, *step_inputs, use_reentrant=False)
        else:
            outputs = flat(*step_inputs)
        outputs = _check_step(name, outputs, carry)
        # The next step's carry is laid out as the first step's (see ``at_boundary``).
        carry, ys_per_step[i] = list(at_boundary(outputs[: spec.num_carry])), outputs[spec.num_carry :]
    if length == 0:
        return fresh_outputs(_zero_steps(flat, name, carry, xs, additional), inputs)
    ys = [torch.stack([step[j] for step in ys_per_step]) for j in range(len(ys_per_step[0]))]
    return fresh_outputs((*carry, *ys), inputs)


def _zero_steps(flat: Callable, name: str, carry: list[Any], xs: list[Any], additional: list[Any]) -> tuple:
    """A scan of length 0: the init as final carry, and empty ys shaped as one step gives
    them (learned by running the step on fake stand-ins, closure included).

    Its gradients are a sum over no steps: zeros (of xs's shape for an xs leaf) for every xs
    leaf, additional input and closed-over tensor that one step's differentiable outputs
    depend on, as torch's scan gives (None for one they do not, as for any length). Autograd
    gets them by an exact zero added to one output: ``t.reshape(-1)[:0].sum()`` is 0 for any
    values (nan and inf included) and has gradient zeros, negated to -0.0, which added to
    any number (-0.0 included) gives that number."""
    grad = torch.is_grad_enabled()
    probe = run_on_stand_ins(
        flat,
        (*carry, *scan_step_examples(xs), *additional),
        dependencies=grad,
        needs_grad=[False] * len(carry) + [x.requires_grad for x in xs],  # (a slice of no xs is a new tensor)
    )
    template = _check_step(name, pytree.tree_leaves(probe.outputs), carry)
    ys = [torch.empty((0, *y.shape), dtype=y.dtype, device=xs[0].device if xs else y.device) for y in template[len(carry) :]]
    outputs = [*carry, *ys]
    if grad:
        used = [*probe.input_used[len(carry) :], *probe.read_used]
        sources = [t for t, u in zip([*xs, *additional, *probe.read], used) if u]
        # The output carrying the zeros: a differentiable y if any (it has no elements),
        # else a differentiable carry.
        target = next(
            (i for i in [*range(len(carry), len(outputs)), *range(len(carry))] if is_differentiable(outputs[i])),
            None,
        )
        if sources and target is not None:
            zero = functools.reduce(torch.add, [_exact_zero(t) for t in sources])  # (sum() would start at +0)
            outputs[target] = outputs[target] + zero.to(outputs[target].real.dtype)
    return tuple(outputs)


def _exact_zero(t: torch.Tensor) -> torch.Tensor:
    """-0.0 computed from ``t``, whose gradient is zeros like ``t`` (see ``_zero_steps``)."""
    zero = t.reshape(-1)[:0].sum()
    return -(zero.real if zero.is_complex() else zero)


@scan_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(body: Callable, *inputs_and_spec: Any):
    return scan_hop.eager_rule(body, *inputs_and_spec)


# --------------------------------------------------------------------------- fake


@scan_hop.py_impl(FakeTensorMode)
def _fake(mode: FakeTensorMode, body: Callable, *inputs_and_spec: Any):
    return scan_hop.fake_rule(mode, body, *inputs_and_spec)


# --------------------------------------------------------------------------- functionalize


@scan_hop.py_functionalize_impl
def _functionalize(ctx: Any, body: Callable, *inputs_and_spec: Any):
    return scan_hop.functionalize_rule(ctx, body, *inputs_and_spec)


# --------------------------------------------------------------------------- proxy


@scan_hop.py_impl(ProxyTorchDispatchMode)
def _proxy(mode: ProxyTorchDispatchMode, body: Callable, *inputs_and_spec: Any):
    return scan_hop.proxy_rule(mode, body, *inputs_and_spec)


# --------------------------------------------------------------------------- autograd
#
# Eager: the loop under autograd. Traced (or on XLA): one step's joint
#   joint(*carry, *x, *additional, *cotangents) -> (*new_carry, *y, *grads)
# is split into a forward step that also returns the residuals the backward reads, and a
# backward step from (primals it reads, residuals, cotangents). The backward scan runs the
# backward step in reverse order; the gradient of the additional inputs is summed in its carry.


def _take(values: Sequence[Any], *counts: int) -> list:
    """``values`` cut into consecutive parts of ``counts``, and the rest."""
    parts, start = [], 0
    for count in counts:
        parts.append(list(values[start : start + count]))
        start += count
    return [*parts, list(values[start:])]


class _ScanPlan(AutogradPlan):
    """The traced autograd of one scan call (see above)."""

    def __init__(self, body: Callable, inputs: Sequence[Any], spec: ScanSpec) -> None:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        self.spec, self.name = spec, body_name(body)
        carry, xs, additional = split_scan_operands(inputs, spec)
        nc, nx = spec.num_carry, spec.num_xs
        with disable_proxy_modes_tracing():
            examples = scan_hop.body_inputs(inputs, spec)
        flat = flat_body(body)
        outputs = body_output_examples(flat, examples)
        self.treespec = flat.treespec
        _check_step(self.name, outputs, carry)
        # Every float carry carries gradient between steps; xs and additional inputs get one
        # where they ask for it.
        self.carry_grad = [is_differentiable(c) for c in carry]
        self.xs_grad = [is_differentiable(x) and x.requires_grad for x in xs]
        self.additional_grad = [is_differentiable(a) and a.requires_grad for a in additional]
        # (A carry's gradient crosses steps: every float carry keeps one.)
        joint, needs_grad = trace_connected_joint(
            flat, examples, outputs, [*self.carry_grad, *self.xs_grad, *self.additional_grad], keep=range(nc)
        )
        self.xs_grad, self.additional_grad = needs_grad[nc : nc + nx], needs_grad[nc + nx :]
        xs_positions = range(nc, nc + nx)
        additional_positions = range(nc + nx, len(examples))
        self.split = split_joint(
            joint,
            len(examples),
            len(outputs),
            available=[*xs_positions, *additional_positions],
            invariant=additional_positions,
            remat=spec.remat,
        )
        self.num_outputs = len(outputs)
        self.y_like = [(y.shape, y.dtype, y.device, is_differentiable(y)) for y in outputs[nc:]]
        self.carry_like = [(c.shape, c.dtype, c.device) for c in carry]
        # (An additional input may be a symbolic size Dynamo lifted: it has no gradient.)
        self.additional_like = [(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else None for a in additional]
        self.xs_used = [p - nc for p in self.split.primals_in_backward if p in xs_positions]
        self.additional_used = [p - nc - nx for p in self.split.primals_in_backward if p in additional_positions]

    def forward(self, inputs: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        spec = self.spec
        _, xs, additional = split_scan_operands(inputs, spec)
        results = scan_hop(self.forward_body, *inputs, spec)
        outputs, stacked = results[: self.num_outputs], results[self.num_outputs :]
        self.length = scan_length(xs, spec)
        return outputs, [*stacked, *(xs[i] for i in self.xs_used), *(additional[i] for i in self.additional_used)]

    # The step bodies are made once per plan: a plan reused across calls (eagerly on XLA)
    # hands the device rule the same bodies, whose lowered steps it keeps.

    @functools.cached_property
    def forward_body(self) -> Callable:
        return plan_body(named(self.split.forward, self.name))

    @functools.cached_property
    def backward_body(self) -> Callable:
        """``(*carry grads, *summed additional grads, *residuals, *xs it reads, *y cotangents,
        *additional inputs it reads) -> (*new carry grads, *summed additional grads, *xs
        grads)``: the split backward, built as a graph (it is one already, with plumbing)."""
        split = self.split
        num_carry_grads = sum(self.carry_grad)
        num_additional_grads = sum(self.additional_grad)
        num_xs_grads = sum(self.xs_grad)
        num_y_cotangents = sum(differentiable for *_, differentiable in self.y_like)
        counts = (num_carry_grads, num_additional_grads, split.num_residuals, len(self.xs_used), num_y_cotangents)
        graph = fx.Graph()
        values = [
            graph.placeholder(f"{kind}_{i}")
            for kind, count in zip(
                ("carry_grad", "additional_grad", "residual", "x", "y_grad", "step", "additional"),
                (*counts, int(self.counts_steps), len(self.additional_used)),
            )
            for i in range(count)
        ]
        carry_grads, additional_grads, residuals, x_values, y_grads, _, additional_values = _take(
            values, *counts, int(self.counts_steps)
        )
        # The primals the backward reads are the xs it reads, then the additional inputs (in
        # ``split.primals_in_backward`` order).
        grads = inline_graph(graph, split.backward, [*x_values, *additional_values, *residuals, *carry_grads, *y_grads])
        new_carry_grads, x_grads, step_additional_grads = _take(grads, num_carry_grads, num_xs_grads)
        summed = [graph.call_function(torch.ops.aten.add.Tensor, (a, g)) for a, g in zip(additional_grads, step_additional_grads)]
        graph.output((*new_carry_grads, *summed, *x_grads))
        return plan_body(named(fx.GraphModule(split.backward, graph, f"{self.name}_bwd"), f"{self.name}_bwd"))

    @functools.cached_property
    def counts_steps(self) -> bool:
        """Whether the backward scan takes an xs of empty slices only for its length: it
        stacks nothing (no residual, xs or y cotangent) and the length is symbolic."""
        num_y_cotangents = sum(differentiable for *_, differentiable in self.y_like)
        return self.spec.length is None and self.split.num_residuals + len(self.xs_used) + num_y_cotangents == 0

    def backward(self, saved: Sequence[Any], cotangents: Sequence[Any]) -> Sequence[Any]:
        spec, split = self.spec, self.split
        nc = spec.num_carry
        stacked, xs_used, additional_used = _take(saved, split.num_residuals, len(self.xs_used))
        # Zeros are made like a tensor of this call (``new_zeros``), so a traced graph makes
        # them on the device it runs on.
        like = next(c for c in cotangents if c is not None)
        carry_cotangents = [
            like.new_zeros(shape, dtype=dtype) if c is None else c
            for c, (shape, dtype, _), grad in zip(cotangents[:nc], self.carry_like, self.carry_grad)
            if grad
        ]
        y_cotangents = [
            like.new_zeros((self.length, *shape), dtype=dtype) if c is None else c
            for c, (shape, dtype, _, differentiable) in zip(cotangents[nc:], self.y_like)
            if differentiable
        ]
        num_carry_grads = len(carry_cotangents)
        # The additional inputs' gradients are summed over the steps in the backward's carry.
        zeros = [like.new_zeros(a[0], dtype=a[1]) for a, need in zip(self.additional_like, self.additional_grad) if need]
        backward_xs = [*stacked, *xs_used, *y_cotangents]
        if self.counts_steps:
            backward_xs.append(like.new_empty((self.length, 0)))
        backward_spec = ScanSpec(num_carry_grads + len(zeros), len(backward_xs), spec.length, not spec.reverse, False, spec.unroll)
        results = scan_hop(self.backward_body, *carry_cotangents, *zeros, *backward_xs, *additional_used, backward_spec)
        carry_grads, additional_grads, xs_grads = _take(results, num_carry_grads, len(zeros))
        carry_grads, additional_grads, xs_grads = iter(carry_grads), iter(additional_grads), iter(xs_grads)
        return [
            *(next(carry_grads) if grad else None for grad in self.carry_grad),
            *(next(xs_grads) if grad else None for grad in self.xs_grad),
            *(next(additional_grads) if grad else None for grad in self.additional_grad),
        ]


@scan_hop.py_impl(DispatchKey.Autograd)  # always: a closed-over tensor may need grad when no operand does
def _autograd(body: Callable, *inputs_and_spec: Any):
    return scan_hop.autograd_rule(body, *inputs_and_spec)


# --------------------------------------------------------------------------- dynamo

_dynamo.register_subgraph_hop(scan_hop)


# --------------------------------------------------------------------------- inductor
#
# One ``while_loop`` (torch's HOP, which inductor compiles as a loop around one compiled
# body): the loop state is a step counter, the carries and the ys buffers; the xs and the
# additional inputs are read, not carried. Each iteration runs ``unroll`` steps; a static
# length that ``unroll`` does not divide runs the remaining steps after the loop. The
# counter indexes the xs and the ys buffers as a tensor (``index_select`` / ``index_copy_``),
# so no step reads a number out of a tensor.
#
# Inductor runs the loop from its Python wrapper (the condition and body graphs are called,
# their inputs checked, the condition read back to the host): for torch's own while_loop,
# measured on CPU, ~10 us per loop and 2-4 us per iteration beyond the body's kernels.
# A scan leaving ``unroll`` to the lowering (``None``) still runs one step per iteration:
# measured by benchmarks/inductor_scan.py, two steps per iteration saved 4-12% of a small
# step's run time for 35-50% more compile time (the last step's kernels fuse with the ys
# write, so the steps of one iteration do not share their kernels' code).


@_inductor.register_inductor_rule(scan_hop)
def _inductor_rule(body: Callable, *inputs_and_spec: Any) -> tuple:
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    inputs, spec = scan_hop.split_args(inputs_and_spec)
    carry, xs, additional = split_scan_operands(inputs, spec)
    # The loop's state keeps one layout (``while_loop`` checks it): carries enter and leave
    # each iteration contiguous, as the body was traced on (an expanded gradient carry, the
    # ``.sum()``'s, would otherwise differ from the step's result).
    carry, additional = list(at_boundary(carry)), list(at_boundary(additional))
    nc, nx = spec.num_carry, spec.num_xs
    length = scan_length(xs, spec)
    inlined = _inductor.inlined(body)

    def step(*step_inputs: Any) -> tuple:
        return at_boundary(inlined(*step_inputs))

    with disable_proxy_modes_tracing():
        ys_like = step(*scan_hop.body_inputs(inputs, spec))[nc:]
    device = next(t.device for t in (*carry, *xs, *ys_like, *additional) if isinstance(t, torch.Tensor))
    ys = [torch.empty((length, *y.shape), dtype=y.dtype, device=device) for y in ys_like]
    unroll = spec.unroll or 1
    per_iteration = unroll if isinstance(length, int) and unroll <= max(length, 1) else 1
    iterations = length // per_iteration

    def run_steps(positions: torch.Tensor, carry: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], ys: Sequence[Any], in_place: bool) -> tuple:
        """The steps at ``positions`` (a 1-d tensor), in order: the new carries, and ``ys``
        with the steps' outputs written at their indices (into the buffers inside the loop,
        into copies after it). The steps' xs are read in one block and their ys written in
        one block, so each step reads and writes views at fixed offsets and its kernels hold
        no per-step index (the steps before the last share their kernels' code)."""
        indices = (length - 1 - positions) if spec.reverse else positions
        blocks = [x.index_select(0, indices) for x in xs]
        outputs = []
        for k in range(positions.shape[0]):
            step_outputs = step(*carry, *(block[k] for block in blocks), *additional)
            carry = step_outputs[:nc]
            outputs.append(step_outputs[nc:])
        write = torch.Tensor.index_copy_ if in_place else torch.Tensor.index_copy
        ys = [write(buffer, 0, indices, torch.stack(step_ys)) for buffer, step_ys in zip(ys, zip(*outputs))]
        return list(carry), ys

    def cond_fn(counter: torch.Tensor, *state: Any) -> torch.Tensor:
        return counter < iterations

    # while_loop's operands are tensors, ints and SymInts; any other value the step reads (a
    # float: Dynamo lifts a module's ``eps`` as an input of the body under ``dynamic=True``)
    # is a constant of the loop's body.
    operand = [isinstance(a, (torch.Tensor, int, torch.SymInt)) for a in additional]

    def body_fn(counter: torch.Tensor, *state: Any) -> tuple:
        # The loop's body reads what it is given (a traced subgraph closes over nothing).
        ny = len(ys_like)
        carry, ys, xs, given = state[:nc], state[nc : nc + ny], state[nc + ny : nc + ny + nx], iter(state[nc + ny + nx :])
        step_additional = [next(given) if passed else value for value, passed in zip(additional, operand)]
        positions = counter * per_iteration + torch.arange(per_iteration, device=counter.device)
        carry, ys = run_steps(positions, carry, xs, step_additional, ys, in_place=True)
        return (counter + 1, *carry, *ys)

    if not (isinstance(iterations, int) and iterations == 0):  # a static zero-length loop is no loop
        counter = torch.zeros((), dtype=torch.int64, device=device)
        passed_additional = [value for value, passed in zip(additional, operand) if passed]
        _, *state = torch.ops.higher_order.while_loop(cond_fn, body_fn, (counter, *carry, *ys), (*xs, *passed_additional))
        carry, ys = state[:nc], state[nc:]
    if isinstance(length, int):
        if iterations * per_iteration < length:  # what the loop's iterations leave
            positions = torch.arange(iterations * per_iteration, length, device=device)
            carry, ys = run_steps(positions, carry, xs, additional, ys, in_place=False)
    return (*carry, *ys)
