"""Dynamo support for this package's HOPs: a VariableTracker per HOP.

A HOP without subgraphs is traced like any op: tensor arguments become proxies and spec
arguments become Python constants baked into the node (Dynamo guards them through their
source, so a different spec recompiles instead of silently reusing the graph).

A HOP whose first argument is a Python body (``register_subgraph_hop``) gets the same
treatment for its tensors and specs; Dynamo traces the body into a GraphModule, and tensors
the body closes over become explicit inputs of that GraphModule and of the node.

This package's typed errors are graph breaks (see ``typed_error_break``). Without
``fullgraph`` the call then runs eagerly, which raises the error as itself (or lets the
caller catch it), as eager does. With ``fullgraph`` Dynamo raises its own ``Unsupported``,
which names the error's class and message: chained as its ``__cause__`` where a HOP's rule
raised it (its validation or body-shape rule while its variable runs, its fake rule on the
node, the body while Dynamo traces it), named in Dynamo's "Observed exception" report where
this package's Python raised it while Dynamo traced it around the HOP call. Nothing here
replaces a Dynamo function: Dynamo offers no hook to raise another exception in its place.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from typing import Any, Sequence

import torch

from hops import _compat, _inductor
from hops._body_hop.call import CALL_DESCRIPTION, call_body_hop
from hops._body_hop.subgraph import named
from hops._errors import hop_prefix


def _constant_or_proxy(tx: Any, arg: Any, hop_name: str, position: Any) -> Any:
    from torch._dynamo.variables.tensor import TensorVariable

    if isinstance(arg, TensorVariable):
        return arg.as_proxy()
    try:
        return _python_constant(arg)
    except NotImplementedError:
        pass
    # Dynamo models our frozen spec dataclasses as user objects that still hold the value.
    value_type = arg.python_type()
    if dataclasses.is_dataclass(value_type) and hasattr(value_type, "__fx_create_arg__"):
        if arg.source is not None:
            _guard_on_value(arg.source, arg.value)
            return arg.value
        # Built inside the traced code: the fields live in Dynamo's side-effect tracking.
        return _rebuild_in_trace(tx, arg)
    _compat.dynamo_graph_break(
        gb_type=f"{hop_name}: non-constant argument",
        context=f"argument {position}: {arg}",
        explanation=f"{hop_name} takes tensors and constant spec values only",
    )


_PRIMITIVES = (int, float, bool, str, type(None))


def _python_constant(arg: Any) -> Any:
    """``arg``'s Python value. A symbolic number is specialized (guarded on its value): a
    spec holds constants, and Dynamo turns an int that changed between calls (a closure
    cell, a global, an argument) into a symbol under automatic dynamic shapes. A number only
    known at run time (data-dependent) is not a constant (NotImplementedError)."""
    from torch._dynamo.variables.tensor import SymNodeVariable

    if isinstance(arg, SymNodeVariable):
        try:
            return arg.evaluate_expr()
        except Exception as error:  # data-dependent: Dynamo's UserError, or the guard's own error
            raise NotImplementedError(str(error)) from error
    return arg.as_python_constant()


def _rebuild_in_trace(tx: Any, arg: Any) -> Any:
    from torch._dynamo.variables.lists import BaseListVariable
    from torch._dynamo.variables.tensor import SymNodeVariable

    if isinstance(arg, BaseListVariable):
        return tuple(_rebuild_in_trace(tx, item) for item in arg.items)
    value_type = arg.python_type()
    if dataclasses.is_dataclass(value_type):
        fields = [f.name for f in dataclasses.fields(value_type) if f.init]
        values = {f: _compat.dynamo_getattr(tx, arg, f) for f in fields}
        # A field a spec may leave unknown (ScanSpec.length) is None when symbolic.
        for f in getattr(value_type, "none_when_symbolic", ()):
            if isinstance(values[f], SymNodeVariable):
                values[f] = None
        return value_type(**{f: None if v is None else _rebuild_in_trace(tx, v) for f, v in values.items()})
    try:
        return _python_constant(arg)
    except NotImplementedError:
        _compat.dynamo_graph_break(
            gb_type="hops: a spec field that is not a constant",
            context=f"{arg}",
            explanation="a spec value built in compiled code holds only constants (a symbolic size cannot be one)",
        )


def _guard_on_value(source: Any, value: Any) -> None:
    """Guard that the object at ``source`` still equals ``value`` (a spec value).

    EQUALS_MATCH accepts only builtin types, and ID_MATCH would recompile for every equal
    spec built anew; a spec is a tree of frozen dataclasses, tuples and primitives, so guard
    the type of each object and the equality of each primitive leaf.
    """
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, GetItemSource

    if isinstance(value, _PRIMITIVES) or (
        type(value) is tuple and all(isinstance(v, _PRIMITIVES) for v in value)
    ):
        install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))
        return
    install_guard(source.make_guard(GuardBuilder.TYPE_MATCH))
    if type(value) is tuple:
        install_guard(source.make_guard(GuardBuilder.SEQUENCE_LENGTH))
        for index, item in enumerate(value):
            _guard_on_value(GetItemSource(source, index), item)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            _guard_on_value(AttrSource(source, field.name), getattr(value, field.name))
    else:
        raise TypeError(f"cannot guard on {type(value).__name__} at {source.name()}")


def register_plain_hop(hop: Any) -> None:
    """Register a subgraph-free HOP with Dynamo; ``hop.node_args`` canonicalizes args."""
    base = _compat.dynamo_hop_variable_base()

    def _call_function(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._dynamo.variables.lazy import LazyVariableTracker

        args, kwargs = LazyVariableTracker.realize_all((args, kwargs))
        values = [_constant_or_proxy(tx, a, hop.__name__, i) for i, a in enumerate(args)]
        named = {k: _constant_or_proxy(tx, v, hop.__name__, k) for k, v in kwargs.items()}
        node_args = hop.node_args(*values, **named)
        # The call on its fake values first, here: the HOP's checks raise its typed errors
        # themselves (under Dynamo's fake-tensor run of the node they come wrapped, and on
        # some versions without the original).
        examples = [v.node.meta["example_value"] if isinstance(v, torch.fx.Proxy) else v for v in node_args]
        with tx.fake_mode, torch.no_grad():
            hop(*examples)
        _inductor.ensure_lowering_pass()
        proxy = tx.output.create_proxy("call_function", hop, node_args, {})
        return wrap_fx_proxy(tx=tx, proxy=proxy)

    variable_cls = type(
        f"{type(hop).__name__}Variable",
        (base,),
        {
            "_HOP_NAME": f"torch.ops.higher_order.{hop.__name__}",
            "_ALLOW_FALLBACK_TO_EAGER": True,
            "_call_function": _raising_typed_errors(_call_function),
        },
    )
    _compat.register_dynamo_hop_variable(hop, variable_cls)


def _body_failure(tx: Any, error: BaseException) -> BaseException:
    """What the body raised while Dynamo traced it, as eager would see it: the error a fake
    tensor op raised, or the body's own exception."""
    return _fake_op_failure(error) or _typed_error(tx, error) or error


