"""``BodyHOP``: what every HOP with a body shares (scan, local_map, named_scope).

A body HOP is called ``hop(body, *operands, spec)``: ``body`` is a callable (a Python
function, or a GraphModule once traced) returning a pytree of tensors; the HOP returns the
flat tuple of its results. Each HOP says what is particular to it in a few methods:

- ``check(body, operands, spec)``: validate a call (raise ``TypeError``/``ValueError``);
- ``body_operands(operands, spec)``: what the body sees (one slice of xs, device 0's
  shards); the rules hand it over as ``body_inputs``, in the layout every body may assume
  (``hops._body_hop.body.at_boundary``: contiguous), and ``run_at_boundary`` makes what
  ``run`` takes and returns so too;
- ``check_outputs(body, outputs, operands, spec)``: refuse what the body returns as eager
  does (a scan carry changing shape), naming the body;
- ``outputs_from_body(outputs, operands, spec)``: the HOP's results from the body's (fake)
  outputs (ys stacked, global shapes);
- ``run(body, operands, spec)``: its semantics on real tensors, the reference everything
  else is checked against; differentiable by autograd when run above it;
- ``fold_lifted(operands, spec, lifted)``: operands and spec once tensors the body closed
  over become trailing inputs;
- ``autograd_plan(body, operands, spec)``: how the HOP differentiates while traced (the
  forward and backward nodes, see ``hops._body_hop.joint`` and ``HopFunction``).

and this class implements the rules from them, once: the call (symbolic tracing, Dynamo's
node form, validation), fake, functionalization, proxy, autograd, and dispatch modes that
are not tracers. Each HOP module still registers one function per key, so a reader finds
"what happens under fake tensors" by one decorator, as in torch's own HOPs.

The rules' helpers each live in a module of ``hops._body_hop`` named for what they do: the
forms a rule sees a body in (``flat_body``), what is known about a body (``body_record``),
how a public function calls the HOP (``call``), the caches of inspections and plans
(``caches``) and traced autograd (``autograd``). The region HOPs (local_map, named_scope)
add their traced autograd in ``region`` (``RegionHOP``).

Autograd has two paths. Outside tracing, on the devices where the eager semantics runs, the
HOP runs ``run`` above autograd: the reference's own gradients are exact, to any order,
with the forward's random draws and the closure's tensors differentiated as they are.
While traced (make_fx, AOTAutograd, export) or on XLA, where the backward must itself be a
HOP node, the body's joint is traced and split, and ``HopFunction`` runs the forward and
backward nodes that ``autograd_plan`` builds.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, track_tensor_tree

from hops import _compat, _dynamo, _export, _inductor
from hops._body_hop.autograd import AutogradPlan, HopFunction, NotDifferentiablePlan, lacks_a_derivative, needs_traced_autograd
from hops._body_hop.body import at_boundary, distinct_tensors, wrap_functional
from hops._body_hop.body_record import is_known_functional, known_functional
from hops._body_hop.flat_body import FlatBody, OptionBodies, map_options, option_body
from hops._body_hop.joint import is_tracing, trace_graph
from hops._body_hop.subgraph import (
    body_name,
    clone_aliased_outputs,
    find_input_mutation_and_aliasing,
    lift_tensor_constants,
    named,
    refuse_untracked_xla_operands,
    symbolic_trace_call,
)
from hops._errors import call_prefix, hop_prefix, public_name
from hops._targets import load_device_rules

__all__ = ["BodyHOP"]


class BodyHOP(HigherOrderOperator):
    """A HOP ``hop(body, *operands, spec)``; see the module docstring."""

    spec_type: type = object
    # A message (``{what}`` names the call, ``{collective}`` the op) refusing bodies that
    # call a functional collective, for HOPs whose body runs once per simulated device.
    collectives_refusal: str | None = None

    def __init__(self, name: str) -> None:
        super().__init__(name, cacheable=True)
        # Selective activation checkpointing caches or replays the whole HOP as one op.
        _compat.redirect_checkpoint_modes(self)
        for transform in _compat.transform_types():
            self.py_impl(transform)(self.transform_rule)
        self.py_impl(DispatchKey.FuncTorchGradWrapper)(_compat.dead_wrapper_rule(self))

    # ----------------------------------------------------------------- what each HOP says

    def check(self, body: Callable, operands: Sequence[Any], spec: Any) -> None:
        raise NotImplementedError

    def body_operands(self, operands: Sequence[Any], spec: Any) -> tuple:
        raise NotImplementedError

    def check_outputs(self, body: Callable, outputs: Sequence[Any], operands: Sequence[Any], spec: Any) -> None:
        """Refuse the body's (fake) flat outputs as running the body eagerly refuses them,
        naming ``body`` (Dynamo checks a traced body with it). Default: nothing to check."""

    def outputs_from_body(self, outputs: Sequence[Any], operands: Sequence[Any], spec: Any) -> tuple:
        raise NotImplementedError

    def run(self, body: Callable, operands: Sequence[Any], spec: Any) -> tuple:
        raise NotImplementedError

    def fold_lifted(self, operands: Sequence[Any], spec: Any, lifted: Sequence[Any]) -> tuple[list, Any]:
        raise NotImplementedError

    # ----------------------------------------------------------------- the boundary
    #
    # A body is traced on stand-ins and run on whatever arrives: both are made contiguous
    # here, once for every HOP and every rule (see ``hops._body_hop.body.at_boundary``).

    def body_inputs(self, operands: Sequence[Any], spec: Any) -> tuple:
        """What the body is called with: ``body_operands``, each tensor contiguous."""
        return at_boundary(self.body_operands(operands, spec))

    def run_at_boundary(self, body: Callable, operands: Sequence[Any], spec: Any) -> tuple:
        """``run`` on contiguous operands, its results contiguous (as the fake rule says)."""
        return at_boundary(self.run(body, at_boundary(operands), spec))

    def eager_rule(self, body: Callable, *args: Any) -> tuple:
        operands, spec = self.split_args(args)
        return self.run_at_boundary(body, operands, spec)

    # A HOP whose spec offers options (local_map's alternatives) traces one body per option
    # (each on what it sees under that option) and runs the active one.

    def num_options(self, spec: Any) -> int:
        return 1

    def option_spec(self, spec: Any, index: int) -> Any:
        """``spec`` with option ``index`` active."""
        return spec

    def active_option(self, spec: Any) -> int:
        return 0

    def option_failure(self, name: str, spec: Any, index: int, error: Exception) -> Exception:
        """The error for a body that fails under option ``index`` (it runs under the active one)."""
        return ValueError(f"{call_prefix(public_name(self), name)}: option {index}: the body fails on it: {type(error).__name__}: {error}")

    def check_options(self, name: str, steps: Sequence[Sequence[Any]], operands: Sequence[Any], spec: Any) -> None:
        """Refuse options whose bodies' (fake) outputs ``steps`` give the HOP other results
        than the active option's: the program around the node is the same for all."""

    def autograd_plan(self, body: Callable, operands: Sequence[Any], spec: Any) -> AutogradPlan:
        """How a traced call differentiates: the forward and backward nodes (a scan's reverse
        scan; the region HOPs share ``hops._body_hop.region.RegionHOP``'s)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- the call

    def split_args(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        if not args or not isinstance(args[-1], self.spec_type):
            got = type(args[-1]).__name__ if args else "nothing"
            raise TypeError(
                f"{hop_prefix(self)}: the last argument of {self.__name__}(body, *operands, spec) must be a "
                f"hops.{self.spec_type.__name__}, got {got}"
            )
        return list(args[:-1]), args[-1]

    def __call__(self, body: Callable, *operands_and_spec: Any):
        traced = symbolic_trace_call(self, (body, *operands_and_spec))
        if traced is not None:
            return traced
        if operands_and_spec and _dynamo.is_call_description(operands_and_spec[-1]):
            # Dynamo broke the graph at a public function's call and runs it eagerly.
            return _dynamo.replay_broken_call(self, body, operands_and_spec)
        operands, spec = self.split_args(operands_and_spec)
        load_device_rules(operands)
        if operands and isinstance(operands[-1], tuple):
            # Dynamo's node form: what the body closed over comes as one trailing tuple.
            *operands, lifted = operands
            operands, spec = self.fold_lifted(operands, spec, lifted)
        if isinstance(body, (tuple, list)):  # a node's bodies, one per option
            if len(body) != self.num_options(spec):
                raise ValueError(
                    f"{hop_prefix(self)}: {len(body)} bodies for a spec with {self.num_options(spec)} options; "
                    "give one body per option"
                )
            body = OptionBodies(body, self.active_option(spec))
        if not callable(body):
            raise TypeError(f"{hop_prefix(self)}: body must be callable, got {type(body).__name__}")
        self.check(body, operands, spec)
        if isinstance(body, (FlatBody, OptionBodies)):
            # A rule calling the HOP again (or torch-function handling re-entering it): rules
            # speak in flat results.
            return super().__call__(body, *operands, spec)
        # Rules see (and trace) the flat body; the caller gets the body's own structure.
        body = FlatBody(body)
        return body.unflatten(super().__call__(body, *operands, spec))

    # ----------------------------------------------------------------- shared rules

    def fake_rule(self, mode: Any, body: Callable, *args: Any) -> tuple:
        operands, spec = self.split_args(args)
        with mode:
            outputs = pytree.tree_leaves(body(*self.body_inputs(operands, spec)))
            self.check_outputs(body, outputs, operands, spec)
            return at_boundary(self.outputs_from_body(outputs, operands, spec))

    def functionalize_rule(self, ctx: Any, body: Callable, *args: Any) -> Any:
        """Unwrap, redispatch with the functionalized body, wrap. A body that writes into
        its inputs is refused (functionalizing it would silently drop the writes)."""
        from torch._higher_order_ops.utils import _maybe_run_with_interpreter

        operands, spec = self.split_args(args)
        if not is_tracing(operands) and not self.has_device_rule(operands):
            # Eager on a device whose tensors are always functionalized (XLA) and for which no
            # target registered a rule: the reference runs right here, above
            # functionalization, which handles its views (below it, torch_xla mis-handles them).
            return self.run_at_boundary(body, operands, spec)
        unwrapped = ctx.unwrap_tensors(list(operands))
        if not is_known_functional(body):
            options = range(self.num_options(spec)) if isinstance(body, OptionBodies) else [self.active_option(spec)]
            # The body is traced as written, below this functionalization layer. Under
            # ``torch.func.functionalize`` (a joint with writes traced again) the layer would
            # otherwise wrap the trace's fresh inputs, hiding their fake mode from the tracer:
            # tensors the body makes (SDPA's causal mask on XLA) would then be made for real.
            with ctx.redispatch_to_next():
                for index in options:
                    with disable_proxy_modes_tracing():
                        examples = self.body_inputs(unwrapped, self.option_spec(spec, index))
                    option = option_body(body, index)
                    self.refuse_mutation(trace_graph(option, examples), option)
        with ctx.redispatch_to_next():
            if is_tracing(operands):
                functional = map_options(
                    body, lambda b: FlatBody(named(ctx.functionalize(_maybe_run_with_interpreter(b)), body_name(b)))
                )
                outputs = self(known_functional(functional), *unwrapped, spec)
            else:
                # A device rule (XLA) traces the body itself, on fakes: it gets the body as is.
                outputs = self(body, *unwrapped, spec)
        return wrap_functional(ctx, outputs)

    def has_device_rule(self, operands: Sequence[Any]) -> bool:
        """Whether a lowering target registered this HOP's eager rule for the operands' device
        (``DispatchKey.XLA``: the XLA target runs a scan as one While)."""
        devices = {o.device.type for o in operands if isinstance(o, torch.Tensor)}
        return "xla" not in devices or DispatchKey.XLA in self.py_kernels

    def refuse_mutation(self, graph: fx.GraphModule, body: Callable) -> None:
        mutated, _ = find_input_mutation_and_aliasing(graph)
        if mutated:
            raise ValueError(
                f"{hop_prefix(self, body)}: the body writes into its input {mutated[0]} in place; "
                "a body must be functional (compute a new tensor and return it instead)"
            )

    def resolve_spec(self, spec: Any, operands: Sequence[Any], body_outputs: Sequence[Any]) -> Any:
        """The spec the node records, now that the ranks of what the body takes and returns
        are known (local_map resolves DTensor-style negative ``Shard`` dims); the same
        meaning. Default: ``spec``."""
        return spec

    def proxy_rule(self, mode: Any, body: Callable, *args: Any) -> Any:
        """Trace the body once on what it sees into a subgraph named after the user function,
        and emit one node ``hop(subgraph, *operands, spec)``."""
        from torch._higher_order_ops.utils import reenter_make_fx

        operands, spec = self.split_args(args)
        name = body_name(body)
        refuse_untracked_xla_operands(mode, operands, hop_prefix(self, body))
        count, active = self.num_options(spec), self.active_option(spec)
        graphs, steps = [], []
        for index in range(count):
            # One subgraph per option, traced on what the body sees under it.
            option = option_body(body, index)
            with disable_proxy_modes_tracing():
                examples = distinct_tensors(self.body_inputs(operands, self.option_spec(spec, index)))
            try:
                with _compat.eager_stance():
                    graph = reenter_make_fx(option)(*examples)
            except Exception as error:
                if index == active:
                    raise
                raise self.option_failure(name, spec, index, error) from error
            if not is_known_functional(body):
                self.refuse_mutation(graph, option)
            clone_aliased_outputs(graph)
            # make_fx names the class after the function it traced: re-tracing this graph, and
            # errors raised from it, then name the user function.
            type(graph).__name__ = name
            prefix = f"{name}_body_" if count == 1 else f"{name}_alternative{index}_body_"
            mode.tracer.root.register_module(mode.tracer.get_fresh_qualname(prefix), graph)
            (output_node,) = graph.graph.find_nodes(op="output")
            graphs.append(graph)
            steps.append([value.meta.get("val") for value in pytree.tree_leaves(output_node.args[0])])
        step = steps[active]
        with disable_proxy_modes_tracing():
            if count > 1 and all(isinstance(v, torch.Tensor) for values in steps for v in values):
                self.check_options(name, steps, operands, spec)
        constants = [lift_tensor_constants(graph) for graph in graphs]
        if any(constants):  # made in the body (torch.tensor([...])): operands, as if closed over
            values = [[tensor for _, tensor in lifted] for lifted in constants]
            if count > 1 and any(len(v) != len(values[active]) or not all(_same_constant(a, b) for a, b in zip(v, values[active])) for v in values):
                raise NotImplementedError(
                    f"{hop_prefix(self, body)}: the body makes different tensor constants under different "
                    "alternatives; pass them in as arguments"
                )
            with mode:
                lifted = [torch.ops.aten.lift_fresh_copy.default(tensor) for tensor in values[active]]
            for graph_constants in constants:
                for (placeholder, _), value in zip(graph_constants, lifted):
                    placeholder.meta["val"] = value
            operands, spec = self.fold_lifted(operands, spec, lifted)
        with disable_proxy_modes_tracing():
            if all(isinstance(v, FakeTensor) for v in step) and all(
                not isinstance(o, torch.Tensor) or isinstance(o, FakeTensor) for o in operands
            ):
                outputs = at_boundary(self.outputs_from_body(step, operands, spec))
            else:  # make_fx in real mode: run it
                outputs = self(known_functional(graphs[0] if count == 1 else OptionBodies(graphs, active)), *operands, spec)
        spec = self.resolve_spec(spec, operands, step)
        body_arg = graphs[0] if count == 1 else tuple(graphs)
        node_args = pytree.tree_map(mode.tracer.unwrap_proxy, (body_arg, *operands, spec))
        _inductor.ensure_lowering_pass()
        _export.note_recorded()
        out_proxy = mode.tracer.create_proxy("call_function", self, node_args, {})
        return track_tensor_tree(outputs, out_proxy, constant=None, tracer=mode.tracer)

    def transform_rule(self, interpreter: Any, body: Callable, *args: Any) -> Any:
        """torch.func (``grad``, ``vjp``, ``jvp``, ``vmap``, ``jacrev``, ``hessian``, ... and
        their compositions): the HOP's eager semantics run at the transform's level, so the
        transform differentiates or batches the body's own ops, closures, random draws and
        nested transforms included, to any order. Under a tracer the node is then inlined
        into the traced transform (right, and what torch does for plain functions)."""
        operands, spec = self.split_args(args)
        return self.run_at_boundary(body, operands, spec)

    def autograd_rule(self, body: Callable, *args: Any) -> Any:
        operands, spec = self.split_args(args)
        if not needs_traced_autograd(operands) or _compat.has_forward_tangent(operands):
            # Eager: the reference semantics under autograd. Its gradients are autograd's own.
            # Forward-mode AD (a dual level, linearize) also takes this path when traced: the
            # tangents flow through the body's ops, inlined; a HOP node would drop them.
            return self.run_at_boundary(body, operands, spec)
        if not any(isinstance(o, torch.Tensor) and o.requires_grad for o in operands) or not torch.is_grad_enabled():
            with torch._C._AutoDispatchBelowAutograd():
                return self(body, *operands, spec)
        try:
            plan = self.autograd_plan(body, operands, spec)
        except RuntimeError as error:  # tracing the joint differentiated an op without a derivative
            if not lacks_a_derivative(error):
                raise
            plan = NotDifferentiablePlan(self, body, spec, error)
        if isinstance(body, FlatBody) and body.treespec is None:  # a plan reused from an equal call
            body.treespec = plan.treespec
        return HopFunction.apply(plan, *operands)

    def dispatch(self, dispatch_key: Any, *args: Any, **kwargs: Any) -> Any:
        # A dispatch mode that is not a tracer and knows no HOPs (a FLOP counter, a user's
        # mode, simulated ranks) sees the HOP's eager semantics: the ops it is made of.
        if dispatch_key == DispatchKey.Python:
            mode = _compat.current_dispatch_mode()
            if (
                mode is not None
                and type(mode) not in self.python_key_table
                and not getattr(mode, "supports_higher_order_operators", False)
            ):
                body, *rest = args
                operands, spec = self.split_args(rest)
                return self.run_at_boundary(body, operands, spec)
        return super().dispatch(dispatch_key, *args, **kwargs)


def _same_constant(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return isinstance(a, FakeTensor) or isinstance(b, FakeTensor) or bool(torch.equal(a, b))

