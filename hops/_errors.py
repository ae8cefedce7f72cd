"""How this package's errors name the call and the value they are about.

One convention for every HOP (CONTRIBUTING.md, "Error messages"):

- a message starts with the call it is about, ``<function>(<subject>): ``, where
  ``<function>`` is the public function the user called (``scan``, ``local_map``,
  ``named_scope``, ``kernel``, ``einsum``, ``annotate_sharding``) and ``<subject>`` names
  this call: the user's function (``scan(step)``, ``local_map(block)``,
  ``kernel(scaled_tanh)``), or for einsum its equation; ``<function>: `` alone where there
  is nothing to name yet (``scan: fn must be callable``) or ever (``annotate_sharding``);
- a leaf of an argument is named by its key path from the argument, as
  ``torch.utils._pytree.keystr`` writes it (``xs[0]['w']``, ``init[1]``,
  ``in_placements[0]['w']``; the argument's own name for a single tensor), never by its
  position among the flattened leaves.

``hop_prefix`` gives the first for a HOP object (bodies are named by ``body_name``), so a new
HOP gets it by registering under ``hops_<function>``; ``leaf_names`` the second.
``PREFIX_PATTERN`` is the form every message matches (the tests hold every raise site to it).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.utils._pytree as pytree

from hops._body_hop.subgraph import body_name

__all__ = ["PREFIX_PATTERN", "call_prefix", "hop_prefix", "leaf_name", "leaf_names", "public_name"]

# ``scan(step): ``, ``einsum('ij,jk->ik'): ``, ``annotate_sharding: `` (group 1: the function).
PREFIX_PATTERN = r"^(\w+)(?:\(.+?\))?: "

# HOPs whose public function is not their registered name without ``hops_``.
_PUBLIC_NAMES = {"hops_sharding_annotation": "annotate_sharding"}


def public_name(hop: Any) -> str:
    """The public function a HOP is called through: ``hops_scan`` -> ``scan``; every
    ``hops.kernel`` HOP (``hops_kernel_<name>``) -> ``kernel``."""
    name = getattr(hop, "__name__", None) or str(hop)
    if name.startswith("hops_kernel_"):
        return "kernel"
    return _PUBLIC_NAMES.get(name, name[len("hops_") :] if name.startswith("hops_") else name)


def call_prefix(function: str, subject: str | None = None) -> str:
    """``scan(step)``: the call an error is about (without the colon)."""
    return f"{function}({subject})" if subject else function


def hop_prefix(hop: Any, body: Callable | None = None) -> str:
    """``scan(step)`` for a call of ``hop`` with ``body`` (named after the user's function)."""
    return call_prefix(public_name(hop), None if body is None else body_name(body))


def leaf_name(argument: str, path: Sequence[Any] = ()) -> str:
    """``xs[0]['w']``: the leaf at key ``path`` of the argument named ``argument``."""
    return argument + pytree.keystr(tuple(path))


def leaf_names(argument: str, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """A name per leaf of ``tree`` (the argument named ``argument``), in flattening order."""
    paths, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [leaf_name(argument, path) for path, _ in paths]