def _fake_op_failure(error: BaseException) -> BaseException | None:
    """The exception a fake tensor op raised behind ``error``, the object itself. Dynamo
    raises its own error for it, from it or while handling it (``raise ... from None`` keeps
    the context, hidden): a ``TorchRuntimeError`` on 2.9 and 2.13, with on 2.9 and 2.15 a
    plain ``RuntimeError`` carrying Dynamo's message raised ``from`` the op's, and on 2.15 an
    ``ObservedException`` on top. The op's is the first in that chain that is not Dynamo's
    and was not raised from another."""
    for current in reversed(_chain(error, hidden=True)):
        if not _compat.is_dynamo_exception(current) and current.__cause__ is None and current is not error:
            return current
    return None


def _same_lifted_inputs(graphs: list, lifted_per_option: list, num_inputs: int) -> list:
    """The outer values (proxies) every option's subgraph takes after its ``num_inputs`` own
    inputs, in one order: options may close over different values (or lift them in another
    order), and a node passes one tuple to all of its bodies. Each subgraph gets a placeholder
    per value of the union, unused where that option does not read it."""
    union: dict = {}
    for lifted in lifted_per_option:
        for outer in lifted:
            union.setdefault(outer.node, outer)
    if len(graphs) == 1:
        return list(union.values())
    for gm, lifted in zip(graphs, lifted_per_option):
        graph = gm.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        inner_of = {outer.node: inner.node for outer, inner in lifted.items()}
        last = placeholders[num_inputs - 1] if num_inputs else None
        for outer_node in union:
            # Placeholders in the union's order, after the body's own inputs.
            where = graph.inserting_after(last) if last is not None else graph.inserting_before(next(iter(graph.nodes)))
            with where:
                placeholder = graph.placeholder(f"lifted_{outer_node.name}")
            old = inner_of.get(outer_node)
            if old is not None:
                placeholder.meta.update(old.meta)
                old.replace_all_uses_with(placeholder)
                graph.erase_node(old)
            else:
                placeholder.meta["example_value"] = outer_node.meta.get("example_value")
            last = placeholder
        graph.lint()
        gm.recompile()
    return list(union.values())


