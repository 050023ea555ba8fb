"""Running and timing the suite's programs on this host, in this process or in a fresh child per device count.

A measurement of a training config is two rounds of timed steps (at least a second each), of a decode config the
slope of the sampler's time over two generation lengths (TPOT); both are recorded in every statistic of
perfmodel/calib/bench.py (the median at the top level, the p10 under ``"p10"``), and perfmodel/calib/host.py reads
them in one. Entries are measured in a child process with exactly their own number of virtual devices, as
``python -m experiments.run`` gives a config with that mesh size: idle virtual devices are not free (a one-device
step runs 1.23-1.45x slower with 8 host devices, its thunks hopping between 8 XLA worker threads).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from framework import model as model_lib
from framework import xla_flags
from framework.config import from_dict, validate as validate_cfg
from perfmodel import program
from perfmodel.calib import bench, store, suite as default_suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# seconds per TPOT round: a slope over 48 tokens from >= 9 block pairs repeats within +-2-5% on a CPU host
TPOT_MIN_TIME_S = 2.0


def merge(base: dict, over: dict) -> dict:
  """A suite entry's config overrides on top of ``base`` (nested one level, like experiment configs)."""
  out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
  for k, v in over.items():
    if isinstance(v, dict):
      out.setdefault(k, {}).update(v)
    elif k not in ("name", "batch", "prompt_len", "gen_lens"):
      out[k] = v
  return out


def entry_cfg(entry: dict, base: dict = None) -> tuple:
  """(validated config named after the entry, device count, 'train' | 'infer') of a suite entry."""
  cfg = from_dict(merge(base or default_suite.BASE, entry))
  infer = "gen_lens" in entry
  n = 1 if infer else math.prod(cfg.mesh.sizes().values())
  cfg = validate_cfg(cfg, n)
  return cfg.__class__(**{**cfg.__dict__, "name": entry["name"]}), n, "infer" if infer else "train"


