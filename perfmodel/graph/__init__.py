"""The execution graph: what a per-device program does, node by node (nodes.py), built from a compiled program's
HLO (from_hlo.py, parsed by hlo_parse.py), from a per-rank jaxpr (from_jaxpr.py) or from the config alone
(analytic.py)."""
