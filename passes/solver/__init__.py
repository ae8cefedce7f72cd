"""The solver pipeline: place every value of a traced program on a device mesh.

- ``placement_graph``: the networkx view (values, strategies, fixed placements, data edges).
"""

from passes.solver.graph import Strategy, placement_graph

__all__ = ["placement_graph", "Strategy"]