def load_suite(path=None):
  """The suite module at ``path`` (a python file with SUITE = [...]), default perfmodel/calib/suite.py."""
  if path is None:
    return default_suite
  spec = importlib.util.spec_from_file_location("perfmodel_suite", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def train_runner(cap, cfg):
  """run() -> blocks on one real training step of the captured program (state carried across calls)."""
  compiled, step = cap.compiled
  state = step.init_state(jax.random.key(0))
  rng = np.random.default_rng(0)
  d = cfg.data
  batch = step.put_batch({k: rng.integers(0, 256, (d.global_batch, d.seq_len), dtype=np.int32)
                          for k in ("inputs", "targets")})
  holder = [state]

  def run():
    holder[0], metrics = compiled(holder[0], batch)
    return jax.block_until_ready(metrics)
  return run


def measure_train(cap, cfg, reps: int) -> dict:
  # sub-millisecond steps get more repeats (up to 1 s of wall clock) so their median is not one outlier
  return bench.time_fn(train_runner(cap, cfg), reps=reps, warmup=2, min_time=1.0)


def infer_runner(cfg, batch, prompt_len, gen_len):
  """(run, cap): run() blocks on one real call of the compiled KV-cached sampler."""
  cap = program.sampler(cfg, batch, prompt_len, gen_len, keep_compiled=True)
  compiled, model = cap.compiled
  params = nn.unbox(model_lib.init_params(model, jax.random.key(0)))
  prompt = jnp.zeros((batch, prompt_len), jnp.int32)
  key = jax.random.key(0)
  return (lambda: jax.block_until_ready(compiled(params, prompt, key))), cap


def decode_loop(g, gen_len: int):
  """The sampler's decode while-loop node (trip = gen_len; the largest such body) or None."""
  loops = [n for n in g.regions[g.entry].nodes if n.kind == "loop" and n.trip_count == gen_len]
  return max(loops, key=lambda n: len(g.regions[n.body].nodes)) if loops else None


def readings(r1: dict, r2: dict, probe: dict, extra: dict) -> dict:
  """A measurement from two rounds' timings (time_fn or time_slope results) in every statistic: the median at the
  top level, the others under their name, same keys. ``measured_s`` is the mean of the two rounds, ``noise_pct``
  the larger of the within-round spread (median only) and half the drift between the rounds."""
  out = dict(extra)
  for stat in bench.STATISTICS:
    s1, s2 = bench.seconds(r1, stat=stat), bench.seconds(r2, stat=stat)
    meas = (s1 + s2) / 2
    drift = 50 * abs(s1 - s2) / meas if meas else 0.0
    noise = max(bench.spread_pct(bench.view(r1)), bench.spread_pct(bench.view(r2)), drift) if stat == "median" \
        else drift
    m = {"measured_s": meas, "noise_pct": noise, "rounds_s": [s1, s2], "probe_s": probe[stat] if probe else None}
    if stat == "median":
      out.update(m)
    else:
      out[stat] = m
  return out


def measure_train_entry(cfg, reps, probe=None):
  """Two rounds of ``reps`` steps (at least 1 s each); with a probe (perfmodel/calib/host.py), the host's speed is
  timed just before and after (``probe_s``)."""
  cap = program.train_step(cfg, keep_compiled=True)

  def rounds():
    return measure_train(cap, cfg, reps), measure_train(cap, cfg, reps)
  (r1, r2), probe_s = probe.around(rounds) if probe else (rounds(), None)
  return readings(r1, r2, probe_s, {"wall_s": (r1["median"] + r2["median"]) / 2}), cap


def measure_infer_entry(cfg, entry, reps, probe=None):
  """TPOT = slope of the sampler's time over two generation lengths, timed in alternating blocks
  (bench.time_slope), two rounds."""
  g1, g2 = entry["gen_lens"]
  run1, _ = infer_runner(cfg, entry["batch"], entry["prompt_len"], g1)
  run2, cap2 = infer_runner(cfg, entry["batch"], entry["prompt_len"], g2)

  def rounds():
    return [bench.time_slope(run1, run2, g1, g2, reps=reps, min_time=TPOT_MIN_TIME_S) for _ in range(2)]
  (r1, r2), probe_s = probe.around(rounds) if probe else (rounds(), None)
  return readings(r1, r2, probe_s, {}), cap2


def measure_entries(suite_path, names: list, reps: int, probe=None) -> dict:
  """{name: measurement} of the named entries (validation or calibration programs), measured in this process."""
  s = load_suite(suite_path)
  by_name = {e["name"]: e for e in (list(getattr(s, "CALIBRATION", [])) + list(getattr(s, "CALIBRATION_INFER", []))
                                    + s.SUITE + list(getattr(s, "INFER", [])))}
  out = {}
  for name in names:
    cfg, _, kind = entry_cfg(by_name[name], s.BASE)
    m, _ = (measure_infer_entry(cfg, by_name[name], reps, probe) if kind == "infer"
            else measure_train_entry(cfg, reps, probe))
    m["regime"] = bench.regime()
    m["devices_seen"] = jax.device_count()
    out[name] = m
  return out


def child_json(kind: str, request: dict, n_devices: int, what: str, timeout_s: float = 3600) -> dict:
  """Runs ``python -m perfmodel.calib.child KIND OUT JSON(request)`` in a fresh process with exactly ``n_devices``
  virtual CPU devices (other XLA flags, the pinned core and the environment inherited) and returns the JSON it
  wrote to OUT."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  xla_flags.set_host_device_count(n_devices, env)
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "out.json")
    p = subprocess.run([sys.executable, "-m", "perfmodel.calib.child", kind, out, json.dumps(request)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
      raise RuntimeError(f"{what} failed: {p.stderr[-2000:]}")
    with open(out) as f:
      return json.load(f)


def measure_isolated(suite_path, names: list, n_devices: int, reps: int, probe: bool) -> dict:
  """:func:`measure_entries` in a fresh child with exactly ``n_devices`` virtual CPU devices."""
  got = child_json("measure", {"suite": os.path.abspath(suite_path) if suite_path else None, "names": names,
                               "reps": reps, "probe": probe}, n_devices,
                   f"measurement child ({n_devices} devices, {names})")
  for m in got.values():
    m["host_devices"] = n_devices
  return got


def cached_capture(hlo_cache, name, compile_fn):
  """The compiled program of a config from ``hlo_cache/<name>.json`` (HLO text + memory_analysis, written by an
  earlier run with the same jax) or compile it and store it there."""
  if hlo_cache:
    path = os.path.join(hlo_cache, f"{name}.json")
    if os.path.exists(path):
      with open(path) as f:
        d = json.load(f)
      return program.Captured(hlo_text=d["hlo"], memory=d["mem"], cost_analysis=d.get("cost", {}), n_devices=d["n"],
                              lower_s=0.0, compile_s=0.0)
  cap = compile_fn()
  if hlo_cache:
    store.write_json(os.path.join(hlo_cache, f"{name}.json"),
                     {"hlo": cap.hlo_text, "n": cap.n_devices, "mem": cap.memory, "cost": cap.cost_analysis})
  return cap
