"""`python -m perfmodel search`: enumerate layouts for a model on N devices, rank by predicted step time.

Candidates: every (data, fsdp, tensor, pipeline) factorisation of N that the config validator accepts,
x rules preset (default / zero3), x remat (none / dots / full), x micro-batches for pipelined ones.
Each is priced with the analytic graph (no compile: hundreds of layouts per second) and filtered by
the analytic memory estimate against the profile's capacity. With --run-top on this host, the
top-ranked and the config's own layout are compiled and timed, so the ranking is checked by a run.
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


def run(cfg: Config, hw: HardwareProfile, n: int, top: int = 10, run_top: bool = False, backend: str = "auto",
        config_path: str = "", overrides=()) -> dict:
  ranked = []
  n_tried = 0
  for c in candidates(cfg, n):
    n_tried += 1
    p = predict.predict_train_analytic(c, hw, backend)
    if p["peak_memory_bytes"] > hw.mem_bytes:
      continue
    ranked.append((p["step_time_s"], c, p))
  ranked.sort(key=lambda t: t[0])
  out = {"devices": n, "hardware": hw.name, "n_candidates": n_tried, "n_fit_memory": len(ranked),
         "ranking": [{"rank": i + 1, "step_time_s": t, "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"],
                      "mesh": p["mesh"], "rules": c.mesh.rules, "remat": c.model.remat,
                      "microbatches": c.mesh.microbatches, "peak_memory_bytes": p["peak_memory_bytes"]}
                     for i, (t, c, p) in enumerate(ranked[:top])]}
  if run_top and ranked:
    out["run_check"] = _run_check(cfg, ranked[0][1], n)
  return out


def _run_check(default_cfg: Config, best: Config, n: int) -> dict:
  """Compile and time the top layout and the config's own layout on this host (jit form only)."""
  from perfmodel import capture
  from perfmodel.validate import measure_train
  res = {}
  for label, c in (("top", best), ("default", validate(default_cfg, n))):
    if c.mesh.pipeline > 1:
      res[label] = {"skipped": "pipeline layouts need the shard_map step"}
      continue
    cap = capture.train_step(c, keep_compiled=True)
    r = measure_train(cap, c, reps=7)
    res[label] = {"measured_s": r["median"], "mesh": {k: v for k, v in c.mesh.sizes().items() if v != 1},
                  "rules": c.mesh.rules, "remat": c.model.remat}
  if "measured_s" in res.get("top", {}) and "measured_s" in res.get("default", {}):
    res["top_beats_default"] = res["top"]["measured_s"] < res["default"]["measured_s"]
  return res
