"""The interface of ``hops`` for lowering targets (``passes/`` and any other).

A target builds on the public HOP modules (``hops.scan``, ``hops.local_map``,
``hops.named_scope``, ``hops.sharding_annotation``, ``hops.kernel``, ``hops.einsum``,
``hops.specs``) and on this module, never on a private ``hops`` name: what is here is what a
target may rely on, and ``tests/test_lowering_interface.py`` holds ``passes/`` to it.

Scans (a node ``hops_scan(body, *init, *xs, *additional, ScanSpec)``):

- ``split_scan_operands(operands, spec) -> (init, xs, additional)``;
- ``scan_length(xs, spec)``: the number of steps;
- ``scan_step_examples(xs)``: one step's slice of each xs (metadata only for fake tensors);
- ``run_scan_steps(body, operands, spec)``: the reference semantics, a Python loop.

Layouts (the reference mapping of global tensors to per-device shards, ``hops._layout``):

- ``device_coordinates(mesh)``, ``local_shape(shape, placements, mesh, what)``,
  ``global_shape(shape, placements, mesh, what)``;
- ``replicated``: the op ``hops_layout::replicated(pieces, axis, what, whole_cotangents)``
  checking that per-device pieces of a replicated value agree.

Bodies (what a HOP's rules hand a device rule):

- ``at_boundary(values)``: tensors made contiguous, the layout every body is traced on and
  every body HOP returns (a rule calling a body passes it operands so, and returns results so);
- ``body_name(body)``: the user function's name, as subgraphs are named;
- ``flat_body(body)``: ``body`` returning the flat tuple of its result's leaves;
- ``distinct_tensors(values)``: fresh tensor objects for tracing (no two inputs one object);
- ``clone_aliased_outputs(gm)``, ``is_view(node)``: outputs made never to alias inputs, and
  which nodes are views;
- ``across_calls_key(body)``: the ``CodeKey`` under which equal eager calls may share what
  was made from the body; ``traced_graph(body)``: the GraphModule a body built by this package
  runs, if any; ``plan_body_key(body)``: for a body of an autograd plan (made once, reads no
  Python state), the key under which what is made from it may be kept; else None.

Errors (the package's convention, ``hops._errors``): ``hop_prefix(hop, body)`` is the
``scan(step)`` an error about a HOP's call starts with; ``leaf_name(argument, path)`` names a
leaf by its key path (``xs[0]['w']``).

Inductor: ``inductor_rule(hop)``: the HOP's inductor lowering (``hops._inductor``, a per-HOP
table each HOP module fills), or None; ``passes._infra.hop_tables`` lists it with the passes'.

Devices: ``register_graph_compiler(device, compiler, prepare=...)`` (how ``hops.assume_pure``
runs graphs traced for that device's tensors; see ``hops._targets``).

Autograd: ``caller_saved_tensors_hooks()``: whether the caller has saved-tensor hooks active
(offloading, checkpointing), which may read or replace what a compiled forward saves.

Torch versions (facts kept in ``hops._compat``, with the version each holds for and why) a
target works around: ``DTENSOR_RUNS_FILL_SCALAR``, ``DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF``,
``DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT``, ``SOLVE_RETURNS_TRANSPOSED_FACTORS``; and a jax
difference: ``jax_x64()``, jax's 64-bit mode scoped to a target's own calls (``jax.enable_x64`` /
``jax.experimental.enable_x64``).
"""

from __future__ import annotations

from hops._body_hop.body import at_boundary, distinct_tensors
from hops._body_hop.body_record import across_calls_key, plan_body_key, traced_graph
from hops._body_hop.flat_body import flat_body
from hops._body_hop.subgraph import body_name, clone_aliased_outputs, is_view
from hops._compat import (
    DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF,
    DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT,
    DTENSOR_RUNS_FILL_SCALAR,
    SOLVE_RETURNS_TRANSPOSED_FACTORS,
    caller_saved_tensors_hooks,
    jax_x64,
)
from hops._errors import hop_prefix, leaf_name
from hops._inductor import inductor_rule
from hops._layout import device_coordinates, global_shape, local_shape, replicated
from hops._targets import register_graph_compiler
from hops.scan import run_scan_steps, scan_length, scan_step_examples, split_scan_operands

__all__ = [
    "DTENSOR_CACHE_IGNORES_SIZE_ARGS_OF",
    "DTENSOR_NORM_BACKWARD_KEEPS_PARAMETER_LAYOUT",
    "DTENSOR_RUNS_FILL_SCALAR",
    "SOLVE_RETURNS_TRANSPOSED_FACTORS",
    "across_calls_key",
    "at_boundary",
    "body_name",
    "caller_saved_tensors_hooks",
    "clone_aliased_outputs",
    "device_coordinates",
    "distinct_tensors",
    "flat_body",
    "global_shape",
    "hop_prefix",
    "inductor_rule",
    "is_view",
    "jax_x64",
    "leaf_name",
    "local_shape",
    "plan_body_key",
    "register_graph_compiler",
    "replicated",
    "run_scan_steps",
    "scan_length",
    "scan_step_examples",
    "split_scan_operands",
    "traced_graph",
]