class _NamedBody:
    """Stands for a body in a HOP's checks, which only name it (``body_name``)."""

    def __init__(self, name: str) -> None:
        self.__name__ = name


def is_call_description(value: Any) -> bool:
    """Whether ``value`` is what ``call_body_hop`` passes after the spec under Dynamo (see
    ``hops._body_hop.call.call_description``)."""
    return type(value) is tuple and len(value) == 4 and value[0] == CALL_DESCRIPTION


class _CallDescription:
    def __init__(self, value: tuple) -> None:
        _, self.name, self.what, self.input_names = value


def _call_description(spec_args: Sequence[Any]) -> _CallDescription | None:
    if not spec_args:
        return None
    try:
        value = spec_args[-1].as_python_constant()
    except NotImplementedError:
        return None
    return _CallDescription(value) if is_call_description(value) else None


def replay_broken_call(hop: Any, body: Any, operands_and_spec: Sequence[Any]) -> Any:
    """The call ``hop(body, *operands, spec, description)`` a public function made under
    Dynamo (``call_body_hop``), run eagerly because Dynamo broke the graph at it: as the
    public function would have run it, with Dynamo off inside (it would compile the frames
    below and meet the same call again)."""
    _, name, what, names = operands_and_spec[-1]
    operands, spec = hop.split_args(operands_and_spec[:-1])
    body = named(body, name)  # made in compiled code, where it kept its factory's name
    return torch.compiler.disable(call_body_hop)(
        hop, body, operands, spec, what=what, input_names=lambda i: names[i], user_function=body
    )


def _refuse_input_writes(body_gm: torch.fx.GraphModule, example_args: Sequence[Any], call: Any, what: str) -> list:
    """Run the traced body on fresh fakes (the body's own inputs, then what it closes over):
    its outputs; a write into one of its own inputs raises eager's ``BodyMutationError`` (the
    body is traced allowing input writes so that this package, not Dynamo, names the input).
    ``what`` names the call where no public function described it (``scan(step)``)."""
    from hops._body_hop.body import BodyMutationError

    placeholders = list(body_gm.graph.find_nodes(op="placeholder"))
    inputs = []
    for node in placeholders:
        example = node.meta.get("example_value")
        # A 0-d tensor is kept as it is: it may be a number Dynamo passes as a tensor (a float
        # under ``dynamic=True``) that the body reads back with ``item()``, which a fresh fake
        # cannot answer. A write into it still changes its version.
        if isinstance(example, torch.Tensor) and example.dim() > 0:
            example = torch.empty_strided(
                example.size(), example.stride(), dtype=example.dtype, device=example.device, requires_grad=example.requires_grad
            )
        inputs.append(example)
    versions = [t._version if isinstance(t, torch.Tensor) else None for t in inputs]
    outputs = body_gm(*inputs)
    for i, (value, version) in enumerate(zip(inputs[: len(example_args)], versions)):
        if isinstance(value, torch.Tensor) and value._version != version:
            where = call.what if call is not None else what
            name = call.input_names[i] if call is not None and i < len(call.input_names) else f"operands[{i}]"
            raise BodyMutationError(
                f"{where}: the body writes into its input {name} in place; a body must be "
                "functional (compute a new tensor and return it instead)"
            )
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


