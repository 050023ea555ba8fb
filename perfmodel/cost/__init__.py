"""Cost backends: what one graph node costs (physical.py, database.py, learned.py, hybrid.py, collectives.py), and
the chain that asks them in order (chain.py)."""
