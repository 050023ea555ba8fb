"""Offline calibration and validation of the performance model on this host: measuring (bench.py, runners.py,
child.py, host.py), tracing (nodes.py, over perfmodel/cost/trace_nodes.py), timing instructions alone (perfmodel/cost/profiler.py),
collectives (collective_bench.py), fitting (fit.py, calibrate.py, refit.py), validating (validate.py, layouts.py).
Prediction never imports any of it."""