# --------------------------------------------------------------------------- typed errors


def _raising_typed_errors(call_function: Any) -> Any:
    """A variable's ``_call_function`` whose failures caused by one of this package's typed
    errors become ``typed_error_break``s."""

    def _call_function(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        try:
            return call_function(self, tx, args, kwargs)
        except Exception as error:
            typed = _typed_error(tx, error)
            if typed is None:
                raise
        typed_error_break(tx, typed)

    return _call_function


_TYPED_ERROR = "hops_typed_error"


def _chain(error: BaseException, hidden: bool = False) -> list[BaseException]:
    """``error`` and the exceptions it was raised from (or while handling, where that shows,
    or always with ``hidden``: ``raise ... from None`` keeps the context), root cause first."""
    chain, seen = [], set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        pending += [current.__cause__, None if current.__suppress_context__ and not hidden else current.__context__]
    return chain[::-1]


def _raised_here(error: BaseException) -> bool:
    """Whether this package's code raised ``error`` (the innermost frame of its traceback)."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return _in_package(traceback.tb_frame.f_code.co_filename)


def _typed_error(tx: Any, error: BaseException) -> BaseException | None:
    """The exception eager would raise behind ``error``, raised while a HOP variable ran: a
    typed error one of this package's rules raised (directly, or under Dynamo's wrapping of
    a fake-tensor rule's failure), one an inner HOP found, or the exception the body raised
    while Dynamo traced it (the body raises it as itself in eager too). None otherwise."""
    if _compat.is_dynamo_observed_exception(error):
        raised = _compat.dynamo_raised_exception(tx)
        if raised is None:
            return None
        try:
            return raised[0](*raised[1])
        except Exception:  # a class that cannot be rebuilt from its arguments
            return None
    for cause in _chain(error):
        typed = getattr(cause, _TYPED_ERROR, None)
        if typed is not None:
            return typed
        if not _compat.is_dynamo_exception(cause) and _raised_here(cause):
            return cause
    return None


def typed_error_break(tx: Any, typed: BaseException) -> None:
    """Stop tracing because of ``typed``, one of this package's typed errors (or a body's
    exception). Without ``fullgraph`` it is a graph break: the call runs eagerly, where it
    raises ``typed`` as eager does (or the caller catches it). With ``fullgraph`` Dynamo's
    error has ``typed`` as its ``__cause__``; the graph break also carries it, so that an
    enclosing HOP's variable breaks with it again."""
    from torch._dynamo.exc import Unsupported

    try:
        _compat.dynamo_graph_break(
            gb_type="hops: a typed error",
            context=f"{type(typed).__name__}: {typed}",
            explanation="this package raised a typed error for the call, as eager does",
            from_exc=typed,
        )
    except Unsupported as graph_break:
        if _compat.dynamo_graph_breaks_are_errors(tx):
            setattr(graph_break, _TYPED_ERROR, typed)
        raise


