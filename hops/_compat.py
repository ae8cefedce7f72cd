"""Every difference between the supported torch versions (2.9 .. 2.15) lives here.

The rest of the package imports these names instead of probing torch itself, so a new
torch release means editing one file. Private torch APIs whose shape differs between the
versions, or that reach into Dynamo's and autograd's internals, are wrapped here, each with
the reason it is needed.

What is imported directly where it is used, the same in 2.9 .. 2.15 unless noted
(tests/test_private_torch_symbols.py has a canary for each symbol and checks that this list
names the module of each one used outside this file):

- what every HOP in torch itself is built on: ``torch._ops`` (``HigherOrderOperator``,
  ``OpOverload``), ``torch._C``'s dispatch keys and guards, fake and functional tensors
  (``torch._subclasses.fake_tensor``, ``torch._subclasses.functional_tensor``, and torch's
  ``torch._to_functional_tensor``, ``torch._from_functional_tensor``,
  ``torch._is_functional_tensor``, ``torch._sync``), ``torch._higher_order_ops.utils``,
  ``torch.utils._pytree``, ``torch.fx.experimental.proxy_tensor``, ``torch._guards``
  (``detect_fake_mode``; ``TracingContext`` in ``passes/jax/backend.py``);
- dispatch modes (``torch.utils._python_dispatch``): ``hops/_eager_graph.py``,
  ``hops/_body_hop/body.py``, ``hops/_body_hop/joint.py``, ``passes/xla/staging.py``;
- AOTAutograd's joint export and partitioner, for a graph function's backward
  (``torch._functorch.aot_autograd.aot_export_joint_simple``,
  ``torch._functorch.partitioners.default_partition``: ``hops/_graph_function.py``);
- Dynamo's guards, sources, exceptions and variable trackers in ``hops/_dynamo.py``
  (``torch._dynamo.guards``, ``torch._dynamo.source``, ``torch._dynamo.exc``,
  ``torch._dynamo.variables.builder``, ``torch._dynamo.variables.higher_order_ops``,
  ``torch._dynamo.variables.lazy``, ``torch._dynamo.variables.lists``,
  ``torch._dynamo.variables.tensor``);
- in ``passes/``: inductor's compiler (``torch._inductor.compile_fx``, ``passes/backends.py``),
  Dynamo's AOTAutograd backend helper (``torch._dynamo.backends.common``, ``passes/xla/`` and
  ``passes/jax/``), ATen's decompositions (``torch._decomp``), torch_xla's ``_XLAC`` bindings
  in ``passes/xla/`` (torch_xla has one supported version);
- DTensor's sharding propagator (``torch.distributed.tensor.DTensor._op_dispatcher``: its rule
  tables in ``passes/solver/_dtensor.py``, its cache's schema info in
  ``passes/dtensor/runtime.py``), and the strategy types and helpers its rules use
  (``torch.distributed.tensor._op_schema``, ``torch.distributed.tensor._dtensor_spec``,
  ``torch.distributed.tensor._ops._einsum_strategy``,
  ``torch.distributed.tensor._ops.single_dim_strategy`` (absent in 2.9),
  ``torch.distributed.tensor._ops.utils``) with ``torch.testing._internal.distributed.fake_pg``'s
  fake store: listed in ``passes/solver/_dtensor.py`` with how they differ between versions
  (``hops/`` never needs them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Iterator

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]


def torch_xla_available() -> bool:
    """True when torch_xla can be imported (it exists only for torch 2.9 here)."""
    return importlib.util.find_spec("torch_xla") is not None


def jax_x64() -> Any:
    """A context in which jax computes 64-bit dtypes as 64-bit (``jax_enable_x64``), for the
    calls inside it only: ``jax.enable_x64`` in jax 0.10 (the 2.13 / 2.15 venvs),
    ``jax.experimental.enable_x64`` in jax 0.7 (torch_xla 2.9's), which 0.10 no longer has."""
    import jax

    scoped = getattr(jax, "enable_x64", None)
    if scoped is None:
        from jax.experimental import enable_x64 as scoped
    return scoped(True)


def register_fx_global(name: str, import_str: str, obj: Any) -> None:
    """Make ``name`` resolvable in the globals of every FX-generated module.

    Spec values print as ``hops.Shard(0)``; FX codegen emits ``repr`` of unknown constants,
    so ``hops`` must be bound when the generated code runs, is deep-copied or pickled.
    ``_register_custom_builtin`` is private but has the same signature in 2.9, 2.13 and 2.15.
    """
    from torch.fx.graph import _register_custom_builtin

    _register_custom_builtin(name, import_str, obj)


def register_dynamo_hop_variable(hop: torch._ops.HigherOrderOperator, variable_cls: type) -> None:
    """Tell Dynamo which VariableTracker traces ``hop``.

    Dynamo looks HOPs up by ``__name__`` in a private table and graph-breaks on unknown ones;
    there is no public out-of-tree hook in 2.9, 2.13 or 2.15.
    """
    from torch._dynamo.variables import higher_order_ops

    higher_order_ops._hop_name_to_variable_class[hop.__name__] = variable_cls


def dynamo_hop_variable_base() -> type:
    from torch._dynamo.variables.higher_order_ops import TorchHigherOrderOperatorVariable

    return TorchHigherOrderOperatorVariable


def dynamo_graph_break(gb_type: str, context: str, explanation: str, from_exc: BaseException | None = None) -> None:
    """Stop Dynamo tracing here with a structured reason (an error under ``fullgraph=True``).

    2.9 names the structured form ``unimplemented_v2`` (its ``unimplemented`` takes a message);
    2.13 renamed it ``unimplemented`` (``PRIVATE_SYMBOLS_UNTIL``).
    """
    from torch._dynamo import exc

    graph_break = exc.unimplemented_v2 if TORCH_VERSION < (2, 13) else exc.unimplemented
    extra = {} if from_exc is None else {"from_exc": from_exc}
    graph_break(gb_type=gb_type, context=context, explanation=explanation, hints=[], **extra)


_WRAPPER_HASATTR = "torch._dynamo.variables.functions.WrapperUserFunctionVariable.call_obj_hasattr"


@torch.compiler.assume_constant_result
def _dynamo_traces_compiled_function_hasattr() -> bool:
    """Torch 2.9 only: let Dynamo trace ``hasattr`` of a ``torch.compile``d function, which
    ``compiled_function_inside`` asks. 2.9's ``WrapperUserFunctionVariable`` (private) traces
    only a call and the wrapped function's attribute, and neither ``getattr`` with a default
    nor ``try``/``except`` tell a wrapper from another function there; 2.13 traces it itself.
    The one method 2.9 lacks (answered from the wrapper itself) is added the first time Dynamo
    traces a scan: ``assume_constant_result`` has Dynamo run this function itself, not trace
    it. Not at import: importing the package changes nothing in torch. Kept if something
    else installed one first. Listed in ``COMPILE_PATCHES``."""
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.functions import WrapperUserFunctionVariable

    if "call_obj_hasattr" not in vars(WrapperUserFunctionVariable):

        def call_obj_hasattr(self: Any, tx: Any, name: str) -> Any:
            return ConstantVariable.create(hasattr(self.wrapper_obj, name))

        WrapperUserFunctionVariable.call_obj_hasattr = call_obj_hasattr
    return True


def compiled_function_inside(fn: Any) -> Any:
    """Under Dynamo 2.9, the function a ``torch.compile``d ``fn`` wraps (Dynamo inlines it
    at the call anyway): 2.9 traces neither ``callable`` of the wrapper nor its name, and
    ``hasattr`` only once ``_dynamo_traces_compiled_function_hasattr`` taught it. Else ``fn``
    itself. ``_torchdynamo_inline`` is torch.compile's private attribute for the wrapped function."""
    if TORCH_VERSION >= (2, 13) or not torch.compiler.is_dynamo_compiling():
        return fn
    _dynamo_traces_compiled_function_hasattr()
    return fn._torchdynamo_inline if hasattr(fn, "_torchdynamo_inline") else fn


def dynamo_graph_breaks_are_errors(tx: Any) -> bool:
    """Whether a graph break here fails the compile (``fullgraph=True``, or
    ``torch._dynamo.error_on_graph_break``): the tracer's ``one_graph`` /
    ``error_on_graph_break`` (private, both present from 2.9 to 2.15)."""
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def is_dynamo_exception(error: BaseException) -> bool:
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(error, TorchDynamoException)


def is_dynamo_graph_break(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo giving up on the code it traces (``Unsupported``), not
    the traced code failing."""
    from torch._dynamo.exc import Unsupported

    return isinstance(error, Unsupported)


def is_dynamo_observed_exception(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo's stand-in for an exception the traced code raised."""
    from torch._dynamo.exc import ObservedException

    return isinstance(error, ObservedException)


def dynamo_speculate_subgraph(tx: Any, body: Any, body_inputs: list, hop: Any) -> tuple:
    """Trace ``body`` (a VariableTracker) into a subgraph with Dynamo's own machinery.

    Returns ``(graph, lifted, treespec)``: the graph takes one input per ``body_inputs`` entry
    (each a TensorVariable whose node's ``example_value`` gives the input's metadata), then
    the lifted closure values; ``lifted`` maps each outer proxy to its inner placeholder, in
    input order. The graph returns the flat leaves of what ``body`` returns, whose structure
    is ``treespec``. Writing into an input is traced (``hops._dynamo`` refuses it with this
    package's error, naming the input); an output that is an input is allowed (the HOP's
    rules return copies of such outputs, as in eager).

    ``speculate_subgraph`` is private but has these arguments from 2.9 to 2.15 (2.13 calls it
    the legacy path; newer torch HOPs use ``speculate_subgraph_with_auto_output_flattening``,
    absent in 2.9), so it may move.
    """
    from torch._dynamo.variables.higher_order_ops import speculate_subgraph

    (_output, output_spec), graph, lifted = speculate_subgraph(
        tx,
        body,
        body_inputs,
        {},
        hop.__name__,
        source_target=hop,
        set_subgraph_inputs="manual",
        should_flatten_outputs=True,
        remove_consts_from_outputs=False,
        supports_input_mutation=True,
        supports_aliasing=True,
    )
    return graph, lifted, output_spec.treespec


def dynamo_raised_exception(tx: Any) -> tuple[type, tuple] | None:
    """The class and arguments of the exception the code Dynamo traces just raised (after
    an ``ObservedException``), or None when the arguments are not constants.

    Private state, the same names from 2.9 to 2.15: the tracer's ``exn_vt_stack`` holds the
    raised exception's variable: for a class defined in Python, ``value_type`` / ``init_args``
    are the class and the constructor's arguments; for a builtin class, ``exc_type`` /
    ``args``."""
    current = getattr(getattr(tx, "exn_vt_stack", None), "_current_exception", None)
    exc_type = getattr(current, "value_type", None)
    init_args = getattr(current, "init_args", None)
    if not isinstance(exc_type, type) or init_args is None:
        exc_type, init_args = getattr(current, "exc_type", None), getattr(current, "args", None)
    if not isinstance(exc_type, type) or not isinstance(init_args, (list, tuple)):
        return None
    try:
        return exc_type, tuple(a.as_python_constant() for a in init_args)
    except NotImplementedError:
        return None


def dynamo_getattr(tx: Any, variable: Any, name: str) -> Any:
    """The VariableTracker of ``variable.name`` inside Dynamo's trace: ``var_getattr`` up to
    2.13; 2.15's frozen-dataclass variables answer ``tp_getattro_impl`` instead."""
    getattr_impl = getattr(variable, "var_getattr", None)
    if getattr_impl is not None:
        return getattr_impl(tx, name)
    return variable.tp_getattro_impl(tx, name)


def dynamo_unflatten(tx: Any, flat_variable: Any, treespec: Any) -> Any:
    """``pytree.tree_unflatten(list(flat_variable), treespec)`` inside Dynamo's trace, the way
    Dynamo's own HOP variables return structured results (private helpers, same in 2.9-2.15)."""
    import torch.utils._pytree as pytree
    from torch._dynamo.variables.builder import SourcelessBuilder
    from torch._dynamo.variables.higher_order_ops import _make_inlined

    flat_list = SourcelessBuilder.create(tx, list).call_function(tx, [flat_variable], {})
    return _make_inlined(tx, pytree.tree_unflatten)(flat_list, treespec)


def current_dispatch_mode() -> Any:
    """The innermost active TorchDispatchMode, or None (private, the same in 2.9 to 2.15)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def redirect_checkpoint_modes(hop: Any) -> None:
    """Selective activation checkpointing's dispatch modes treat ``hop`` as one op: cached
    whole in the forward, replayed or recomputed whole in the backward, as torch does for
    its own HOPs (``redirect_to_mode``; the modes are private in ``torch.utils.checkpoint``)."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    for mode_type in (_CachingTorchDispatchMode, _CachedTorchDispatchMode):

        def redirect(mode: Any, *args: Any, **kwargs: Any) -> Any:
            return mode.__torch_dispatch__(hop, [], args, kwargs)

        hop.py_impl(mode_type)(redirect)


def registered_hop(name: str) -> Any:
    """The HigherOrderOperator registered under ``name`` in torch's global HOP registry, or None.

    The registry (``torch._ops._higher_order_ops``) is private, the same dict in 2.9, 2.13 and 2.15;
    a new HOP silently replaces an old one of the same name, so ``hops.kernel`` checks it first.
    """
    return torch._ops._higher_order_ops.get(name)


@contextlib.contextmanager
def xla_named_scope(name: str) -> Iterator[None]:
    """Put the torch_xla IR nodes created inside into the op-name scope ``name``.

    torch_xla's profiler scopes (``xp.Trace`` / ``xp.trace_me`` use the same private
    ``torch_xla._XLAC.profiler.scope_pusher``) prefix each node's HLO ``op_name`` metadata with
    ``name.<n>/`` (torch_xla numbers every scope it opens). torch_xla records that metadata
    only while IR debug info is on (``XLA_HLO_DEBUG=1`` / ``XLA_IR_DEBUG=1`` or
    ``torch_xla._XLAC._set_ir_debug(True)``), both when nodes are created and when HLO is
    built; otherwise the scope is a no-op.
    """
    import torch_xla

    pusher = torch_xla._XLAC.profiler.scope_pusher(name)
    try:
        yield
    finally:
        del pusher


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """``torch.compile``d functions run as plain Python inside (``set_stance("force_eager")``,
    public since 2.6): this package's inspection and tracing of a body run its Python on fake
    tensors, where a compiled step must mean what its code says."""
    if torch.compiler.is_dynamo_compiling():
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def xla_ir_debug() -> bool:
    """Whether torch_xla records IR metadata (op-name scopes, source lines) right now."""
    import torch_xla

    return bool(torch_xla._XLAC._get_ir_debug())


# --------------------------------------------------------------------------- torch.func
#
# torch.func dispatches a HOP to ``functorch_table[TransformType.X]`` (``py_impl(TransformType.X)``);
# the helpers below are private in ``torch._functorch`` and the same in 2.9 .. 2.15.


def transform_types() -> tuple[Any, Any, Any]:
    """``(Grad, Jvp, Vmap)`` of ``torch._C._functorch.TransformType``."""
    from torch._C._functorch import TransformType

    return TransformType.Grad, TransformType.Jvp, TransformType.Vmap


@contextlib.contextmanager
def outside_functorch() -> Iterator[None]:
    """No torch.func transform is active inside (the interpreter stack is set aside, not
    disabled: under ``_DisableFuncTorch`` a wrapped tensor reaching a HOP would dispatch to a
    functorch key with no interpreter to run it)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield


def caller_saved_tensors_hooks() -> bool:
    """Whether the caller has saved-tensor hooks active (an offloading hook, checkpointing).
    torch.func.grad / vjp refuse to run under any (``_top_saved_tensors_default_hooks`` is
    private, the same in 2.9 .. 2.15)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def functorch_active() -> bool:
    """Whether a torch.func transform is active (its interpreter stack is not empty)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def differentiating_over_functionalize() -> bool:
    """Whether a torch.func derivative (grad, vjp, jvp, ...) is taken of a function under
    ``torch.func.functionalize``: torch has no functionalize rule for autograd Functions, so
    none can run there."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    below_functionalize = False
    for interpreter in retrieve_all_functorch_interpreters():  # outermost first
        if interpreter.key() == TransformType.Functionalize:
            below_functionalize = True
        elif below_functionalize and interpreter.key() in (TransformType.Grad, TransformType.Jvp):
            return True
    return False


def peel_functorch(t: torch.Tensor) -> torch.Tensor:
    """The tensor under every torch.func wrapper (GradTrackingTensor, BatchedTensor)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def is_legacy_batched(t: Any) -> bool:
    """Whether ``t`` is batched by torch's legacy vmap (``torch._vmap_internals``, what
    ``torch.autograd.functional.jacobian(vectorize=True)`` uses): its dispatch key has no
    Python name, so a HOP cannot register a rule for it. Private, the same in 2.9 to 2.15."""
    return isinstance(t, torch.Tensor) and bool(torch._C._functorch.is_legacy_batchedtensor(t))


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    from torch._C._functorch import is_functorch_wrapped_tensor

    return bool(is_functorch_wrapped_tensor(t))


def has_forward_tangent(values: Any) -> bool:
    """Whether forward-mode AD carries a tangent on any of ``values`` (a plain
    ``forward_ad.dual_level``, ``torch.func.jvp`` or ``linearize``)."""
    import torch.autograd.forward_ad as fwAD

    if not torch._C._is_fwd_grad_enabled():
        return False
    return any(isinstance(v, torch.Tensor) and fwAD.unpack_dual(v).tangent is not None for v in values)


def unwrap_batched(values: tuple, level: int) -> tuple[tuple, tuple]:
    from torch._functorch.vmap import unwrap_batched as unwrap

    return unwrap(values, level)


def wrap_batched(values: tuple, out_dims: tuple, level: int) -> Any:
    from torch._functorch.vmap import wrap_batched as wrap

    return wrap(values, out_dims, level)


def dead_wrapper_rule(hop: Any) -> Any:
    """The rule for ``DispatchKey.FuncTorchGradWrapper``: a ``vjp_fn`` called after
    ``torch.func.vjp`` returned runs its backward on wrappers of a finished level. ATen
    unwraps them in C++; a HOP must do it itself (``unwrap_if_dead``) and call again."""
    import torch.utils._pytree as pytree
    from torch._C._functorch import unwrap_if_dead

    from hops._errors import hop_prefix

    def rule(*args: Any, **kwargs: Any) -> Any:
        unwrapped = pytree.tree_map_only(torch.Tensor, unwrap_if_dead, (args, kwargs))
        before = pytree.tree_leaves((args, kwargs))
        if all(a is b for a, b in zip(before, pytree.tree_leaves(unwrapped))):
            raise RuntimeError(
                f"{hop_prefix(hop)}: {hop.__name__} reached with a live torch.func tensor while torch.func dispatch is "
                "disabled; call it inside the transform"
            )
        args, kwargs = unwrapped
        return hop(*args, **kwargs)

    return rule


# --------------------------------------------------------------------------- inductor
#
# Inductor lowers ATen ops and torch's own HOPs. Its extension point used here is the
# post-grad custom pass (``torch._inductor.config.post_grad_custom_pre_pass``, public config
# with the same meaning in 2.9 .. 2.15): inductor runs it on each forward and backward graph
# after AOTAutograd and before lowering, and includes its ``uuid()`` in its FX graph cache
# key (a ``CustomGraphPass``). The alternative, entries in inductor's decomposition table,
# is read by every tracer that borrows the table (autoparallel, ``aot_export_joint_with_
# descriptors(decompositions=select_decomp_table())``), which would then lose the HOPs.
# Lowering registrations (``torch._inductor.lowering.register_lowering``) cannot do it
# either: a scan must become a ``while_loop`` node, whose lowering reads its FX node.


def inductor_decompositions() -> dict:
    """Inductor's decomposition table (``select_decomp_table``, private, the same in 2.9 ..
    2.15): what a HOP's replacement is traced with, so inductor gets the ops it expects."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@contextlib.contextmanager
