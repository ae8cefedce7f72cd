"""The forms in which a body HOP's rules see its body: ``FlatBody`` (the flat tuple of the
result's leaves, its structure remembered) and ``OptionBodies`` (one body per option of a
spec that offers options; the active one runs)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch.utils._pytree as pytree

from hops._body_hop.body_record import BodyRecord, body_record, trace_key
from hops._body_hop.subgraph import body_name

__all__ = ["FlatBody", "OptionBodies", "flat_body", "map_options", "option_body"]


class FlatBody:
    """``body`` returning the flat tuple of its result's leaves, and remembering their
    structure (``treespec``) from its last call.

    A body HOP's rules see bodies of this form (a subgraph's output is a flat tuple);
    ``BodyHOP.__call__`` returns the flat results in the structure the body returned."""

    def __init__(self, body: Callable) -> None:
        self.body = body
        self.treespec: Any = None
        self.__name__ = self.__qualname__ = body_name(body)
        self.__hops__ = dataclasses.replace(body_record(body), trace_key=trace_key(body))

    def __call__(self, *inputs: Any) -> tuple:
        leaves, self.treespec = pytree.tree_flatten(self.body(*inputs))
        return tuple(leaves)

    def unflatten(self, flat: Sequence[Any]) -> Any:
        if self.treespec is None:  # no rule ran the body: its results are already flat
            return flat
        return pytree.tree_unflatten(list(flat), self.treespec)


def flat_body(body: Callable) -> FlatBody:
    return body if isinstance(body, (FlatBody, OptionBodies)) else FlatBody(body)


class OptionBodies:
    """One body per option of a HOP whose spec offers options (``local_map``'s
    alternatives, each with its own local shapes): the node's first argument is then the
    tuple of their subgraphs. Calling it runs the active option's body, as eager and every
    lowering do until a solver chooses another (``BodyHOP.active_option``).

    Its bodies return flat tuples (``FlatBody``); rules pick one with ``option_body``."""

    def __init__(self, bodies: Sequence[Callable], active: int) -> None:
        if not bodies or not all(callable(b) for b in bodies):
            raise TypeError(f"OptionBodies(bodies=...) must be a non-empty tuple of callables, got {bodies!r}")
        if not 0 <= active < len(bodies):
            raise ValueError(f"OptionBodies(active=...): option {active} is not one of the {len(bodies)} bodies")
        self.bodies = tuple(flat_body(b) for b in bodies)
        self.active = active
        self.__name__ = self.__qualname__ = body_name(self.bodies[active])
        records = [body_record(b) for b in self.bodies]
        plan = all(r.plan_body for r in records)
        self.__hops__ = BodyRecord(
            # Equal tuples of bodies share one inspection and plan within a trace; a plan's
            # bodies (made once, reused) are their own key, which device rules keep weakly.
            trace_key=self if plan else tuple(trace_key(b) for b in self.bodies),
            code_key=None,  # no reuse across eager calls: each option is its own trace
            known_functional=all(r.known_functional for r in records),
            plan_body=plan,
            graph=records[active].graph,
        )

    def __call__(self, *inputs: Any) -> tuple:
        return self.bodies[self.active](*inputs)

    @property
    def treespec(self) -> Any:
        return self.bodies[self.active].treespec

    def unflatten(self, flat: Sequence[Any]) -> Any:
        return self.bodies[self.active].unflatten(flat)


def option_body(body: Callable, index: int) -> Callable:
    """The body of option ``index``: its own for ``OptionBodies``; one Python body (which
    runs on any local shapes) serves every option."""
    return body.bodies[index] if isinstance(body, OptionBodies) else body


def map_options(body: Callable, transform: Callable[[Callable], Callable]) -> Callable:
    """``transform`` applied to each option's body (or to the one body)."""
    if isinstance(body, OptionBodies):
        return OptionBodies([transform(b) for b in body.bodies], body.active)
    return transform(body)
