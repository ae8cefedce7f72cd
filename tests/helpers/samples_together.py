"""Every sample of ``hop_db`` in one program: one compile (a forward and a backward graph)
checks what one compile per sample would, each sample's values read apart.

A compile costs Dynamo, AOTAutograd and inductor's Python side once per graph whatever the
graph holds; inductor compiles a sample's nodes as it would alone (its rules act node by
node), so the values and gradients of each sample still show whether its HOP's lowering is
right.
"""

from __future__ import annotations

import torch.utils._pytree as pytree

from tests.helpers.hop_db import SAMPLES, fresh


def combined(programs, counts):
    """One program running ``programs[i]`` on its own ``counts[i]`` inputs (laid end to end):
    the tuple of their results."""

    def program(*inputs):
        results, start = [], 0
        for one, count in zip(programs, counts):
            results.append(one(*inputs[start : start + count]))
            start += count
        return tuple(results)

    return program


def together(samples=SAMPLES, attribute="program"):
    """A program: ``program(*together_inputs())`` returns a tuple with each sample's
    ``attribute`` (``"program"`` or ``"reference"``) applied to its own inputs (seeded)."""
    return combined([getattr(sample, attribute) for sample in samples], [len(sample.inputs()) for sample in samples])


def together_inputs(samples=SAMPLES, seed=0):
    return [t for sample in samples for t in sample.inputs(seed=seed)]


def forward_backward_apart(fn, inputs, samples=SAMPLES):
    """``hop_db.forward_backward`` of ``fn`` (a program of ``together``), read apart by sample
    name (``outputs_and_grads_apart``)."""
    return outputs_and_grads_apart(fn, inputs, [sample.name for sample in samples], [len(sample.inputs()) for sample in samples])


def outputs_and_grads_apart(fn, inputs, names, counts):
    """For a program of ``combined`` with parts ``names`` of ``counts`` inputs: by name, the
    part's outputs (flattened) and its inputs' gradients. One backward of all outputs weighted
    by their position, so every output's cotangent differs."""
    inputs = fresh(inputs)
    per_part = [pytree.tree_leaves(result) for result in fn(*inputs)]
    outputs = [o for leaves in per_part for o in leaves]
    sum((o * (i + 1)).sum() for i, o in enumerate(outputs) if o.is_floating_point()).backward()
    apart, start = {}, 0
    for name, leaves, count in zip(names, per_part, counts):
        apart[name] = (leaves, [t.grad for t in inputs[start : start + count]])
        start += count
    return apart


def assert_close_apart(got, expected, **tolerances):
    """Each sample's outputs and gradients in ``got`` equal those in ``expected``, the
    failure naming the sample."""
    import torch

    assert list(got) == list(expected)
    for name, (outputs, grads) in got.items():
        expected_outputs, expected_grads = expected[name]
        torch.testing.assert_close(outputs, expected_outputs, **tolerances, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(grads, expected_grads, **tolerances, msg=lambda m, name=name: f"{name}: grads: {m}")
