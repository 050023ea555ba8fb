"""The reliability campaign: bad inputs and faults fed to the real entry points of each area, every outcome
classified (``harness.py``), counted per area (``campaign.py``). ``python -m benchmarks.reliability --help``.

Areas: ``ondevice_area.py`` (GGUF files, generation limits, plans, ring peers, the server, export; cases in
``ondevice_cases.py``, ``run_cases.py``, ``serve_cases.py``) and ``resilience_area.py`` (config, checkpoints, hot
swap, a run's life cycle; cases in ``resilience_cases.py``, ``hotswap_cases.py``, ``lifecycle_cases.py``). The
tests (tests/ondevice/test_faults.py, tests/resilience/test_faults.py) run the same cases through the same
harness.
"""
