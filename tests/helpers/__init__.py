"""What test modules share and pytest does not collect: ``hop_db`` (one sample program per
HOP), ``snapshot`` (readable graphs, tracing shortcuts, HLO text), ``dtensor_scenarios``
(the programs ``test_dtensor.py`` runs on spawned ranks) and ``random_problems`` (small random
solver problems with the contest's 1e18 costs, and their brute force)."""
