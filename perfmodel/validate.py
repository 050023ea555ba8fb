"""`python -m perfmodel validate`: run a suite on this host, measured medians vs predictions.

Per training config: compile the real step once (capture.train_step), time it (median of `reps`
calls in two interleaved rounds, so drift from other users of the machine shows up as noise),
profile its unique dots (the profiled backend), predict from the same compiled program, compare.
Per inference config: time the KV-cached sampler at two generation lengths; TPOT = slope.
Prints one line per config, then one JSON object; writes a PNG and appends a row to
benchmarks/RESULTS.md. Noise is reported beside the error, never folded into it.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import math
import statistics
import sys

import numpy as np

from framework.config import from_dict, validate as validate_cfg
from perfmodel import anchor, bench, capture, costs, fusion_profiler, hardware, predict
from perfmodel.rounds import load_rounds, normalise_rounds, pool_rounds, round_spread_by_statistic, with_statistic


def _merge(base: dict, over: dict) -> dict:
  out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
  for k, v in over.items():
    if isinstance(v, dict):
      out.setdefault(k, {}).update(v)
    elif k not in ("name", "batch", "prompt_len", "gen_lens"):
      out[k] = v
  return out


def kendall_tau(a, b) -> float:
  n, s = len(a), 0
  for i in range(n):
    for j in range(i + 1, n):
      s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
  return float(2 * s / (n * (n - 1))) if n > 1 else 1.0


def _load_suite(path):
  if path is None:
    from perfmodel import suite
    return suite
  spec = importlib.util.spec_from_file_location("perfmodel_suite", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def train_runner(cap, cfg):
  """run() -> blocks on one real training step of the captured program (state carried across calls)."""
  import jax
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


# seconds per TPOT round: a slope over 48 tokens from >= 9 block pairs repeats within +-2-5% on this host
TPOT_MIN_TIME_S = 2.0


def infer_runner(cfg, batch, prompt_len, gen_len):
  """(run, cap): run() blocks on one real call of the compiled KV-cached sampler."""
  import jax
  import jax.numpy as jnp
  from framework import model as model_lib
  cap = capture.sampler(cfg, batch, prompt_len, gen_len, keep_compiled=True)
  compiled, model = cap.compiled
  params = model_lib.init_params(model, jax.random.key(0))
  params = jax.tree.map(lambda x: x, __import__("flax").linen.unbox(params))
  prompt = jnp.zeros((batch, prompt_len), jnp.int32)
  key = jax.random.key(0)
  return (lambda: jax.block_until_ready(compiled(params, prompt, key))), cap


def decode_loop(g, gen_len: int):
  """The sampler's decode while-loop node (trip = gen_len; the largest such body) or None."""
  loops = [n for n in g.regions[g.entry].nodes if n.kind == "loop" and n.trip_count == gen_len]
  return max(loops, key=lambda n: len(g.regions[n.body].nodes)) if loops else None


def _both_statistics(r1: dict, r2: dict, probe: dict, extra: dict) -> dict:
  """A measurement from two rounds' timings (time_fn or time_slope results), read as the median (top level, as
  every stored set before session 28) and as the p10 statistic (under ``"p10"``, same keys): ``measured_s`` is
  the mean of the two rounds, ``noise_pct`` the larger of the within-round spread (median only) and half the
  drift between the rounds. rounds.with_statistic picks one."""
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


def _measure_train_entry(cfg, reps, probe=None):
  """Two rounds of ``reps`` steps (at least 1 s each); with a speed.Probe, the probe is timed just before and
  after (``probe_s``). Recorded in both statistics (:func:`_both_statistics`)."""
  cap = capture.train_step(cfg, keep_compiled=True)

  def rounds():
    return measure_train(cap, cfg, reps), measure_train(cap, cfg, reps)
  (r1, r2), probe_s = probe.around(rounds) if probe else (rounds(), None)
  return _both_statistics(r1, r2, probe_s, {"wall_s": (r1["median"] + r2["median"]) / 2}), cap