def _body_example_args(tx: Any, hop: Any, tensor_args: list[Any], specs: tuple) -> tuple:
    """Fresh fake tensors shaped like what the body receives (``hop.body_example_args``)."""
    fake_args = tuple(vt.as_proxy().node.meta["example_value"] for vt in tensor_args)
    with tx.fake_mode:
        examples = tuple(hop.body_inputs(fake_args, specs[-1])) if hasattr(hop, "body_inputs") else fake_args
        if len(examples) != len(fake_args) or not all(
            isinstance(t, torch.Tensor) for t in examples
        ):
            raise TypeError(
                f"{hop.__name__}.body_inputs must return one tensor per tensor "
                f"argument ({len(fake_args)}), got {examples!r}"
            )
        # Fresh storage: a shard view of an arg must not look like aliasing the arg itself
        # when the body also closes over it (Dynamo rejects aliased subgraph inputs).
        return tuple(
            torch.empty_strided(
                t.size(),
                t.stride(),
                dtype=t.dtype,
                device=t.device,
                requires_grad=t.requires_grad,
            )
            for t in examples
        )


def _graph_free_tensor_variable(name: str, example: Any) -> Any:
    """A TensorVariable for ``example`` whose proxy lives in a scratch graph, not Dynamo's."""
    from torch._dynamo.variables.tensor import TensorVariable

    node = torch.fx.Graph().placeholder(name)
    node.meta["example_value"] = example
    props = {**TensorVariable.specialize(example), "class_type": torch.Tensor}
    return TensorVariable(torch.fx.Proxy(node), **props)


def _user_function_name(tx: Any, body: Any) -> str:
    """The name eager gives the body: its user function's (``body_name``)."""
    return _subgraph_name(tx, body).removesuffix("_body") or "body"


def _subgraph_name(tx: Any, body: Any) -> str:
    """``<function name>_body``: a subgraph is named after the user function it came from.

    A body this package wraps around the user's function inside compiled code (scan's
    ``step``, which closes over it as ``fn``) is named after that function: the code-object
    rename that names wrappers elsewhere cannot be traced."""
    body = _wrapped_user_function(tx, body) or body
    try:
        name = body.get_name()
    except Exception:  # not a plain function (a module, a partial): no reliable name
        name = ""
    name = re.sub(r"\W+", "_", name).strip("_")
    return f"{name}_body" if name else "body"


_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def _in_package(filename: str) -> bool:
    """Whether ``filename`` is one of this package's sources (its subpackages' included)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIRECTORY + os.sep)


def _wrapped_user_function(tx: Any, body: Any) -> Any:
    """The variable of ``fn`` in the closure of a nested function defined in this package."""
    code = getattr(getattr(body, "code", None), "value", None)
    closure = getattr(body, "closure", None)
    if (
        not isinstance(code, types.CodeType)
        or closure is None
        or "fn" not in code.co_freevars
        or not _in_package(code.co_filename)
    ):
        return None
    try:
        return tx.output.side_effects.load_cell(closure.items[code.co_freevars.index("fn")])
    except Exception:  # a closure Dynamo keeps in another form: keep the wrapper's name
        return None


# --------------------------------------------------------------------------- subgraph HOPs


def register_subgraph_hop(hop: Any) -> None:
    """Register with Dynamo a HOP called as ``hop(body, *tensor_args, *specs)``: its variable
    is a ``SubgraphHopVariable`` on Dynamo's base class for HOP variables."""
    variable_cls = type(
        f"{type(hop).__name__}Variable",
        (SubgraphHopVariable, _compat.dynamo_hop_variable_base()),
        {"hop": hop, "_HOP_NAME": f"torch.ops.higher_order.{hop.__name__}", "_ALLOW_FALLBACK_TO_EAGER": True},
    )
    _compat.register_dynamo_hop_variable(hop, variable_cls)


@dataclasses.dataclass
class _SubgraphCall:
    """A body HOP's call as its variable sees it (``SubgraphHopVariable.classify``)."""

    body: Any  # the body's VariableTracker
    tensor_args: list  # TensorVariables
    specs: tuple  # Python values; the last is the HOP's spec
    description: _CallDescription | None  # what a public function said about the call
    fake_args: tuple  # the tensor args' example values
    named: _NamedBody  # the body as the HOP's checks name it

    @property
    def spec(self) -> Any:
        return self.specs[-1]


