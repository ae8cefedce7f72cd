"""``hops.kernel``: call a kernel that tracing must not look inside.

A kernel is any Python function over tensors (a Pallas/Triton/JAX-style kernel, a C++
extension, plain torch code) that graph capture should record as one opaque call instead
of whatever it does inside::

    @hops.kernel(abstract=attention_shapes, backward=attention_backward)
    def flash_attention(q, k, v, *, block_size=128):
        ...

makes ``flash_attention`` a HOP of its own, registered as ``hops_kernel_flash_attention``
(one HOP per kernel, so the kernel's name is the node's target and shows in generated
code). Tensors go positionally, parameters by keyword; ``flash_attention(q, k, v)`` emits::

    hops_kernel_flash_attention(q, k, v, hops.KernelParams.of(block_size=128))

``KernelParams`` holds every parameter (defaults filled in) as a sorted tuple of
``(name, value)`` pairs; values are typed, hashable constants checked at the call.

Rules: eager runs the kernel (``xla=`` replaces it on XLA tensors); fake runs ``abstract``;
functionalization unwraps and redispatches (a kernel must not mutate its inputs);
proxy emits the one node; autograd calls ``backward`` (itself kernels or plain torch code,
so backward graphs carry what it calls); Dynamo traces the call under ``fullgraph=True``.
``passes.lower_to_xla`` rewrites the node into a call of the XLA implementation (else the
kernel itself, run on XLA tensors); ``passes.inline_hops`` into a call of the kernel;
``passes.jax.lower_to_jax`` into a call of ``jax=`` on jax arrays when given (else the kernel's
torch function, lowered through that target).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    track_tensor_tree,
)

from hops import _compat, _dynamo, _export, _inductor
from hops._body_hop.body import version_counter, wrap_functional
from hops._body_hop.joint import is_tracing
from hops._body_hop.subgraph import fresh_outputs, refuse_untracked_xla_operands
from hops._errors import call_prefix
from hops._targets import load_device_rules
from hops.specs import _FxLiteral, register_spec_type

__all__ = ["kernel", "Kernel", "KernelParams"]

# --------------------------------------------------------------------------- params

_PRIMITIVE_PARAMS = (type(None), bool, int, float, str, torch.dtype)


def _param_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a kernel parameter (None if it can)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"is symbolic ({value!r}); kernel params are compile-time constants"
    if isinstance(value, (torch.Tensor, torch.fx.Proxy)):
        return "is a Tensor: pass tensors positionally"
    if isinstance(value, _PRIMITIVE_PARAMS):
        return None
    if type(value) is tuple:
        for item in value:
            problem = _param_problem(item)
            if problem is not None:
                return f"has an entry that {problem}"
        return None
    if isinstance(value, _FxLiteral) and dataclasses.is_dataclass(value):
        return None
    if isinstance(value, (list, set, dict, bytearray)):
        return f"is a {type(value).__name__} ({value!r}), which is not hashable; pass a tuple"
    return (
        f"is a {type(value).__name__} ({value!r}); kernel params must be None, bool, int, "
        "float, str, torch.dtype, tuples of these, or hops spec values (e.g. hops.ShardingSpec)"
    )


@dataclasses.dataclass(frozen=True, repr=False)
class KernelParams(_FxLiteral):
    """The non-tensor arguments of one kernel call: ``(name, value)`` pairs sorted by name.

    Build with ``KernelParams.of(block_size=128)``. Values are None, bool, int, float, str,
    ``torch.dtype``, tuples of these, or spec values of this package (frozen, hashable,
    printable as Python), so the whole value is hashable, compares by value, and Dynamo
    guards it field by field.
    """

    items: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if type(self.items) is not tuple:
            raise TypeError(f"KernelParams(items=...) must be a tuple of (name, value) pairs, got {self.items!r}")
        for pair in self.items:
            if type(pair) is not tuple or len(pair) != 2 or not isinstance(pair[0], str) or not pair[0].isidentifier():
                raise TypeError(f"KernelParams(items=...) entries must be (name, value) pairs, got {pair!r}")
            problem = _param_problem(pair[1])
            if problem is not None:
                raise TypeError(f"KernelParams: param {pair[0]} {problem}")
        names = [name for name, _ in self.items]
        if len(set(names)) != len(names):
            raise ValueError(f"KernelParams: duplicate param names in {names}")
        object.__setattr__(self, "items", tuple(sorted(self.items, key=lambda pair: pair[0])))

    @classmethod
    def of(cls, /, **params: Any) -> KernelParams:
        return cls(tuple(params.items()))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __repr__(self) -> str:
        return "hops.KernelParams.of(" + ", ".join(f"{name}={value!r}" for name, value in self.items) + ")"


register_spec_type("KernelParams.of", KernelParams.of)


# --------------------------------------------------------------------------- the HOP

_KERNELS: dict[str, Kernel] = {}


def _origin(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


class Kernel(HigherOrderOperator):
    """HOP ``hops_kernel_<name>(*tensors, params)`` calling one user kernel opaquely."""

    spec_type = KernelParams

    def __init__(
        self,
        implementation: Callable,
        *,
        name: str,
        abstract: Callable,
        backward: Callable | None,
        xla: Callable | None,
        jvp: Callable | None = None,
        jax: Callable | None = None,
    ) -> None:
        super().__init__(f"hops_kernel_{name}", cacheable=True)
        self.kernel_name = name
        self.implementation = implementation
        self.abstract_rule = abstract
        self.backward_rule = backward
        self.jvp_rule = jvp
        self.xla_implementation = xla
        # What target "jax" calls on jax values instead of lowering ``implementation``
        # (``passes/jax/rules.py``); never called, nor jax imported, by anything in hops/.
        self.jax_implementation = jax
        self.origin = _origin(implementation)
        self.__doc__ = implementation.__doc__
        self._signature = inspect.signature(implementation)
        positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = list(self._signature.parameters.values())
        self._positional_names = [p.name for p in parameters if p.kind in positional_kinds]
        self._variadic_name = next(
            (p.name for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None
        )
        self._backward_takes_mask = backward is not None and _accepts_keyword(backward, "needs_input_grad")
        # Output shapes and dtypes ``abstract`` promises, per input metadata and params.
        self.abstract_cache: dict[tuple, tuple] = {}

    # The kernel's code is opaque: it may draw random numbers, so its result is never
    # recomputed in a backward (see hops._body_hop.joint.draws_random_numbers).
    hops_opaque = True

    def __call__(self, *args: Any, **kwargs: Any):
        proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
        if proxy is not None:
            # torch.fx symbolic tracing (also how torch 2.9 rebuilds a pickled GraphModule).
            return proxy.tracer.create_proxy("call_function", self, self.node_args(*args, **kwargs), {})
        load_device_rules(args)
        node_args = self.node_args(*args, **kwargs)
        if any(_compat.is_legacy_batched(a) for a in node_args):
            # No rule can be registered for torch's legacy vmap: the eager rule, op by op.
            return _eager(self, *node_args)
        return super().__call__(*node_args)

    def node_args(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The canonical node args ``(*tensors, KernelParams)``, from a user call
        ``(*tensors, **params)`` or from node args themselves. Raises ``TypeError`` naming the
        kernel and the argument for anything else."""
        if args and isinstance(args[-1], KernelParams) and not kwargs:
            tensors, params = args[:-1], args[-1]
            self._check_tensors(tensors)
            return (*tensors, params)
        self._check_tensors(args)
        for key, value in kwargs.items():
            problem = _param_problem(value)
            if problem is not None:
                raise TypeError(f"{self.describe()}: param {key} {problem}")
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.describe()}: {e} (signature {self.kernel_name}{self._signature})") from None
        bound.apply_defaults()
        positional = set(self._positional_names[: len(args)])
        params: dict[str, Any] = {}
        for key, value in bound.arguments.items():
            kind = self._signature.parameters[key].kind
            if kind is inspect.Parameter.VAR_POSITIONAL or key in positional:
                continue
            if kind is inspect.Parameter.VAR_KEYWORD:
                params.update(value)
                continue
            problem = _param_problem(value)
            if problem is not None:
                raise TypeError(f"{self.describe()}: param {key} (default) {problem}")
            params[key] = value
        return (*args, KernelParams.of(**params))

    def _check_tensors(self, tensors: Sequence[Any]) -> None:
        for i, t in enumerate(tensors):
            if not isinstance(t, (torch.Tensor, torch.fx.Proxy)):
                raise TypeError(
                    f"{self.describe()}: positional argument {self.input_name(i)} must be a Tensor, "
                    f"got {type(t).__name__} {t!r}; pass non-tensor parameters by keyword"
                )

    def describe(self) -> str:
        """``kernel(scaled_tanh)``: how errors about this kernel begin (``hops._errors``)."""
        return call_prefix("kernel", self.kernel_name)

    @property
    def op(self) -> torch._ops.OpOverload:
        """This kernel as a ``torch.library`` op, ``hops_kernels::<name>(Tensor[] inputs,
        str params) -> Tensor[]``: a call every backend keeps whole and runs (inductor falls
        back to it, a pickled graph keeps it), with the kernel's abstract rule as its fake,
        its backward as its autograd and its ``xla=`` implementation on XLA. Lowerings
        rewrite kernel nodes into calls of it; ``params`` is ``repr(KernelParams)``."""
        return _kernel_op(self)

    def input_name(self, index: int) -> str:
        """The name of the ``index``-th tensor input, from the kernel's signature."""
        if index < len(self._positional_names):
            return self._positional_names[index]
        if self._variadic_name is not None:
            return f"{self._variadic_name}[{index - len(self._positional_names)}]"
        return f"#{index}"

    def run_backward(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        params: KernelParams,
        needs_input_grad: Sequence[bool],
    ) -> tuple[torch.Tensor | None, ...]:
        """Call ``backward`` and check that it returns one gradient (or None) per input."""
        wanted = [self.input_name(i) for i, need in enumerate(needs_input_grad) if need]
        if self.backward_rule is None:
            raise RuntimeError(
                f"{self.describe()}: no backward, but a gradient is needed for {', '.join(wanted)}: "
                f"pass backward= to hops.kernel (called as backward(*inputs, *outputs, *grad_outputs, "
                "**params), returning one gradient or None per tensor input)"
            )
        kwargs = params.as_dict()
        if self._backward_takes_mask:
            kwargs["needs_input_grad"] = tuple(needs_input_grad)
        grads = self.backward_rule(*inputs, *outputs, *grad_outputs, **kwargs)
        if isinstance(grads, torch.Tensor) or grads is None:
            grads = (grads,)
        if not isinstance(grads, (tuple, list)):
            raise TypeError(
                f"{self.describe()}: backward returned {type(grads).__name__}, expected a tuple with one "
                f"gradient (Tensor or None) per tensor input"
            )
        names = [self.input_name(i) for i in range(len(inputs))]
        if len(grads) != len(inputs):
            raise ValueError(
                f"{self.describe()}: backward returned {len(grads)} gradients, expected {len(inputs)} "
                f"(one per tensor input: {', '.join(names)})"
            )
        checked = []
        for name, grad, value, need in zip(names, grads, inputs, needs_input_grad):
            if grad is not None and not isinstance(grad, torch.Tensor):
                raise TypeError(
                    f"{self.describe()}: backward returned a {type(grad).__name__} as the gradient of "
                    f"{name}, expected a Tensor or None"
                )
            if grad is not None and need and grad.shape != value.shape:
                raise ValueError(
                    f"{self.describe()}: backward returned a gradient of shape {tuple(grad.shape)} for "
                    f"{name}, whose shape is {tuple(value.shape)}"
                )
            checked.append(grad if need else None)
        return tuple(checked)