def _measure_infer_entry(cfg, entry, reps, probe=None):
  """TPOT = slope of the sampler's time over two generation lengths, timed in alternating blocks
  (bench.time_slope), two rounds, recorded in both statistics (:func:`_both_statistics`)."""
  g1, g2 = entry["gen_lens"]
  run1, _ = infer_runner(cfg, entry["batch"], entry["prompt_len"], g1)
  run2, cap2 = infer_runner(cfg, entry["batch"], entry["prompt_len"], g2)

  def rounds():
    return [bench.time_slope(run1, run2, g1, g2, reps=reps, min_time=TPOT_MIN_TIME_S) for _ in range(2)]
  (r1, r2), probe_s = probe.around(rounds) if probe else (rounds(), None)
  return _both_statistics(r1, r2, probe_s, {}), cap2


def _entry_cfg(suite, entry):
  """(config, n_devices, kind) of a suite entry, as `run` builds them."""
  if "gen_lens" in entry:
    return validate_cfg(from_dict(_merge(suite.BASE, entry)), 1), 1, "infer"
  cfg = from_dict(_merge(suite.BASE, entry))
  n = math.prod(cfg.mesh.sizes().values())
  cfg = validate_cfg(cfg, n)
  return cfg.__class__(**{**cfg.__dict__, "name": entry["name"]}), n, "train"


def measure_entries(suite_path, names: list, reps: int, probe: bool) -> dict:
  """Measures the named suite entries in this process: {name: measurement} (the child's side of
  :func:`measure_isolated`)."""
  import jax  # noqa: PLC0415
  from perfmodel import speed  # noqa: PLC0415
  suite = _load_suite(suite_path)
  by_name = {e["name"]: e for e in (list(getattr(suite, "CALIBRATION", []))
                                    + list(getattr(suite, "CALIBRATION_INFER", []))
                                    + suite.SUITE + list(getattr(suite, "INFER", [])))}
  prober = speed.Probe() if probe else None
  out = {}
  for name in names:
    cfg, _, kind = _entry_cfg(suite, by_name[name])
    m, _ = (_measure_infer_entry(cfg, by_name[name], reps, prober) if kind == "infer"
            else _measure_train_entry(cfg, reps, prober))
    m["regime"] = bench.regime()
    m["devices_seen"] = jax.device_count()
    out[name] = m
  return out


