"""``torch.compile(model, backend=hops_jax)``: Dynamo (HOPs kept) -> AOTAutograd (forward and
backward graphs with the HOPs) -> ``lower_to_jax`` -> ``jax.jit``, run on the caller's CPU tensors.

Each AOTAutograd graph is lowered and jitted once (jax then compiles once per input signature).
A call hands the caller's tensors to jax through DLPack and jax's results back the same way:
no copy where the memory can be shared (a contiguous tensor in; a result that lives on one
device, or is replicated, out). Copies remain where the program runs over a mesh: each input
reaches the mesh's devices as a numpy view the compiled program places (a copy per input), and
a result jax leaves sharded over them is gathered into one host tensor; ``JaxGraph.copies``
counts them, per direction. A forward's residuals (what AOTAutograd saves for the backward)
never cross: they stay jax arrays, carried to the backward by stand-in tensors (``JaxGraph``).
(Measured, ``benchmarks/jax_target.py``: placing DLPack's arrays replicated on the mesh instead
made a step 6x the hand-written JAX step; numpy views, ~2x while residuals were gathered to torch
tensors after the forward and placed on the mesh again before the backward.)

A forward whose backward has run once then computes that backward too, in one program with it,
at the cotangent its backward was last given (a loss's one; ``1 / k`` for an accumulated loss; a
gradient scaler's scale), other outputs' zeros (HF's logits beside its loss); its backward reads
those gradients (``_Fused``, ``_Link``): JAX's fused step, where torch's autograd asks for two
calls. Exact: another cotangent, or a second backward, runs the backward's own program on
residuals recomputed from the forward's inputs; and a forward whose gradients go unclaimed twice
in a row runs split until two backwards in a row would have claimed them. On every path an input
saved for the backward (every input, where it recomputes) and modified in place since the
forward is refused, as autograd refuses a saved tensor so modified.

Results and gradients have eager's dtypes and values: each call runs under jax's 64-bit mode,
scoped to it (``hops.lowering.jax_x64``; the caller's jax config is left as it is), so int64,
float64 and complex128 tensors cross, are computed and come back as themselves (without x64 jax
takes an int64 tensor as int32, its values past 2**31 wrapped, and float64 as float32); and each
tensor comes back as the dtype AOTAutograd traced for it (``_to_torch``). An index out of range
(``embedding``, ``gather``, ``x[i]``, a scatter, ...), an integer divided by zero, a false
``assert`` on tensors and a singular matrix to invert raise after the call, as torch raises, where
the program alone would go on with a wrong value (``passes/jax/checks.py``).

Found by name (``backend="hops_jax"``) through the ``torch_dynamo_backends`` entry point. A
first slice: CPU tensors only (a tensor on another device is refused, naming it); one mesh per
graph. ``hops.assume_pure`` through ``jax.vjp``: ``passes/jax/pure.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from hops.lowering import caller_saved_tensors_hooks, jax_x64

__all__ = ["hops_jax", "JaxGraph"]


def _to_jax(value: Any, copies: dict[str, int], where: Any) -> Any:
    import jax

    if not isinstance(value, torch.Tensor):
        return value
    tensor = _cpu_detached(value, where)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
        copies["in"] += 1
    return jax.dlpack.from_dlpack(tensor)


def _host_view(value: Any, where: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return _cpu_detached(value, where).numpy()


def _cpu_detached(value: torch.Tensor, where: Any) -> torch.Tensor:
    """``value`` detached; ``ValueError`` naming ``where`` (a name, or an input's position) off the CPU."""
    if not value.is_cpu:
        where = f"input {where}" if isinstance(where, int) else where
        raise ValueError(f"hops_jax: {where} is a {value.device} tensor; this backend runs on CPU tensors")
    return value.detach()


def _to_torch(value: Any, copies: dict[str, int], dtype: torch.dtype | None = None) -> Any:
    """``value`` (a jax array) as a torch tensor of ``dtype``, the traced graph's: the one place
    results and gradients cross back, so the one place a dtype jax computed otherwise (a rule's
    slip; 64-bit dtypes if x64 were off) is made torch's again."""
    import jax

    if not isinstance(value, jax.Array):
        return value
    # The sharding answers without building the shard list (``addressable_shards`` makes a
    # jax.Array and a Shard per device: a third of this function's time when every result was asked it).
    sharding = value.sharding
    if len(sharding.device_set) == 1:
        tensor = torch.from_dlpack(value)
    elif sharding.is_fully_replicated:
        tensor = torch.from_dlpack(value.addressable_data(0))
    else:
        copies["out"] += 1
        tensor = torch.from_numpy(_gathered(value))
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def _gathered(value: Any) -> Any:
    """A host copy of a jax array sharded over several devices: each distinct shard written once
    into its slice (``np.array(value)`` took 2-3x as long for an array split along two axes), read
    through the buffer protocol (a view of the shard's memory on CPU)."""
    import numpy as np

    out = np.empty(value.shape, value.dtype)
    for position, index in _distinct_shards(value.sharding, value.shape):
        out[index] = np.asarray(value.addressable_data(position))
    return out


@functools.lru_cache(maxsize=1024)
def _distinct_shards(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[int, Any], ...]:
    """(position in the array's shard list, slice of the whole) of each distinct shard of an
    array of ``shape`` laid out by ``sharding``: the same for every result of a signature, so
    worked out once (asking each result's ``addressable_shards`` built a Shard, its index and a
    device lookup per device per result: 40% of the gathering time of a training step's gradients)."""
    distinct: dict[tuple, tuple[int, Any]] = {}
    # The map lists the addressable devices in the order of an array's shards (as jax's own
    # host copy reads it).
    for position, index in enumerate(sharding.addressable_devices_indices_map(shape).values()):
        distinct.setdefault(tuple((part.start, part.stop, part.step) for part in index), (position, index))
    return tuple(distinct.values())


_HELD = "_hops_jax_value"  # the attribute of a stand-in tensor naming the jax array it stands for


def _stand_in(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``value``'s shape holding no data of its own (one element, zero strides) that
    carries the jax array: a forward's residual for the backward, which reads the array back."""
    tensor = _blank(tuple(value.shape), dtype)
    setattr(tensor, _HELD, value)
    return tensor


def _saved_dtypes(gm: fx.GraphModule) -> dict[int, torch.dtype]:
    """The positions (and dtypes) of a forward graph's outputs AOTAutograd saves for the backward
    only (after its effect tokens, a linalg op's check orders by, and its ``num_forward``
    user-visible ones); {} outside an AOTAutograd compile or for an inference graph."""
    metadata = _aot_metadata()
    returns = getattr(metadata, "num_forward", None)
    results = _results(gm.graph)
    if returns is None or not isinstance(results, (tuple, list)):
        return {}
    saved = {}
    for index in range(len(getattr(metadata, "tokens", None) or ()) + returns, len(results)):
        node = results[index]
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor):
            saved[index] = value.dtype
    return saved


def _saved_inputs(gm: fx.GraphModule, saved: dict[int, torch.dtype]) -> tuple[int, ...]:
    """The positions of a forward's inputs it returns as residuals (saved for the backward as they are)."""
    positions = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    results = _results(gm.graph)
    return tuple(sorted({positions[results[i]] for i in saved if results[i] in positions}))


def _results(graph: fx.Graph) -> Any:
    """What ``graph`` returns (its output node's argument)."""
    return next(iter(graph.find_nodes(op="output"))).args[0]


def _writes_inputs() -> bool:
    """Whether the graph AOTAutograd compiles writes into (or changes the metadata of) an input."""
    return bool(getattr(_aot_metadata(), "mutated_inp_runtime_indices", None))


def _aot_metadata() -> Any:
    """AOTAutograd's metadata of the graph it is compiling (None outside such a compile)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return getattr(context, "fw_metadata", None) if context is not None else None


class JaxGraph:
    """An AOTAutograd graph lowered to JAX and jitted, called on torch tensors.

    A forward's residuals (the outputs AOTAutograd saves for the backward only) stay jax arrays:
    torch is handed a stand-in tensor carrying the array (``_stand_in``), and the backward reads
    the array from it, so a residual is neither gathered to the host after the forward nor placed
    on the mesh again before the backward. Under a caller's saved-tensor hooks (offloading,
    checkpointing) that may read or replace what is saved, residuals are real tensors again."""

    def __init__(self, gm: fx.GraphModule, forward: bool = False) -> None:
        from passes.jax import lower_to_jax

        lowered = lower_to_jax(gm)
        # A graph compiled with dynamic shapes takes its sizes as ints: jax specializes on them
        # (static arguments: one compile per shape, as jax runs), and the sizes it returns (the
        # forward's, saved for the backward) go back to torch as ints.
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        static = tuple(i for i, node in enumerate(placeholders) if _is_number(node.meta.get("val")))
        self.random = _draws_random_numbers(lowered.graph_module)
        if self.random:
            # A key per call, drawn from torch's generator (torch.manual_seed reproduces a run):
            # the jitted function's first argument.
            self.function = _jitted(_keyed(lowered), tuple(i + 1 for i in static))
        else:
            self.function = _jitted(lowered, static)
        results = _results(gm.graph)
        results = results if isinstance(results, (tuple, list)) else [results]
        self.numbers = {i for i, node in enumerate(results) if isinstance(node, fx.Node) and _is_number(node.meta.get("val"))}
        # Each tensor result's dtype as traced (AOTAutograd's example values): what torch gets back.
        dtypes = [getattr(node.meta.get("val"), "dtype", None) if isinstance(node, fx.Node) else None for node in results]
        self.placement = _replicated_on_mesh(lowered.graph_module)
        self.saved = _saved_dtypes(gm) if forward else {}
        self.copies = {"in": 0, "out": 0}
        # Worked out once, not per call: (position, dtype) of each residual's stand-in, and
        # (position, is a number) of each other output; under a caller's saved-tensor hooks
        # residuals are tensors too (``results_hooked``).
        self.stand_ins = tuple(self.saved.items())
        self.results_hooked = tuple((i, i in self.numbers, dtypes[i]) for i in range(len(results)))
        self.results = tuple(result for result in self.results_hooked if result[0] not in self.saved)
        self.lowered, self.static, self.graph = lowered, static, gm.graph
        # Each call of a forward links its backward (``_Link``): the backward checks the inputs saved
        # for it were not modified in place (as autograd checks the tensors it saves), and from its
        # first call the two may run as one program (``fused``, set then; ``speculate``: whether
        # they still may, cleared by a test of the split path). Not where the backward takes sizes
        # (it reads them before the residuals), nor where AOTAutograd writes an input after the
        # forward (a batch norm's running statistics: a recomputation would read them written).
        self.fused: _Fused | None = None
        self.linked = forward and not static and not _writes_inputs()
        self.speculate = self.linked
        self.saved_inputs = _saved_inputs(gm, self.saved) if self.linked else ()

    def __call__(self, *args: Any) -> list[Any]:
        # jax's 64-bit mode for this call only (the caller's jax config is left as it is): torch's
        # int64 / float64 / complex128 tensors cross, are computed and come back as such; without it
        # DLPack hands jax an int64 tensor as int32, values past 2**31 wrapped.
        with jax_x64():
            return self._call(args)

    def _call(self, args: tuple) -> list[Any]:
        # Per call only what the arguments change: which outputs are residuals, numbers or tensors
        # was worked out at compile time, and an input's name is spelt on error only.
        link = getattr(args[0], _LINK, None) if args and isinstance(args[0], torch.Tensor) else None
        if link is not None:  # a backward: its gradients, if its forward's program computed them
            gradients, args = link.claim(self, args)
            if gradients is not None:
                return self._to_torch(gradients, self.results_hooked)
        inputs = self._inputs(args)
        keep = self.stand_ins and not caller_saved_tensors_hooks()
        if keep and self.fused is not None and self.fused.on:
            return self._to_torch(self.fused.run(self, args, inputs), self.results)
        outputs = list(self.function(*inputs))
        # The residuals' stand-ins first: they read only shapes, so they are made while the program
        # still runs; the results torch reads (which wait for it) after.
        for i, dtype in self.stand_ins if keep else ():
            outputs[i] = _stand_in(outputs[i], dtype)
        if keep and self.linked:
            setattr(outputs[self.stand_ins[0][0]], _LINK, _Link(self, args=args))
        return self._to_torch(outputs, self.results if keep else self.results_hooked)

    def _to_torch(self, outputs: list[Any], results: tuple) -> list[Any]:
        copies = self.copies
        for i, number, dtype in results:
            outputs[i] = _number(outputs[i]) if number else _to_torch(outputs[i], copies, dtype)
        return outputs

    def _inputs(self, args: tuple) -> list[Any]:
        if self.placement is None:
            inputs = [_held(a, _to_jax, self.copies, i) for i, a in enumerate(args)]
        else:
            # A program over a mesh: DLPack's arrays would be committed to one device; a numpy view of
            # the tensor's memory leaves the placement to the compiled program (jax copies each input
            # onto the devices that need it: a copy per input).
            import numpy as np

            inputs = [_held(a, _host_view, i) for i, a in enumerate(args)]
            self.copies["in"] += list(map(type, inputs)).count(np.ndarray)
        if self.random:
            import jax

            inputs = [jax.random.key(int(torch.randint(0, 2**31 - 1, ()))), *inputs]
        return inputs


# A training step hands the backward the loss's cotangent, each step the same (one; ``1 / k``
# where k steps accumulate; a gradient scaler's scale, changed every few thousand steps). Once a
# forward's backward has run, each call of the forward computes that backward too, at the
# cotangent last given, in the same program (``_Fused``), and the backward only reads the
# gradients (``_Link.claim``). Measured (``benchmarks/jax_target.py``):
# split, JAX itself takes 1.28x its fused step at batch 64 / dim 128, and torch's autograd asks
# any backend for the split (the forward returns before the backward is asked for). Exact: the
# gradients are the backward graph's at the cotangent it is given; given another (or a second
# backward), the backward's program runs on residuals the forward's program recomputes.
_LINK = "_hops_jax_link"  # the attribute of a forward's first stand-in naming its ``_Link``
# A fused forward whose gradients went unclaimed (no backward, or another cotangent) this many
# times in a row runs split (the backward's work is not done for nothing each call) until as many
# split backwards in a row were given the cotangents the program would have used.
_MISSES = 2


class _Link:
    """What one call of a forward hands its backward: the forward, its arguments and their
    versions; for a fused call, the gradients (until claimed) and the inputs as the program took
    them (to recompute the residuals)."""

    __slots__ = ("forward", "gradients", "inputs", "args", "versions", "cotangent")

    def __init__(self, forward: JaxGraph, gradients: list[Any] | None = None, inputs: list[Any] | None = None, args: tuple = ()) -> None:
        self.forward, self.gradients, self.inputs, self.args = forward, gradients, inputs, args
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        self.cotangent = forward.fused.cotangent if gradients is not None else None  # (the gradients')

    def claim(self, backward: JaxGraph, args: tuple) -> tuple[list[Any] | None, tuple]:
        """(the gradients, or None: ``backward``'s program runs on the arguments returned). The
        forward is paired with ``backward`` at its first call."""
        forward = self.forward
        if forward.fused is None and forward.speculate:
            forward.fused = _Fused.of(forward, backward)
            forward.speculate = forward.fused is not None
        gradients, self.gradients = self.gradients, None
        fused = forward.fused
        if gradients is not None:
            served, cotangent = fused.serves(args, self.cotangent)
            if served:
                fused.misses, fused.hits = 0, fused.hits + 1
                self.unchanged(forward.saved_inputs)
                return gradients, args
            fused.misses += 1
            fused.expect(cotangent)
        elif fused is not None and not fused.on:
            fused.would_have(args)
        if self.inputs is None:  # split: the residuals are the stand-ins' arrays
            self.unchanged(forward.saved_inputs)
            return None, args
        self.unchanged(range(len(self.args)))  # (the residuals are recomputed from every input)
        residuals = forward.function(*self.inputs)[forward.stand_ins[0][0] :]
        return None, (*residuals, *args[len(residuals) :])

    def unchanged(self, positions: Any) -> None:
        """``RuntimeError`` (autograd's words) if an argument at ``positions`` was modified in
        place since the forward: the backward would read it as the forward did not see it."""
        for i in positions:
            value, version = self.args[i], self.versions[i]
            if isinstance(value, torch.Tensor) and value._version != version:
                raise RuntimeError(
                    f"hops_jax: input {i} of the compiled forward, needed for gradient computation, has been modified "
                    f"by an inplace operation: [{value.dtype} {list(value.shape)}] is at version {value._version}; "
                    f"expected version {version} instead"
                )

    def __del__(self) -> None:
        # The autograd graph holding this call's stand-ins was freed without its backward.
        if self.gradients is not None:
            self.forward.fused.misses += 1


def _scalar(tangent: Any) -> float | None:
    """The value of a cotangent the fused program can take (a 0-d tensor), else None."""
    if isinstance(tangent, torch.Tensor) and tangent.dim() == 0 and not tangent.requires_grad:
        return tangent.item()
    return None


class _Fused:
    """A forward and its backward as one jitted program of the forward's inputs and the loss's
    cotangent, returning the forward's outputs torch sees and the backward's gradients (not the
    residuals: returning them made the program 1.1x as long at batch 256 / dim 512, each a buffer
    of its own). Called at the cotangent the backward was last given (one at first); the other
    outputs' cotangents zeros (autograd's for outputs the loss does not use: HF's logits beside
    its loss)."""

    def __init__(
        self, function: Callable[..., Any], residuals: list[tuple[tuple[int, ...], torch.dtype]], dtype: Any, loss: int, count: int
    ) -> None:
        self.function, self.residuals, self.dtype = function, residuals, dtype
        self.loss, self.count = loss, count  # the loss's position among the backward's tangents; their number
        self.hits = self.misses = 0  # gradients claimed; unclaimed in a row
        self.would = 0  # split backwards in a row the program would have served, while off
        self.expect(1.0)
        # The stand-ins of the residuals after the first are shared by every call (they carry
        # nothing); the first, carrying the call's ``_Link``, is made per call.
        self.blanks = [_blank(shape, dtype) for shape, dtype in residuals[1:]]

    @property
    def on(self) -> bool:
        return self.misses < _MISSES

    def would_have(self, args: tuple) -> None:
        """A split backward called with ``args`` while fusing is off: fusing is on again after
        ``_MISSES`` in a row the program would have served (a training loop back from
        evaluating with gradients enabled)."""
        served, cotangent = self.serves(args, self.cotangent)
        if served:
            self.would += 1
            if self.would >= _MISSES:
                self.misses = self.would = 0
        else:
            self.would = 0
            self.expect(cotangent)

    def expect(self, cotangent: float | None) -> None:
        """The cotangent the next calls compute the gradients at (None, a cotangent it cannot take: kept)."""
        if cotangent is not None and cotangent == cotangent:  # (not NaN: it equals nothing)
            import numpy as np

            self.cotangent, self.cotangent_array = cotangent, np.asarray(cotangent, dtype=self.dtype)

    def serves(self, args: tuple, cotangent: float | None) -> tuple[bool, float | None]:
        """Whether gradients the program computed at ``cotangent`` are those of a backward called
        with ``args`` (its tangents last: the loss's that cotangent, each other's zeros); and the
        loss's cotangent it was given."""
        tangents = args[len(args) - self.count :]
        given = _scalar(tangents[self.loss])
        if given != cotangent:
            return False, given
        return not any(k != self.loss and isinstance(t, torch.Tensor) and bool(t.any()) for k, t in enumerate(tangents)), given

    def run(self, forward: JaxGraph, args: tuple, inputs: list[Any]) -> list[Any]:
        """The forward's outputs (residuals as blank stand-ins, the first linking its backward to
        the gradients)."""
        outputs = list(self.function(*inputs, self.cotangent_array))
        first = forward.stand_ins[0][0]
        gradients = outputs[first:]
        link = _blank(*self.residuals[0])
        setattr(link, _LINK, _Link(forward, gradients, inputs, args))
        outputs[first:] = [link, *self.blanks]
        return outputs

    @classmethod
    def of(cls, forward: JaxGraph, backward: JaxGraph) -> _Fused | None:
        """The fused program, or None where the pair does not fit it: a backward drawing random
        numbers, sizes as arguments, other placements, numbers among the residuals, or tangents
        other than one scalar's (the loss's) and floating tensors'. A forward drawing random
        numbers takes its key first, as its own program does (recomputed residuals draw the same)."""
        import jax.numpy as jnp

        from passes.jax.aten import jax_dtype

        placeholders = list(backward.graph.find_nodes(op="placeholder"))
        first = forward.stand_ins[0][0]
        tangents = [node.meta.get("val") for node in placeholders[len(forward.stand_ins) :]]
        scalars = [k for k, t in enumerate(tangents) if isinstance(t, torch.Tensor) and t.dim() == 0]
        if (
            backward.random
            or backward.static
            or forward.placement != backward.placement
            or [i for i, _ in forward.stand_ins] != list(range(first, len(forward.results_hooked)))
            or not all(node.name.startswith("tangents") for node in placeholders[len(forward.stand_ins) :])
            or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tangents)
            or len(scalars) != 1
        ):
            return None
        run_forward = _keyed(forward.lowered) if forward.random else forward.lowered
        loss, run_backward = scalars[0], backward.lowered
        zeros = [(k, tuple(t.shape), jax_dtype(t.dtype)) for k, t in enumerate(tangents) if k != loss]

        def forward_and_backward(*inputs: Any) -> tuple:
            outputs = run_forward(*inputs[:-1])
            given = [inputs[-1]] * len(tangents)
            for k, shape, dtype in zeros:
                given[k] = jnp.zeros(shape, dtype)
            return (*outputs[:first], *run_backward(*outputs[first:], *given))

        output = _results(forward.graph)
        residuals = [(tuple(output[i].meta["val"].shape), dtype_) for i, dtype_ in forward.stand_ins]
        return cls(_jitted(forward_and_backward, ()), residuals, jax_dtype(tangents[loss].dtype), loss, len(tangents))


