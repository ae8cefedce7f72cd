"""Higher-order operators that keep sharding annotations, local_map regions, scans,
opaque kernels and named scopes in traced graphs, with typed spec arguments.

``import hops`` registers every HOP (eager, fake, functionalization, proxy, autograd,
torch.func, Dynamo and inductor rules) and binds the name ``hops`` in FX-generated code so
spec values in node args print and run as ``hops.Shard(0)``.
"""

import sys as _sys

from hops import _compat, _export
from hops.specs import (
    LocalMapSpec,
    Mesh,
    Partial,
    Placement,
    RegionPlacements,
    Replicate,
    Shard,
    ShardingSpec,
    spec_from_text,
)

_compat.register_fx_global("hops", "import hops", _sys.modules[__name__])

from hops._body_hop.call import DeviceMismatchError  # noqa: E402
from hops.assume_pure import assume_pure  # noqa: E402
from hops.einsum import (  # noqa: E402
    EinsumLinear,
    einsum,
    einsum_kernel,
    einsum_linear,
    einsum_linear_kernel,
    patch_linear,
)
from hops.kernel import Kernel, KernelParams, kernel  # noqa: E402
from hops.local_map import local_map, local_map_hop  # noqa: E402
from hops.named_scope import ScopeSpec, named_scope, named_scope_hop  # noqa: E402
from hops.scan import ScanSpec, scan, scan_hop  # noqa: E402
from hops.sharding_annotation import annotate_sharding, sharding_annotation_hop  # noqa: E402

# torch.export.save / load write each spec argument as its text and read it back typed:
# the import registers a namespace with torch's serializer (see hops/_export.py).
_export.register()

__all__ = [
    "Mesh",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "ShardingSpec",
    "LocalMapSpec",
    "RegionPlacements",
    "spec_from_text",
    "DeviceMismatchError",
    "local_map",
    "local_map_hop",
    "ScanSpec",
    "scan",
    "scan_hop",
    "annotate_sharding",
    "sharding_annotation_hop",
    "kernel",
    "Kernel",
    "KernelParams",
    "einsum",
    "einsum_linear",
    "einsum_kernel",
    "einsum_linear_kernel",
    "patch_linear",
    "EinsumLinear",
    "named_scope",
    "named_scope_hop",
    "ScopeSpec",
    "assume_pure",
]
