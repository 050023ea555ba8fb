"""Faithful large-scale emulation (after the PrismLLM paper): one real rank per distinct per-rank program runs its
real computation at real shapes on the local device; collectives with virtual peers are stand-ins priced by
perfmodel/cost/collectives.py. See perfmodel/emulate/README.md."""
