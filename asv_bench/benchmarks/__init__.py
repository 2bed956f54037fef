"""asv benchmarks for pagedkv; each suite has a NumPy / pure-Python baseline."""
