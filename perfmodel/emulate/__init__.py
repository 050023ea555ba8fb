"""Faithful large-scale emulation (issue 4, after the PrismLLM paper): one real rank per distinct
per-rank program runs its real computation at real shapes on the local device; collectives with
virtual peers are stand-ins timed by perfmodel.collectives. See perfmodel/emulate/README.md."""
