"""The machinery every HOP with a body shares (scan, local_map, named_scope; kernels use
a few of its helpers). Each module is named for what it does; nothing is re-exported here,
so an import names the module that defines what it imports.

- ``base``: ``BodyHOP``, the rules (call, fake, functionalization, proxy, autograd,
  torch.func, dispatch modes) written once from the few methods each HOP defines;
- ``region``: ``RegionHOP`` and ``RegionPlan``, what the region HOPs (local_map,
  named_scope: the body runs once on the operands or their shards) add: their traced autograd;
- ``call``: ``call_body_hop``, how a public function calls a body HOP;
- ``body``: inspecting a body on fake stand-ins (closures lifted, writes refused) and the
  boundary layout (``at_boundary``);
- ``body_record``, ``code_key``: what is known about a body (``body.__hops__``), and the
  key of its code and Python state that equal calls share;
- ``flat_body``: the forms rules see a body in (``FlatBody``, ``OptionBodies``);
- ``subgraph``: naming, aliasing and mutation checks on traced bodies;
- ``joint``, ``autograd``: a body's joint traced and split into forward and backward
  bodies, and the ``autograd.Function`` that runs them (``AutogradPlan``, ``HopFunction``);
- ``caches``: the inspections and plans equal calls reuse.
"""