def _blank(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` holding one element (zero strides): a residual's stand-in."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype)


def _draws_random_numbers(gm: fx.GraphModule) -> bool:
    """Whether a node of ``gm`` or of a body in it is a random ATen op."""
    from passes._infra import graph_modules
    from passes.jax.aten import is_random

    return any(is_random(node.target) for module in graph_modules(gm) for node in module.graph.nodes)


def _jitted(function: Callable[..., Any], static: tuple[int, ...]) -> Callable[..., Any]:
    """``jax.jit(function)`` with the run-time checks its rules state made (``passes/jax/checks.py``):
    an index out of range, an integer divided by zero, a false tensor assertion, a failed
    factorization raise after the call, as torch raises. (A program without such an op pays
    nothing: measured, a step of ``benchmarks/jax_target.py`` and an HF Llama's first step took as long.)"""
    import jax

    from passes.jax.checks import checked, raising

    return raising(jax.jit(checked(function, static), static_argnums=static))


def _keyed(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` taking the key its random ops draw from as its first argument."""
    from passes.jax.aten import random_key

    def keyed(key: Any, *args: Any) -> Any:
        with random_key(key):
            return function(*args)

    return keyed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)


def _number(value: Any) -> Any:
    """A size (or other number) a graph returns, as the Python number torch expects."""
    return value.item() if hasattr(value, "item") else value


def _held(value: Any, convert: Callable[..., Any], *how: Any) -> Any:
    """The jax array a stand-in carries, else ``convert(value, *how)``."""
    held = getattr(value, _HELD, None) if isinstance(value, torch.Tensor) else None
    return convert(value, *how) if held is None else held


def _replicated_on_mesh(gm: fx.GraphModule) -> Any:
    """The replicated sharding over the one mesh the lowered graph's specs name (None without a
    mesh); ``ValueError`` for a graph naming two meshes (not taken yet)."""
    import jax

    from hops.specs import Mesh
    from passes._infra import graph_modules
    from passes.jax.rules import jax_mesh

    meshes = set()
    for module in graph_modules(gm):
        for node in module.graph.nodes:
            for arg in node.args:
                mesh = getattr(arg, "mesh", None)
                if isinstance(mesh, Mesh):
                    meshes.add(mesh)
    if len(meshes) > 1:
        raise ValueError(f"hops_jax: a graph over {len(meshes)} meshes {sorted(map(repr, meshes))}; one mesh per graph is taken")
    if not meshes:
        return None
    return jax.sharding.NamedSharding(jax_mesh(meshes.pop()), jax.sharding.PartitionSpec())


COMPILED: list[JaxGraph] = []  # the graphs this process compiled, last one last (for measurements)


def _compile(gm: fx.GraphModule, example_inputs: list[Any], forward: bool = False) -> Callable:
    from functorch.compile import make_boxed_func

    graph = JaxGraph(gm, forward)
    COMPILED.append(graph)
    return make_boxed_func(graph)


def _compile_forward(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    return _compile(gm, example_inputs, forward=True)


def hops_jax(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The Dynamo backend (see the module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_compile_forward, bw_compiler=_compile, inference_compiler=_compile)(gm, example_inputs)