def inductor_tracing(fake_mode: Any) -> Iterator[None]:
    """Trace a replacement into a post-grad graph: in the graph's fake mode, with the Python
    dispatcher (symbolic sizes) and node metadata carried over, as inductor's own
    replacements are traced (``pattern_matcher.fwd_only``)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.traceback import preserve_node_meta

    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(preserve_node_meta())
        yield


# What compiling a program holding a HOP changes in torch's functions, by version, each
# installed once: before 2.15, the wrap of ``SubgraphLowering.__init__`` by
# ``undonated_subgraph_inputs`` (the first compile whose graph the lowering pass changed); on
# 2.9, the method ``_dynamo_traces_compiled_function_hasattr`` adds (the first scan Dynamo
# traces); nothing from 2.15 on. Tested by tests/test_inductor_pass_chaining.py against a
# snapshot taken after compiling every sample.
COMPILE_PATCHES: tuple[str, ...] = (
    *(("torch._inductor.graph.SubgraphLowering.__init__",) if TORCH_VERSION < (2, 15) else ()),
    *((_WRAPPER_HASATTR,) if TORCH_VERSION < (2, 13) else ()),
)
_UNDONATED_WRAPPERS: set = set()  # the wrappers installed (no attribute of our own on torch's)


def undonated_subgraph_inputs() -> None:
    """Keep inductor from overwriting the inputs of a subgraph it lowers (a ``while_loop``'s
    body and condition, a scan's lowering) as donated buffers.

    AOTAutograd marks the backward's saved activations that nothing else holds as donated:
    inductor may reuse their storage for the backward's outputs. The list is by the
    backward's placeholder positions, and before torch 2.15 (pytorch/pytorch#193960) each
    subgraph lowering (``torch._inductor.graph.SubgraphLowering``, private, the same class
    from 2.9) read the same list against its own placeholders: a loop-body input at a listed
    position, say a parameter a scan's step reads at every step, was reused for a result in
    the first iteration, so later steps read that result (wrong gradients, the parameter
    itself overwritten). ``SubgraphLowering.__init__`` is wrapped, once, to clear the
    subgraph's list, as 2.15's does; the top-level backward keeps its donations. Called by
    the lowering pass before inductor lowers the graph it changed. Listed in ``COMPILE_PATCHES``."""
    if not COMPILE_PATCHES:
        return
    import functools

    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__
    if init in _UNDONATED_WRAPPERS:
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.bw_donated_idxs = None

    _UNDONATED_WRAPPERS.add(__init__)
    SubgraphLowering.__init__ = __init__


def inductor_graph_pass(function: Any) -> type:
    """A ``CustomGraphPass`` class running ``function(graph)`` and then the pass it was
    installed over (a user's), with a ``uuid`` from this package's sources and that pass's
    (so inductor's FX graph cache misses when either changes)."""
    import pathlib

    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    sources = tuple(sorted(str(p) for p in pathlib.Path(__file__).parent.rglob("*.py")))

    class GraphPass(CustomGraphPass):
        def __init__(self, then: Any = None) -> None:
            self.then = then

        def __call__(self, graph: Any) -> None:
            function(graph)
            if self.then is not None:
                self.then(graph)

        def uuid(self) -> Any:
            then = None
            if self.then is not None:
                then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
                if then is None:  # a plain callable: inductor cannot key its cache on it
                    return None
            return (get_hash_for_files(sources), then)

    GraphPass.__name__ = GraphPass.__qualname__ = function.__name__
    return GraphPass


def install_inductor_pass(pass_type: type) -> None:
    """Make inductor run ``pass_type()`` on the graphs it compiles, before whatever post-grad
    custom pass is set now (kept, and run after it).

    Torch 2.9 .. 2.15 offer inductor no registration point for an out-of-tree HOP (its
    ``lowerings`` take IR, and a scan must become a ``while_loop`` FX node first), so the
    package never sets this at import: it is called when a HOP node is recorded (a Dynamo
    trace or a ``make_fx`` trace of a program holding one), wrapping the user's pass set
    before or after ``import hops``; a pass the user sets later is wrapped at the next trace."""
    from torch._inductor import config

    current = config.post_grad_custom_pre_pass
    if isinstance(current, pass_type):
        return
    config.post_grad_custom_pre_pass = pass_type(current)


# --------------------------------------------------------------------------- torch.export
#
# torch.export's serializer (``torch._export.serde.serialize``, private; the same in 2.9, 2.13
# and 2.15) has one registration point, an extension namespace (``register_extension``): any
# operator name written ``#<namespace>:<name>`` (a node's target, an operator argument, a
# ``source_fn_stack`` entry) is read back by that namespace's ``from_op_name``. The package
# registers the namespace ``hops`` at import; that is all the import does to the serializer.
#
# Writing has no registration point on any supported version: the serializer refuses a
# constant argument of a type it does not know (a spec), and a tuple of subgraphs (a
# ``local_map`` node with alternatives: its list arguments hold tensors, not graphs), and
# writes every HOP's target as ``torch.ops.higher_order.<name>``, read back without a call
# into the package. Reading a tuple of subgraphs back needs the node's arguments regrouped,
# and nothing is called before them but the target's lookup. So on 2.9, 2.13 and 2.15 the
# methods in ``EXPORT_PATCHES`` are wrapped, once, each passing what is not the package's to
# torch's own: not at import, but the first time a HOP node is recorded under torch.export,
# or a HOP's target is read back from a saved program (its ``#hops:`` name is read before
# the node's arguments, so a process that only imported the package and loads a program
# regroups its first node already, and can save the program again).
EXPORT_PATCHES: tuple[str, ...] = (
    "torch._export.serde.serialize.GraphModuleDeserializer.deserialize_hoo_inputs",
    "torch._export.serde.serialize.GraphModuleSerializer.serialize_hoo_inputs",
    "torch._export.serde.serialize.GraphModuleSerializer.serialize_input",
    "torch._export.serde.serialize.GraphModuleSerializer.serialize_operator",
)
_EXPORT_NAMESPACE = "hops"


def _export_quote(name: str) -> str:  # ``from_op_name`` gets the text after the one ':'
    return name.replace("%", "%25").replace(":", "%3A")


def _export_unquote(name: str) -> str:
    return name.replace("%3A", ":").replace("%25", "%")


def register_export_namespace(value_of: Any) -> None:
    """Register the extension namespace ``hops``: a name written ``#hops:<name>`` is read back
    as ``value_of(name)``."""
    from torch._export.serde import serialize

    if _EXPORT_NAMESPACE in serialize._deserialization_registry:
        return

    class HopsExportNames(serialize.ExtensionHandler):
        # Also the registered "node target type": none is ever an instance of it.
        @classmethod
        def namespace(cls) -> str:
            return _EXPORT_NAMESPACE

        @classmethod
        def from_op_name(cls, name: str) -> Any:
            return value_of(_export_unquote(name))

    serialize.register_extension(HopsExportNames, HopsExportNames)


_export_serializer_installed = False


def install_export_serializer(name_of: Any, flatten: Any, regroup: Any) -> None:
    """Wrap the methods in ``EXPORT_PATCHES``, once: a value with a ``name_of`` (a spec, a HOP
    target, a bodies marker) is written as ``#hops:<name>``; a HOP node's arguments are written
    ``flatten``-ed and read back ``regroup``-ed."""
    from torch._export.serde import serialize

    global _export_serializer_installed
    if _export_serializer_installed:
        return
    _export_serializer_installed = True
    writer, reader = serialize.GraphModuleSerializer, serialize.GraphModuleDeserializer
    write_operator, write_input = writer.serialize_operator, writer.serialize_input
    write_hop_inputs, read_hop_inputs = writer.serialize_hoo_inputs, reader.deserialize_hoo_inputs

    def named(value: Any) -> str | None:
        name = name_of(value)
        return None if name is None else f"#{_EXPORT_NAMESPACE}:{_export_quote(name)}"

    def serialize_operator(self: Any, target: Any) -> str:
        name = named(target)
        return write_operator(self, target) if name is None else name

    def serialize_input(self: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
        name = named(arg)
        if name is None:
            return write_input(self, arg, *args, **kwargs)
        return serialize.Argument.create(as_operator=name)

    def serialize_hoo_inputs(self: Any, args: Any, kwargs: Any) -> Any:
        return write_hop_inputs(self, flatten(args), kwargs)

    def deserialize_hoo_inputs(self: Any, inputs: Any) -> Any:
        args, kwargs = read_hop_inputs(self, inputs)
        return regroup(args), kwargs

    writer.serialize_operator, writer.serialize_input = serialize_operator, serialize_input
    writer.serialize_hoo_inputs, reader.deserialize_hoo_inputs = serialize_hoo_inputs, deserialize_hoo_inputs


# DTensor before torch 2.13 (checked: 2.9 differs, 2.13 and 2.15 do not):
# - its ``select.int`` rule gives a DTensor that is not sharded on the selected dim the input's
#   own spec as the output's, then writes the output's shape into it (pytorch/pytorch#179290),
#   so a second ``select`` of the same DTensor sees a wrong shape (``select_step`` avoids it);
# - its view rules cannot flatten dims sharded on different mesh axes (``(Shard(0), Shard(1))``
#   of ``[4, 8, 16]`` viewed as ``[32, 16]``): 2.13 lays the result out with ``_StridedShard``;
# - it has no rule for ``aten.fill.Scalar`` (2.13 runs it; ``lower_to_dtensor`` runs it by ``fill_``'s rule);
# - ``Replicate + Partial`` (the replicated operand first) all-reduces the ``Partial`` one, and
#   ``zeros_like`` of a ``Partial`` value is ``Replicate``, where 2.13 takes the replicated operand
#   as ``Partial`` locally: a gradient summed over a loop's steps is reduced at every step.
# Dynamo 2.9 refuses a body calling ``torch.func.functional_call`` on a module with
# submodules ("Mutating a variable not in the current scope": the call swaps parameters in
# place), so a scanned-layers step graph-breaks at the scan there; 2.13 and later trace it.
DYNAMO_SPECULATES_FUNCTIONAL_CALL = TORCH_VERSION >= (2, 13)
DTENSOR_SELECT_ALIASES_INPUT_SPEC = TORCH_VERSION < (2, 13)
DTENSOR_FLATTENS_SHARDED_DIMS = TORCH_VERSION >= (2, 13)
DTENSOR_RUNS_FILL_SCALAR = TORCH_VERSION >= (2, 13)
# DTensor 2.9's LayerNorm backward strategy takes the weight and bias as they arrive ("they
# should be replicated in forward pass"): a plan that keeps them sharded hands the local kernel
# a shard of the normalized shape ("Expected bias to be of same shape as normalized_shape").
# 2.13 asks for them replicated. ``passes.dtensor.runtime.run_with_replicated_parameters``
# replicates them first on 2.9. The op -> the positions of its weight and bias.
DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT = (
    {"aten.native_layer_norm_backward.default": (5, 6)} if TORCH_VERSION < (2, 13) else {}
)
# DTensor 2.9 caches an op's output layout and global shape keyed by its tensor arguments only
# when the op's rule declares no schema info: two calls differing in a size argument share one
# entry, and the second DTensor gets the first's global shape (the local tensor is right). These
# ops' output shape depends on such an argument (2.13 declares it);
# ``passes.dtensor.runtime.declare_size_arguments`` declares it on 2.9.
DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF = (
    frozenset({"aten.embedding_dense_backward.default"})
    if TORCH_VERSION < (2, 13)
    else frozenset()
)
DTENSOR_ADDS_REPLICATE_TO_PARTIAL_LOCALLY = TORCH_VERSION >= (2, 13)
# torch 2.9's ``_linalg_solve_ex`` returns the LU factors of A's transpose where A is real and
# row-major (LAPACK's column-major view of it), of A otherwise; its backward solves with them
# accordingly. 2.13 and 2.15 return A's. The jax target returns what each version's backward reads
# for a real A (it sees no strides: a column-major A on 2.9 is not told apart).
SOLVE_RETURNS_TRANSPOSED_FACTORS = TORCH_VERSION < (2, 13)

# Private torch symbols the package (hops/, passes/) names that some supported torch lacks,
# with the first version that has it; the code reaching each is guarded by that version or by
# ``getattr``. Every other private symbol named in the package exists on every supported
# version (tests/test_private_torch_symbols.py resolves each, one test per symbol).
PRIVATE_SYMBOLS_SINCE: dict[str, tuple[int, int]] = {
    # DTensor's single-mesh-dim strategies (passes/solver/_dtensor.py), absent in 2.9.
    "torch.distributed.tensor._ops.single_dim_strategy._expand_single_dim_strategy_to_mesh": (2, 13),
}
# Private torch symbols the package names only before the version given (the code reaching
# each is guarded by that version): torch may drop them from then on.
PRIVATE_SYMBOLS_UNTIL: dict[str, tuple[int, int]] = {
    "torch._dynamo.exc.unimplemented_v2": (2, 13),  # ``dynamo_graph_break``
}


def select_step(x: torch.Tensor, index: int) -> torch.Tensor:
    """``x.select(0, index)``: step ``index`` of a scan's stacked ``x``. A DTensor on a torch whose
    ``select`` corrupts its input (``DTENSOR_SELECT_ALIASES_INPUT_SPEC``) is sliced by
    ``narrow`` then ``squeeze`` (the same view, through rules that make a fresh spec)."""
    if DTENSOR_SELECT_ALIASES_INPUT_SPEC:
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: x is no DTensor
        if dtensor is not None and isinstance(x, dtensor.DTensor):
            return x.narrow(0, index, 1).squeeze(0)
    return x.select(0, index)
