"""Graph text for snapshots: one string that holds on every supported torch version."""

from __future__ import annotations

import re

import torch.fx as fx

_DROP = re.compile(r"^\s*(# No stacktrace found.*|# File: .*|# Annotation: .*)$")


def normalize(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line.strip() or _DROP.match(line):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def readable(gm: fx.GraphModule) -> str:
    """``gm.print_readable`` without stack traces, blank lines or trailing spaces."""
    return normalize(gm.print_readable(print_output=False))


def delete_meta(gm: fx.GraphModule) -> None:
    """Delete every ``node.meta`` and ``gm.meta`` in ``gm`` and its subgraphs."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.meta.clear()
            for node in module.graph.nodes:
                node.meta.clear()