@dataclasses.dataclass
class _SpeculatedBody:
    """One option's body, traced (``SubgraphHopVariable.speculate``)."""

    graph: torch.fx.GraphModule
    lifted: Any  # outer proxy -> inner placeholder, in input order
    treespec: Any  # the structure of what the body returns
    outputs: list  # its flat (fake) outputs


class SubgraphHopVariable:
    """The Dynamo variable of a HOP called as ``hop(body, *tensor_args, *specs)`` (a
    ``hops._body_hop.base.BodyHOP``): ``register_subgraph_hop`` makes one class per HOP, of
    this one and Dynamo's ``TorchHigherOrderOperatorVariable`` (which calls
    ``_call_function``), with ``hop`` set.

    ``body`` is a Python callable taking the tensor args positionally and returning a tensor
    or a tuple/list of tensors; ``specs`` are the trailing non-tensor args (spec values),
    baked into the node as constants and guarded like a plain HOP's.

    Dynamo traces ``body`` into a GraphModule and emits ONE node::

        hop(body_gm, *tensor_args, lifted, *specs)

    ``body_gm`` (a ``get_attr``) returns the flat leaves of what ``body`` returns and takes
    ``(*tensor_args, *lifted)``; the call returns the HOP's flat results in the structure
    ``body`` returned (public functions use them as they are under Dynamo). ``lifted`` is
    always a tuple, possibly empty: the tensors (and symbolic ints) the body reads from its
    closure or globals, in the order of the body's trailing inputs. The HOP's rules must
    accept this node form as well as the user form without ``lifted``.

    ``hop.body_inputs(args, spec)`` (``args``: one fake tensor per tensor arg) returns the
    inputs the body really sees (e.g. local shards): the body is speculated on their shapes.
    The node's output metadata comes from the HOP's own FakeTensorMode rule, run on the
    node, never from the body's outputs.

    A call is three steps: ``classify`` the arguments (and make the checks eager makes
    before running the body), ``speculate`` the body once per option of the spec, and
    ``install`` the bodies and the node.
    """

    hop: Any = None

    @_raising_typed_errors
    def _call_function(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        call = self.classify(tx, args, kwargs)
        count, active = self.hop.num_options(call.spec), self.hop.active_option(call.spec)
        # One subgraph per option (local_map's alternatives), each speculated on the inputs the
        # body sees under that option: shapes are constants of a Dynamo graph, so a body traced
        # on one option's local shapes would be wrong for another's.
        bodies = [self.speculate(tx, call, index, active, count) for index in range(count)]
        with tx.fake_mode:
            if count > 1:
                self.hop.check_options(call.named.__name__, [b.outputs for b in bodies], call.fake_args, call.spec)
            # The node's fake rule, here: what it refuses is raised unwrapped.
            self.hop.outputs_from_body(bodies[active].outputs, call.fake_args, call.spec)
        return self.install(tx, call, bodies, active)

    def classify(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> _SubgraphCall:
        """The body, the tensor args, the specs (as constants) and the public function's
        description of the call; then the checks eager makes before running the body, with
        eager's messages."""
        from torch._dynamo.variables.lazy import LazyVariableTracker
        from torch._dynamo.variables.tensor import TensorVariable

        hop = self.hop
        args, kwargs = LazyVariableTracker.realize_all((args, kwargs))
        if kwargs or not args or isinstance(args[0], TensorVariable):
            _compat.dynamo_graph_break(
                gb_type=f"{hop.__name__}: unsupported call",
                context=f"args: {args}, kwargs: {kwargs}",
                explanation=f"{hop.__name__} takes (body, *tensors, *specs), positionally",
            )
        body, rest = args[0], args[1:]
        num_tensors = 0
        while num_tensors < len(rest) and isinstance(rest[num_tensors], TensorVariable):
            num_tensors += 1
        tensor_args, spec_args = rest[:num_tensors], rest[num_tensors:]
        description = _call_description(spec_args)
        if description is not None:
            spec_args = spec_args[:-1]
        specs = tuple(
            _constant_or_proxy(tx, a, hop.__name__, num_tensors + 1 + i)
            for i, a in enumerate(spec_args)
        )
        if any(isinstance(s, torch.fx.Proxy) for s in specs):
            _compat.dynamo_graph_break(
                gb_type=f"{hop.__name__}: tensor after a spec argument",
                context=f"args: {args}",
                explanation=f"{hop.__name__} takes its tensors before its spec arguments",
            )

        fake_args = tuple(vt.as_proxy().node.meta["example_value"] for vt in tensor_args)
        named = _NamedBody(description.name if description is not None else _user_function_name(tx, body))
        hop.split_args((*fake_args, *specs))
        hop.check(named, fake_args, specs[-1])
        return _SubgraphCall(body, list(tensor_args), specs, description, fake_args, named)

    def speculate(self, tx: Any, call: _SubgraphCall, index: int, active: int, count: int) -> _SpeculatedBody:
        """The body traced by Dynamo on what it sees under option ``index`` of ``count``; its
        outputs checked as eager checks them."""
        hop = self.hop
        option = call.spec if count == 1 else hop.option_spec(call.spec, index)
        example_args = _body_example_args(tx, hop, call.tensor_args, (*call.specs[:-1], option))
        # Speculate on graph-free copies of the args that carry the body's example values:
        # "manual" inputs take their placeholder metadata from these, so the body sees the
        # shapes it will really get, and the outer graph and its tensors are left untouched.
        body_inputs = [
            _graph_free_tensor_variable(vt.as_proxy().node.name, example)
            for vt, example in zip(call.tensor_args, example_args)
        ]
        try:
            body_graph, lifted, treespec = _compat.dynamo_speculate_subgraph(tx, call.body, body_inputs, hop)
        except Exception as error:
            if index == active or _compat.is_dynamo_graph_break(error):
                raise  # (a graph break: Dynamo cannot trace the body at all)
            # The body fails on this alternative's local shapes: eager's error for that.
            raise hop.option_failure(call.named.__name__, call.spec, index, _body_failure(tx, error)) from error
        body_gm = torch.fx.GraphModule(tx.output.nn_modules, body_graph)
        with tx.fake_mode:
            outputs = _refuse_input_writes(body_gm, example_args, call.description, hop_prefix(hop, call.named))
            hop.check_outputs(call.named, outputs, call.fake_args, option)
        return _SpeculatedBody(body_gm, lifted, treespec, outputs)

    def install(self, tx: Any, call: _SubgraphCall, bodies: list[_SpeculatedBody], active: int) -> Any:
        """The bodies as subgraphs of the output graph and the HOP's node calling them; the
        node's flat results in the structure the active body returned."""
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._dynamo.variables.higher_order_ops import make_attr

        graphs = [b.graph for b in bodies]
        lifted = _same_lifted_inputs(graphs, [b.lifted for b in bodies], len(call.tensor_args))
        prefix = _subgraph_name(tx, call.body)
        names = [
            tx.output.install_subgraph(prefix if len(graphs) == 1 else prefix.removesuffix("body") + f"alternative{index}_body", gm)
            for index, gm in enumerate(graphs)
        ]
        subgraphs = make_attr(tx, names[0]) if len(graphs) == 1 else tuple(make_attr(tx, n) for n in names)
        node_args = (
            subgraphs,
            *(vt.as_proxy() for vt in call.tensor_args),
            tuple(lifted),
            *call.specs,
        )
        _inductor.ensure_lowering_pass()
        proxy = tx.output.create_proxy("call_function", self.hop, node_args, {})
        # No example value given: Dynamo runs the node under its FakeTensorMode, i.e. the
        # HOP's own fake rule decides the output shapes. The flat results come back in the
        # structure the body returned.
        return _compat.dynamo_unflatten(tx, wrap_fx_proxy(tx=tx, proxy=proxy), bodies[active].treespec)