def _accepts_keyword(fn: Callable, keyword: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters and parameters[keyword].kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


# --------------------------------------------------------------------------- public API


def kernel(
    implementation: Callable | None = None,
    /,
    *,
    abstract: Callable | None = None,
    backward: Callable | None = None,
    jvp: Callable | None = None,
    xla: Callable | None = None,
    jax: Callable | None = None,
    name: str | None = None,
) -> Any:
    """Decorator: make ``implementation`` an opaque kernel call that every tracer keeps whole.

    - ``abstract(*tensors, **params)``: called with fake tensors, returns fake outputs of the
      right shapes and dtypes (a Tensor or a tuple of Tensors), like
      ``torch.library.register_fake``; build them from the inputs (``q.new_empty(...)``).
    - ``backward(*inputs, *outputs, *grad_outputs, **params)``: returns one gradient (or
      None) per tensor input; it may call kernels or plain torch code. If it accepts a keyword
      ``needs_input_grad`` it also gets a tuple of bools, one per input. Without ``backward``
      a gradient through the kernel raises ``RuntimeError`` naming it.
    - ``jvp(*inputs, *tangents, **params)``: forward mode (forward AD, ``torch.func.jvp``,
      ``jacfwd``, ``hessian``): the outputs' tangents (a Tensor or a tuple) from the inputs
      and their tangents (zeros where an input has none). Without it forward mode raises
      ``NotImplementedError`` naming the kernel.
    - ``xla(*tensors, **params)``: the implementation for XLA tensors (e.g. built with
      torch_xla's builder or a custom call); default: ``implementation`` on XLA tensors.
    - ``jax(*arrays, **params)``: the implementation target ``"jax"`` calls on ``jax.Array``s
      (e.g. a Pallas kernel; ``interpret=True`` on CPU), returning an array or a tuple of
      arrays of ``abstract``'s shapes and dtypes; default: ``implementation`` lowered op by op.
      Its gradient there is jax's: a function jax cannot differentiate in reverse mode (a
      ``pallas_call``) is given as a ``jax.custom_vjp`` with its backward, as in JAX. Eager,
      inductor and XLA keep calling ``implementation`` (and ``backward``).
    - ``name``: the kernel's name (default ``implementation.__name__``); the HOP is
      registered as ``hops_kernel_<name>``. Defining a different kernel under a taken name
      is a ``ValueError``; redefining the same function (a module reload) replaces it.

    Call the result with tensors positionally and parameters by keyword. Parameters must
    be hashable typed constants; anything else raises ``TypeError`` naming the kernel and
    the parameter.
    """
    if abstract is None:
        raise TypeError(
            "kernel: abstract= is required: a function of the kernel's arguments (fake "
            "tensors) that returns fake outputs of the right shapes and dtypes"
        )
    for argument, value in (("abstract", abstract), ("backward", backward), ("jvp", jvp), ("xla", xla), ("jax", jax)):
        if value is not None and not callable(value):
            raise TypeError(f"kernel: {argument} must be callable, got {type(value).__name__} {value!r}")
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ValueError(f"kernel: name must be a Python identifier, got {name!r}")

    def define(fn: Callable) -> Kernel:
        if not callable(fn):
            raise TypeError(f"kernel: hops.kernel must decorate a callable, got {type(fn).__name__}")
        kernel_name = name if name is not None else getattr(fn, "__name__", "")
        if not isinstance(kernel_name, str) or not kernel_name.isidentifier():
            raise ValueError(
                f"kernel: {_origin(fn)} has no usable name ({kernel_name!r}); pass name=... "
                "(a Python identifier)"
            )
        existing = _compat.registered_hop(f"hops_kernel_{kernel_name}")
        if existing is not None and not (isinstance(existing, Kernel) and existing.origin == _origin(fn)):
            where = existing.origin if isinstance(existing, Kernel) else type(existing).__name__
            raise ValueError(
                f"kernel({kernel_name}): a kernel named {kernel_name!r} is already defined (by {where}); "
                f"{_origin(fn)} needs another name: pass name=..."
            )
        defined = Kernel(fn, name=kernel_name, abstract=abstract, backward=backward, xla=xla, jvp=jvp, jax=jax)
        _register_rules(defined)
        _KERNELS[kernel_name] = defined
        _kernel_op(defined)  # its torch.library op exists from now on (see Kernel.op)
        return defined

    return define if implementation is None else define(implementation)


def _register_rules(kernel_hop: Kernel) -> None:
    """One rule per dispatch key (defined below, in key order), bound to this kernel."""
    kernel_hop.py_impl(DispatchKey.CompositeExplicitAutograd)(functools.partial(_eager, kernel_hop))
    if kernel_hop.xla_implementation is not None:
        kernel_hop.py_impl(DispatchKey.XLA)(functools.partial(_xla, kernel_hop))
    kernel_hop.py_impl(FakeTensorMode)(functools.partial(_fake, kernel_hop))
    kernel_hop.py_functionalize_impl(functools.partial(_functionalize, kernel_hop))
    kernel_hop.py_impl(ProxyTorchDispatchMode)(functools.partial(_proxy, kernel_hop))
    kernel_hop.py_impl(DispatchKey.Autograd)(functools.partial(_autograd, kernel_hop))
    grad, jvp, vmap = _compat.transform_types()
    kernel_hop.py_impl(grad)(functools.partial(_differentiate, kernel_hop))
    kernel_hop.py_impl(jvp)(functools.partial(_differentiate, kernel_hop))
    kernel_hop.py_impl(vmap)(functools.partial(_vmap, kernel_hop))
    kernel_hop.py_impl(DispatchKey.FuncTorchGradWrapper)(_compat.dead_wrapper_rule(kernel_hop))
    _compat.redirect_checkpoint_modes(kernel_hop)  # selective checkpointing: one op
    _dynamo.register_plain_hop(kernel_hop)
    _inductor.register_inductor_rule(kernel_hop)(functools.partial(_inductor_rule, kernel_hop))


def _split(tensors_and_params: Sequence[Any]) -> tuple[tuple[torch.Tensor, ...], KernelParams]:
    return tuple(tensors_and_params[:-1]), tensors_and_params[-1]


def _check_outputs(
    kernel_hop: Kernel, outputs: Any, what: str, inputs: Sequence[torch.Tensor]
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``outputs`` as a Tensor or a tuple of Tensors; else an error naming the kernel and
    ``what`` produced them. An output that aliases an input (or an earlier output) is
    returned as a copy: a kernel call's results are new tensors."""
    flat = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    if not isinstance(flat, (tuple, list)) or not flat or not all(isinstance(o, torch.Tensor) for o in flat):
        shown = pytree.tree_map(lambda o: type(o).__name__, outputs) if isinstance(outputs, (tuple, list)) else type(outputs).__name__
        raise TypeError(
            f"{kernel_hop.describe()}: {what} returned {shown}, expected a Tensor or a non-empty "
            "tuple of Tensors"
        )
    flat = fresh_outputs(flat, inputs)
    return flat[0] if isinstance(outputs, torch.Tensor) else flat


# --------------------------------------------------------------------------- eager


def _eager(kernel_hop: Kernel, *tensors_and_params: Any):
    tensors, params = _split(tensors_and_params)
    versions = [version_counter(t) for t in tensors]
    outputs = kernel_hop.implementation(*tensors, **params.as_dict())
    for i, (t, version) in enumerate(zip(tensors, versions)):
        if version_counter(t) != version:
            raise ValueError(
                f"{kernel_hop.describe()}: the kernel wrote into its input {kernel_hop.input_name(i)} in place; "
                "a kernel must be functional (return new tensors)"
            )
    outputs = _check_outputs(kernel_hop, outputs, "the kernel", tensors)
    _check_against_abstract(kernel_hop, tensors, params, outputs, "the kernel")
    return outputs


def _xla(kernel_hop: Kernel, *tensors_and_params: Any):
    # XLA tensors: the kernel's XLA implementation (registered only when one was given).
    tensors, params = _split(tensors_and_params)
    outputs = kernel_hop.xla_implementation(*tensors, **params.as_dict())
    outputs = _check_outputs(kernel_hop, outputs, "its xla implementation", tensors)
    _check_against_abstract(kernel_hop, tensors, params, outputs, "its xla implementation")
    return outputs


def _metadata(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensors)


def _check_against_abstract(kernel_hop: Kernel, tensors: Sequence[torch.Tensor], params: KernelParams, outputs: Any, what: str) -> None:
    """Refuse a real result whose shapes or dtypes differ from what ``abstract`` promises:
    every tracer builds the graph from ``abstract``, so a lie there is a silently wrong
    compiled program. Checked once per input metadata and params (the promise is cached)."""
    key = (_metadata(tensors), params)
    promised = kernel_hop.abstract_cache.get(key)
    if promised is None:
        from hops._body_hop.body import fake_run_context, inspection_mode, stand_in

        mode = inspection_mode(tensors)
        with fake_run_context():
            fakes = [stand_in(t, mode) for t in tensors]
            with mode:
                result = kernel_hop.abstract_rule(*fakes, **params.as_dict())
        flat = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        promised = kernel_hop.abstract_cache[key] = tuple((tuple(o.shape), o.dtype) for o in flat)
    actual = tuple((tuple(o.shape), o.dtype) for o in ((outputs,) if isinstance(outputs, torch.Tensor) else outputs))
    if actual != promised:
        raise RuntimeError(
            f"{kernel_hop.describe()}: {what} returned {_describe(actual)} but its abstract rule "
            f"promises {_describe(promised)} for these inputs ({_describe(key[0])}); tracers build "
            "graphs from the abstract rule, so it must give the real result's shapes and dtypes"
        )


def _describe(metadata: Sequence[tuple]) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype, *_ in metadata)


# --------------------------------------------------------------------------- fake


def _fake(kernel_hop: Kernel, mode: FakeTensorMode, *tensors_and_params: Any):
    tensors, params = _split(tensors_and_params)
    with mode:
        outputs = kernel_hop.abstract_rule(*tensors, **params.as_dict())
    outputs = _check_outputs(kernel_hop, outputs, "abstract", tensors)
    for j, output in enumerate((outputs,) if isinstance(outputs, torch.Tensor) else outputs):
        if not isinstance(output, FakeTensor):
            raise TypeError(
                f"{kernel_hop.describe()}: abstract returned a real tensor as output[{j}]; build "
                "outputs from the (fake) inputs, e.g. x.new_empty(shape)"
            )
    return outputs


# --------------------------------------------------------------------------- functionalize


def _functionalize(kernel_hop: Kernel, ctx: Any, *tensors_and_params: Any):
    tensors, params = _split(tensors_and_params)
    unwrapped = ctx.unwrap_tensors(tensors)
    with ctx.redispatch_to_next():
        outputs = kernel_hop(*unwrapped, params)
    return wrap_functional(ctx, outputs)


# --------------------------------------------------------------------------- proxy


def _proxy(kernel_hop: Kernel, mode: ProxyTorchDispatchMode, *tensors_and_params: Any):
    refuse_untracked_xla_operands(mode, tensors_and_params[:-1], kernel_hop.describe())
    with disable_proxy_modes_tracing():
        outputs = kernel_hop(*tensors_and_params)
    node_args = pytree.tree_map(mode.tracer.unwrap_proxy, tuple(tensors_and_params))
    _inductor.ensure_lowering_pass()
    _export.note_recorded()
    out_proxy = mode.tracer.create_proxy("call_function", kernel_hop, node_args, {})
    return track_tensor_tree(outputs, out_proxy, constant=None, tracer=mode.tracer)


# --------------------------------------------------------------------------- autograd


class _KernelFunction(torch.autograd.Function):
    """A kernel's derivatives: its ``backward`` (reverse mode). It has no forward-mode rule:
    forward AD and ``jvp`` are refused, naming the kernel. New-style, so torch.func
    transforms go through it."""

    @staticmethod
    def forward(kernel_hop: Kernel, params: KernelParams, *inputs: torch.Tensor):
        with torch._C._AutoDispatchBelowAutograd():
            return kernel_hop(*inputs, params)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, result: Any) -> None:
        kernel_hop, params, *tensors = inputs
        outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        ctx.kernel_hop, ctx.params = kernel_hop, params
        if is_tracing(tensors):
            # The backward is traced in the same trace: hold the outputs as they are. Saved
            # with save_for_backward, they would gain detach nodes (in the forward graph on
            # torch 2.13, in the backward graph on 2.9).
            ctx.save_for_backward(*tensors)
            ctx.traced_outputs = outputs
        else:
            ctx.save_for_backward(*tensors, *outputs)
            ctx.traced_outputs = None
        ctx.save_for_forward(*tensors)
        not_differentiable = [o for o in outputs if not (o.is_floating_point() or o.is_complex())]
        if not_differentiable:
            ctx.mark_non_differentiable(*not_differentiable)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor):
        saved = ctx.saved_tensors
        if ctx.traced_outputs is None:
            inputs, outputs = saved[: len(saved) - len(grad_outputs)], saved[len(saved) - len(grad_outputs) :]
        else:
            inputs, outputs = saved, ctx.traced_outputs
        grads = ctx.kernel_hop.run_backward(inputs, outputs, grad_outputs, ctx.params, ctx.needs_input_grad[2:])
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, _kernel: Any, _params: Any, *tangents: Any):
        kernel_hop = ctx.kernel_hop
        if kernel_hop.jvp_rule is None:
            raise NotImplementedError(
                f"{kernel_hop.describe()}: no forward-mode derivative (forward AD, torch.func.jvp, "
                "jacfwd, linearize, hessian): give hops.kernel(jvp=...), or use reverse mode "
                "(torch.func.grad, jacrev)"
            )
        inputs = ctx.saved_tensors  # save_for_forward's: the inputs
        tangents = [torch.zeros_like(x) if t is None else t for x, t in zip(inputs, tangents)]
        result = kernel_hop.jvp_rule(*inputs, *tangents, **ctx.params.as_dict())
        return result if isinstance(result, torch.Tensor) else tuple(result)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, kernel_hop: Kernel, params: KernelParams, *inputs: torch.Tensor):
        return _per_sample(kernel_hop, params, inputs, in_dims[2:], info.batch_size)


