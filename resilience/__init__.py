"""Hot-swap resilience: replicated in-memory snapshots, warm spares, communicator rebuild (see README.md)."""


def run_hotswap(cfg, workdir: str) -> dict:
  from resilience.launch import run_hotswap as _run  # noqa: PLC0415 (keeps `import resilience` light: experiments/run.py imports resilience.recovery)
  return _run(cfg, workdir)
