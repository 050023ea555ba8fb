"""`python -m perfmodel search`: enumerate layouts for a model on N devices, rank by predicted step time.

Candidates: every (data, fsdp, tensor, pipeline) factorisation of N that the config validator accepts,
x rules preset (default / zero3), x remat (none / dots / full), x micro-batches for pipelined ones.
Each is priced with the analytic graph (no compile: hundreds of layouts per second) and filtered by
the analytic memory estimate against the profile's capacity. ``search --run-top`` checks the ranking by a run on
this host (perfmodel/calib/layouts.py).
"""
from __future__ import annotations

import dataclasses
import itertools

from framework.config import Config, ConfigError, MeshConfig, validate
from perfmodel import predict
from perfmodel.hardware import HardwareProfile


def _divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, n: int):
  for dp, fs, tp in itertools.product(_divisors(n), repeat=3):
    if n % (dp * fs * tp):
      continue
    pp = n // (dp * fs * tp)
    for rules, remat in itertools.product(("default", "zero3"), ("none", "dots", "full")):
      if rules == "zero3" and fs * dp == 1:
        continue
      for mb in ((1,) if pp == 1 else (pp, 2 * pp, 4 * pp)):
        mesh = MeshConfig(data=dp, fsdp=fs, tensor=tp, pipeline=pp, sequence=1, rules=rules,
                          form="shard_map" if pp > 1 else cfg.mesh.form, microbatches=mb, schedule="1f1b")
        c = dataclasses.replace(cfg, mesh=mesh, model=dataclasses.replace(cfg.model, remat=remat))
        try:
          yield validate(c, n)
        except ConfigError:
          continue


def rank(cfg: Config, hw: HardwareProfile, n: int, backend: str = "auto") -> tuple:
  """(candidates tried, [(predicted step, config, prediction)] of those that fit in memory, fastest first)."""
  ranked, n_tried = [], 0
  for c in candidates(cfg, n):
    n_tried += 1
    p = predict.predict(c, hw, method="analytic", backend=backend)
    if p.peak_memory_bytes > hw.mem_bytes:
      continue
    ranked.append((p.step_time_s, c, p))
  ranked.sort(key=lambda t: t[0])
  return n_tried, ranked


def run(cfg: Config, hw: HardwareProfile, n: int, top: int = 10, backend: str = "auto") -> dict:
  n_tried, ranked = rank(cfg, hw, n, backend)
  return {"devices": n, "hardware": hw.name, "n_candidates": n_tried, "n_fit_memory": len(ranked),
          "ranking": [{"rank": i + 1, "step_time_s": t, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
                       "mesh": p.mesh, "rules": c.mesh.rules, "remat": c.model.remat,
                       "microbatches": c.mesh.microbatches, "peak_memory_bytes": p.peak_memory_bytes}
                      for i, (t, c, p) in enumerate(ranked[:top])]}