def _autograd(kernel_hop: Kernel, *tensors_and_params: Any):
    tensors, params = _split(tensors_and_params)
    # Forward-mode tangents count too: below autograd they would be dropped.
    needs = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if needs or _compat.has_forward_tangent(tensors):
        return _KernelFunction.apply(kernel_hop, params, *tensors)
    with torch._C._AutoDispatchBelowAutograd():
        return kernel_hop(*tensors, params)


# --------------------------------------------------------------------------- torch.func


def _differentiate(kernel_hop: Kernel, interpreter: Any, *tensors_and_params: Any):
    # torch.func routes the Function to its own rules, which call the kernel at the level below.
    tensors, params = _split(tensors_and_params)
    if _compat.differentiating_over_functionalize():
        raise NotImplementedError(
            f"{kernel_hop.describe()}: torch.func cannot differentiate a kernel under torch.func.functionalize "
            "(torch has no functionalize rule for custom autograd Functions); functionalize inside the "
            "gradient (grad(functionalize(f))), or trace with make_fx / torch.compile, which functionalize themselves"
        )
    return _KernelFunction.apply(kernel_hop, params, *tensors)


def _vmap(kernel_hop: Kernel, interpreter: Any, *tensors_and_params: Any):
    tensors, params = _split(tensors_and_params)
    unwrapped, in_dims = _compat.unwrap_batched(tuple(tensors), interpreter.level())
    with interpreter.lower():
        if all(d is None for d in in_dims):
            return kernel_hop(*unwrapped, params)
        result, out_dims = _per_sample(kernel_hop, params, unwrapped, in_dims, interpreter.batch_size())
    return _compat.wrap_batched(result, out_dims, interpreter.level())


