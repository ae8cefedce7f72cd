"""What test modules share and pytest does not collect: ``hop_db`` (one sample program per
HOP), ``snapshot`` (readable graphs, tracing shortcuts, HLO text) and ``dtensor_scenarios``
(the programs ``test_dtensor.py`` runs on spawned ranks)."""
