"""The test suite, a package: test modules import their helpers as ``tests.helpers.*``
(run ``pytest`` from the repository's root)."""