def child_json(module: str, flag: str, request: dict, n_devices: int, what: str, timeout_s: float = 3600) -> dict:
  """Runs ``python -m MODULE FLAG OUT JSON(request)`` in a fresh process with exactly ``n_devices`` virtual CPU
  devices (other XLA flags, the pinned core and the environment inherited) and returns the JSON it wrote to OUT."""
  import subprocess  # noqa: PLC0415
  import tempfile  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_devices}"])
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "out.json")
    p = subprocess.run([sys.executable, "-m", module, flag, out, json.dumps(request)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
      raise RuntimeError(f"{what} failed: {p.stderr[-2000:]}")
    with open(out) as f:
      return json.load(f)


def measure_isolated(suite_path, names: list, n_devices: int, reps: int, probe: bool,
                     module: str = "perfmodel.validate") -> dict:
  """Measures suite entries in a fresh child process with exactly ``n_devices`` virtual CPU devices, as
  `python -m experiments.run` gives a config with that mesh size (inherits this process's pinned core, XLA flags
  and environment; ``module`` runs its own ``--measure-child``).

  Why: idle virtual devices are not free. With 8 host devices a one-device step's thunks hop between 8 XLA
  worker threads: tiny_latency, base and deep8_narrow took 1.23-1.45x their one-device-process time."""
  got = child_json(module, "--measure-child", {"suite": os.path.abspath(suite_path) if suite_path else None,
                                                "names": names, "reps": reps, "probe": probe},
                   n_devices, f"measurement child ({n_devices} devices, {names})")
  for m in got.values():
    m["host_devices"] = n_devices
  return got


def _child_main(argv) -> int:
  """``python -m perfmodel.validate --measure-child OUT JSON``: the child of :func:`measure_isolated`."""
  from framework import host_memory  # noqa: PLC0415
  host_memory.apply()  # as the real job does, before jax starts
  req = json.loads(argv[1])
  got = measure_entries(req["suite"], req["names"], req["reps"], req["probe"])
  with open(argv[0], "w") as f:
    json.dump(got, f)
  return 0


def _clock(cache: dict, pinned_now: bool) -> str:
  """The clock of the measurements: CPU time iff every one was taken pinned (cached ones carry their regime)."""
  regimes = [m.get("regime", {}) for m in cache.values()]
  if regimes and all(r.get("pinned_core") is not None for r in regimes):
    return "cpu"
  return "cpu" if pinned_now and not regimes else "wall"


def _cached_capture(hlo_cache, name, compile_fn):
  """The compiled program of a config from ``hlo_cache/<name>.json`` (HLO text + memory_analysis, written by
  an earlier run with the same jax) or compile it and store it there."""
  if hlo_cache:
    path = os.path.join(hlo_cache, f"{name}.json")
    if os.path.exists(path):
      with open(path) as f:
        d = json.load(f)
      return capture.Captured(hlo_text=d["hlo"], memory=d["mem"], cost_analysis=d.get("cost", {}), n_devices=d["n"],
                              lower_s=0.0, compile_s=0.0)
  cap = compile_fn()
  if hlo_cache:
    os.makedirs(hlo_cache, exist_ok=True)
    with open(os.path.join(hlo_cache, f"{name}.json"), "w") as f:
      json.dump({"hlo": cap.hlo_text, "n": cap.n_devices, "mem": cap.memory, "cost": cap.cost_analysis}, f)
  return cap


def run(suite_path=None, reps: int = 7, backend: str = "auto", png: str = None, results: bool = True,
        limit: int = 0, hardware_name: str = "cpu", measurements=None, hlo_cache: str = None,
        probe: bool = True, isolate: bool = True, rounds: int = 1, anchors: bool = True) -> dict:
  """isolate: measure in child processes, one per device count, each with exactly that many virtual devices
  (measure_isolated); False measures in this process (with its device count).

  measurements: a JSON file of measured step times by config name (one round) or ``{"rounds": [...]}``, or a
  list of such files (their rounds pooled; only a single file is written to). Entries found there are not re-run
  (predictions are recomputed from a fresh compile); new measurements are added to it. Lets the slow
  measuring and a recalibration proceed separately on a loaded host.

  rounds: measure the whole suite this many times, one round after the other (when nothing is stored). Each
  config's measurement is the median over rounds, each round normalised to the calibration's speed with its own
  probes. Why: on this host one config measured twice 30 minutes apart, each at the calibration's speed, moved
  by up to 21% (session 8, deep8_narrow); repeating the suite is the only way to see past that drift.

  probe: time perfmodel.speed's probe around every measurement; the headline errors compare with the raw
  measurements, and ``mape_speed_normalised`` also reports them at the calibration's host speed.

  anchors: also measure ``suite.ANCHORS`` (calibration programs) in every round, interleaved with the one-device
  entries, and report ``mape_anchored`` / ``tpot_mape_anchored``: the errors after the round's predictions are
  scaled by how fast the host ran the anchors against the calibration's own step times (perfmodel/anchor.py)."""
  from perfmodel import speed
  hw = hardware.load(hardware_name)
  ref = hw.calibration.get("speed_probe_ref_s") if hw.name == "cpu" else None
  resolved = costs.resolve_backend(hw, backend)  # auto may mean the profiled backend (costs.resolve_backend)
  stale = fusion_profiler.stale_before(hw)  # entries timed before the calibration are timed again
  suite = _load_suite(suite_path)
  files = [measurements] if isinstance(measurements, str) else list(measurements or [])
  stored = [f for f in files if os.path.exists(f)]
  taken = ", ".join(datetime.datetime.fromtimestamp(os.path.getmtime(f)).isoformat(timespec="minutes")
                    for f in stored)
  caches = [c for f in stored for c in load_rounds(f)] or [{} for _ in range(max(1, rounds))]
  writable = files[0] if len(files) == 1 else None

  def save():
    if writable:
      with open(writable, "w") as f:
        json.dump(caches[0] if len(caches) == 1 else {"rounds": caches}, f, indent=1)
  entries = suite.SUITE[:limit] if limit else suite.SUITE
  anchor_refs = anchor.references(suite, hw) if anchors and not limit else {}
  decode_refs = anchor.references(suite, hw, "decode") if anchors and not limit else {}
  # training and decode anchors alternate, then spread through the one-device child's list
  t_, d_ = list(anchor_refs), list(decode_refs)
  anchor_names = [x for pair in zip(t_, d_) for x in pair] + t_[len(d_):] + d_[len(t_):]
  infer_entries = list(getattr(suite, "INFER", [])) if not limit else []
  for ri, cache in enumerate(caches):
    if isolate:  # each entry measured in a child with exactly its own device count (see measure_isolated)
      groups = {}
      for entry in entries + infer_entries:
        if entry["name"] not in cache:
          groups.setdefault(_entry_cfg(suite, entry)[1], []).append(entry["name"])
      if anchor_names and groups.get(1) and not any(a in cache for a in anchor_names):
        groups[1] = anchor.interleave(groups[1], anchor_names)
      for n_dev, names in sorted(groups.items()):
        print(f"round {ri + 1}/{len(caches)}: measuring {names} in a child process with {n_dev} host device(s)",
              file=sys.stderr, flush=True)
        cache.update(measure_isolated(suite_path, names, n_dev, reps, probe))
        save()
    else:
      missing = [e["name"] for e in entries + infer_entries if e["name"] not in cache]
      if missing:
        cache.update(measure_entries(suite_path, missing, reps, probe))
        save()
  # every measurement is read in the statistic the profile's composition was fitted on (bench.STATISTICS)
  stat = hw.calibration.get("step_statistic", "median") if hw.name == "cpu" else "median"
  spread_by_stat = round_spread_by_statistic(caches, [e["name"] for e in entries], [e["name"] for e in infer_entries])
  caches = [{n: with_statistic(m, stat) for n, m in c.items()} for c in caches]
  rows = []
  for entry in entries:
    cfg = from_dict(_merge(suite.BASE, entry))
    n = math.prod(cfg.mesh.sizes().values())
    cfg = validate_cfg(cfg, n)
    cfg = cfg.__class__(**{**cfg.__dict__, "name": entry["name"]})
    m = pool_rounds([c[entry["name"]] for c in caches])
    cap = _cached_capture(hlo_cache, entry["name"], lambda: capture.train_step(cfg))
    if resolved in costs.NEEDS_PROFILED_PROGRAM:
      fusion_profiler.profile_program(cap.hlo_text, cap.n_devices, hw.name, stale_before=stale)
    pred = predict.predict_train(cfg, hw, backend, captured=cap)
    raw, noise, wall = m["measured_s"], m["noise_pct"], m["wall_s"]
    meas = raw
    err = 100 * (pred["step_time_s"] - meas) / meas
    rows.append(dict(name=entry["name"], kind="train", measured_s=meas, predicted_s=pred["step_time_s"], err_pct=err,
                     probe_s=m.get("probe_s"), host_devices=m.get("host_devices"), rounds=m["rounds"],
                     round_spread_pct=m["round_spread_pct"],
                     noise_pct=noise, n_devices=n, predict_s=pred["predict_s"], wall_s=wall,
                     mem_pred=pred["peak_memory_bytes"], mem_xla=cap.memory["peak_bytes"],
                     mem_analytic=pred["memory_analytic"]["total"], priced_by=pred["breakdown"]["priced_by"]))
    print(f"{entry['name']:>16}  measured {meas * 1e3:9.2f} ms  predicted {pred['step_time_s'] * 1e3:9.2f} ms  "
          f"err {err:+6.1f}%  noise ±{noise:4.1f}%  ({n} dev)",
          file=sys.stderr, flush=True)
  inf_rows = []
  for entry in infer_entries:
    cfg = validate_cfg(from_dict(_merge(suite.BASE, entry)), 1)
    g1, g2 = entry["gen_lens"]
    m = pool_rounds([c[entry["name"]] for c in caches])
    cap2 = _cached_capture(hlo_cache, entry["name"],
                           lambda: capture.sampler(cfg, entry["batch"], entry["prompt_len"], g2))
    if resolved in costs.NEEDS_PROFILED_PROGRAM:
      fusion_profiler.profile_program(cap2.hlo_text, 1, hw.name, stale_before=stale)
    tpot_meas = m["measured_s"]
    pred = predict.predict_infer(cfg, hw, entry["batch"], entry["prompt_len"], g2, backend, captured=cap2)
    err = 100 * (pred["tpot_s"] - tpot_meas) / tpot_meas if tpot_meas > 0 else float("nan")
    noise = m["noise_pct"]
    inf_rows.append(dict(name=entry["name"], kind="infer", measured_s=tpot_meas, predicted_s=pred["tpot_s"],
                         err_pct=err, probe_s=m.get("probe_s"), host_devices=m.get("host_devices"),
                         noise_pct=noise, rounds=m["rounds"], round_spread_pct=m["round_spread_pct"]))
    print(f"{entry['name']:>16}  TPOT measured {tpot_meas * 1e3:8.3f} ms  predicted {pred['tpot_s'] * 1e3:8.3f} ms  "
          f"err {err:+6.1f}%  noise ±{noise:4.1f}%", file=sys.stderr, flush=True)
  meas = [r["measured_s"] for r in rows]
  prd = [r["predicted_s"] for r in rows]
  mape = float(np.mean([abs(r["err_pct"]) for r in rows]))
  tps_m = [1 / m for m in meas]
  best_pred = int(np.argmin(prd))
  regret = 100 * (1 - tps_m[best_pred] / max(tps_m))
  mem_err = float(np.max([abs(r["mem_pred"] - r["mem_xla"]) / r["mem_xla"] * 100 for r in rows]))
  mem_ana = float(np.mean([abs(r["mem_analytic"] - r["mem_xla"]) / r["mem_xla"] * 100 for r in rows]))
  normalised = normalise_rounds(rows + inf_rows, ref, hw.calibration.get("speed_probe_ref_by_devices")
                                 if hw.name == "cpu" else None)
  probes = [m["probe_s"] for r in rows + inf_rows for m in r["rounds"] if m.get("probe_s")]
  anchored = anchor.normalise(rows + inf_rows, caches, anchor_refs)
  # decode rows once more, each round divided by its decode anchors' factor (the sampler programs' speed)
  decode_anchored = anchor.normalise(inf_rows, caches, decode_refs, key="decode_anchored") if inf_rows else None
  if anchored and decode_anchored:
    anchored["decode"] = decode_anchored
  probe_anchored = (anchor.probe_then_normalise(rows + inf_rows, caches, anchor_refs, ref,
                                            hw.calibration.get("speed_probe_ref_by_devices"))
                    if anchored and normalised else None)
  if probe_anchored:
    anchored["probe_then_anchor_factor_by_round"] = probe_anchored
  out = {"mape": mape, "kendall_tau": kendall_tau(meas, prd), "n_configs": len(rows), "rounds": len(caches),
         "statistic": stat,
         "round_spread_pct": (float(np.median([r["round_spread_pct"] for r in rows])) if len(caches) > 1 else None),
         "round_spread_pct_by_statistic": spread_by_stat,
         "mape_speed_normalised": (float(np.mean([abs(r["err_at_ref_pct"]) for r in rows]))
                                   if normalised else None),
         "tpot_mape_speed_normalised": (float(np.mean([abs(r["err_at_ref_pct"]) for r in inf_rows]))
                                        if normalised and inf_rows else None),
         "host_speed": ({"probe": speed.PROBE_NAME, "reference_s": ref, "probe_median_s": statistics.median(probes),
                         "probe_range_s": [min(probes), max(probes)],
                         "speed_vs_calibration": ref / statistics.median(probes)} if normalised else
                        "not normalised: measurements without probe times or a profile without speed_probe_ref_s"),
         "mape_anchored": (float(np.mean([abs(r["err_anchored_pct"]) for r in rows])) if anchored else None),
         "tpot_mape_anchored": (float(np.mean([abs(r["err_anchored_pct"]) for r in inf_rows]))
                                if anchored and inf_rows else None),
         "tpot_mape_decode_anchored": (float(np.mean([abs(r["err_decode_anchored_pct"]) for r in inf_rows]))
                                       if decode_anchored else None),
         "mape_probe_anchored": (float(np.mean([abs(r["err_probe_anchored_pct"]) for r in rows]))
                                 if probe_anchored else None),
         "tpot_mape_probe_anchored": (float(np.mean([abs(r["err_probe_anchored_pct"]) for r in inf_rows]))
                                      if probe_anchored and inf_rows else None),
         "anchors": anchored or "not anchored: no anchor measurements in these rounds (older sets, --no-anchors)",
         "noise_pct": float(np.median([r["noise_pct"] for r in rows])),
         "top1_regret_pct": regret, "signed_err_pct": {r["name"]: round(r["err_pct"], 2) for r in rows},
         "tpot_mape": float(np.mean([abs(r["err_pct"]) for r in inf_rows])) if inf_rows else None,
         "tpot_n_configs": len(inf_rows),
         "tpot_noise_pct": float(np.median([r["noise_pct"] for r in inf_rows])) if inf_rows else None,
         "peak_memory_max_err_pct_vs_memory_analysis": mem_err,
         "peak_memory_analytic_mape_vs_memory_analysis": mem_ana,
         "clock": _clock(cache, bench.pinned()), "regime": bench.regime(),
         "calibration_loo_mape": hw.calibration.get("calibration_loo_mape"),
         "predict_s_max": float(max(r["predict_s"] for r in rows)),
         "hardware": hw.name, "calibrated": hw.calibrated, "backend": backend,
         "backend_resolved": resolved,
         "load_avg": os.getloadavg()[0], "rows": rows + inf_rows}
  if png:
    _plot(rows + inf_rows, png)
    out["png"] = png
  if results:
    # a row predicted on stored measurements says so (and which), so it is not read as a fresh measurement
    tail = f" --rounds {len(caches)}" if len(caches) > 1 and not stored else ""
    tail = (f" --backend {backend}" if backend != "auto" else "") + tail
    _append_results(out, tail + (f" --measurements {' '.join(stored)} (stored, written {taken})" if stored else ""))
  return out


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 5))
  for kind, mk in (("train", "o"), ("infer", "^")):
    rr = [r for r in rows if r["kind"] == kind]
    if not rr:
      continue
    ax.errorbar([r["measured_s"] * 1e3 for r in rr], [r["predicted_s"] * 1e3 for r in rr],
                xerr=[r["measured_s"] * 1e3 * r["noise_pct"] / 100 for r in rr], fmt=mk, label=kind, capsize=2)
  lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
  hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
  ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
  ax.set_xscale("log"), ax.set_yscale("log")
  ax.set_xlabel("measured (ms)"), ax.set_ylabel("predicted (ms)")
  ax.set_title("perfmodel: predicted vs measured (this CPU)")
  ax.legend()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def _append_results(out, command_tail: str = ""):
  path = os.path.join("benchmarks", "RESULTS.md")
  if not os.path.exists(path):
    os.makedirs("benchmarks", exist_ok=True)
    with open(path, "w") as f:
      f.write("# Benchmark results\n\n| date | command | machine | numbers |\n|---|---|---|---|\n")
  nums = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()
          if k in ("mape", "kendall_tau", "n_configs", "rounds", "statistic", "round_spread_pct", "noise_pct",
                   "top1_regret_pct",
                   "tpot_mape", "tpot_noise_pct",
                   "peak_memory_max_err_pct_vs_memory_analysis", "load_avg", "clock", "calibration_loo_mape",
                   "mape_speed_normalised", "tpot_mape_speed_normalised", "mape_anchored", "tpot_mape_anchored",
                   "tpot_mape_decode_anchored",
                   "mape_probe_anchored", "tpot_mape_probe_anchored")}
  if isinstance(out.get("host_speed"), dict):
    nums["speed_vs_calibration"] = round(out["host_speed"]["speed_vs_calibration"], 3)
  with open(path, "a") as f:
    f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | python -m perfmodel validate{command_tail} | "
            f"{platform.node()} {os.cpu_count()} cores (shared) | {json.dumps(nums)} |\n")


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--measure-child":
    sys.exit(_child_main(sys.argv[2:]))
  sys.exit("run via `python -m perfmodel validate`")
