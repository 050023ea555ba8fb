"""Paper figures: `python -m experiments.figures [--list] [--only NAME] [--rerun NAME] [--out-dir DIR]`.

One module per paper registers its figures with `registry.figure` (see registry.py for the API).
"""
