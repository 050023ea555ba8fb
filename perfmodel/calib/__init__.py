"""Offline calibration and validation of the performance model on this host: measuring (bench.py, runners.py,
child.py, host.py), tracing (trace_nodes.py, nodes.py), timing instructions alone (fusion_profiler.py),
collectives (collective_bench.py), fitting (fit.py, calibrate.py, refit.py), validating (validate.py, layouts.py).
Prediction never imports any of it."""