def _per_sample(kernel_hop: Kernel, params: KernelParams, inputs: Sequence[Any], in_dims: Sequence[Any], size: int):
    """An opaque kernel has no batching rule: it runs once per sample, the results stacked
    at dim 0 (what ``vmap`` means, one kernel call per sample)."""
    per_sample = []
    for b in range(size):
        args = [t if d is None else t.select(d, b) for t, d in zip(inputs, in_dims)]
        result = kernel_hop(*args, params)
        per_sample.append((result,) if isinstance(result, torch.Tensor) else tuple(result))
    stacked = tuple(torch.stack([sample[j] for sample in per_sample]) for j in range(len(per_sample[0])))
    if len(stacked) == 1 and isinstance(result, torch.Tensor):
        return stacked[0], 0
    return stacked, tuple(0 for _ in stacked)


# --------------------------------------------------------------------------- as a torch.library op

_OPS = torch.library.Library("hops_kernels", "DEF")
_OP_OF: dict[str, tuple[str, torch._ops.OpOverload]] = {}  # kernel name -> (origin, op)


@functools.lru_cache(maxsize=None)
def _params_of(text: str) -> KernelParams:
    from hops.specs import spec_from_text

    return spec_from_text(text)


def _kernel_op(kernel_hop: Kernel) -> torch._ops.OpOverload:
    """Define ``hops_kernels::<name>`` once per kernel name (when the kernel is defined, so a
    compiled program loaded from a cache finds its op). Its implementations look the kernel
    up by name when called: redefining the same function (a module reload) updates them."""
    name = kernel_hop.kernel_name
    known = _OP_OF.get(name)
    if known is not None:
        if known[0] != kernel_hop.origin:
            raise ValueError(f"{kernel_hop.describe()}: an op hops_kernels::{name} is already defined by {known[0]}")
        return known[1]

    def current() -> Kernel:
        return _KERNELS[name]

    def as_list(outputs: Any) -> list[torch.Tensor]:
        return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)

    def call(inputs: list[torch.Tensor], params: str) -> list[torch.Tensor]:
        return as_list(_eager(current(), *inputs, _params_of(params)))

    def call_on_xla(inputs: list[torch.Tensor], params: str) -> list[torch.Tensor]:
        kernel_now = current()
        run = _eager if kernel_now.xla_implementation is None else _xla
        return as_list(run(kernel_now, *inputs, _params_of(params)))

    def fake(inputs: list[torch.Tensor], params: str) -> list[torch.Tensor]:
        kernel_now = current()
        return as_list(_check_outputs(kernel_now, kernel_now.abstract_rule(*inputs, **_params_of(params).as_dict()), "abstract", inputs))

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        tensors, params = inputs
        ctx.save_for_backward(*tensors, *output)
        ctx.num_inputs, ctx.params = len(tensors), _params_of(params)

    def backward(ctx: Any, grads: list[torch.Tensor]) -> tuple:
        saved = ctx.saved_tensors
        inputs, outputs = saved[: ctx.num_inputs], saved[ctx.num_inputs :]
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]
        needs = [True] * ctx.num_inputs
        result = current().run_backward(inputs, outputs, grads, ctx.params, needs)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(result, inputs)], None

    _OPS.define(f"{name}(Tensor[] inputs, str params) -> Tensor[]")
    _OPS.impl(name, call, "CompositeExplicitAutograd")
    # Every kernel gets the XLA implementation: without ``xla=`` it is the kernel's own on
    # XLA tensors (what the eager rule does), and a reload may add one.
    _OPS.impl(name, call_on_xla, "XLA")
    torch.library.register_fake(f"hops_kernels::{name}", fake, lib=_OPS)
    # A kernel without ``backward=`` refuses a gradient by name (``run_backward``).
    torch.library.register_autograd(f"hops_kernels::{name}", backward, setup_context=setup_context, lib=_OPS)
    op = getattr(torch.ops.hops_kernels, name).default
    _OP_OF[name] = (kernel_hop.origin, op)
    return op


# --------------------------------------------------------------------------- inductor


def _inductor_rule(kernel_hop: Kernel, *tensors_and_params: Any) -> Any:
    """Inductor calls the kernel's ``torch.library`` op, an opaque fallback; a kernel made of
    torch ops inductor optimizes (``hops_transparent``: einsum) is those ops."""
    tensors, params = _split(tensors_and_params)
    if getattr(kernel_hop, "hops_transparent", False):
        return kernel_hop.implementation(*tensors, **params.as_dict())
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        single = isinstance(kernel_hop.abstract_rule(*tensors, **params.as_dict()), torch.Tensor)
    result = kernel_hop.op(list(tensors), repr(params))
    return result[0] if single else tuple(result)

