"""Calibration of the learned backend and of step composition from real calibration programs.

For every entry of ``perfmodel.suite.CALIBRATION`` (training steps whose shapes differ from the validation
suite): compile the real step, measure its step time in the regime's clock (pinned: process CPU time), and
time every instruction inside the program with XLA's TraceMe (perfmodel/trace_nodes.py). Outputs:

* ``profiles/db/<profile>-nodes-jax<ver>.json``: one sample per (program, node): class, log features,
  in-program time, and the calibrated-curve ("physical") estimate the learned backend scales by;
* ``composition`` coefficients in the profile: how per-node times compose into a step on this host,
    step = a * sum(node times) * N + b * node executions * N + c * N + e * collective bytes * N
           + f * collective executions * N
  (N virtual devices run their copy of the per-device program on the one pinned core; b is the executor's
  per-thunk gap, c the per-device fixed cost of a step, e and f the in-process collectives), fitted by
  non-negative least squares on node times *predicted leave-one-program-out*, so interpolation error of the
  learned backend is part of what the fit sees;
* a leave-one-program-out cross-validated error of the whole chain over the calibration programs.
"""
from __future__ import annotations

import math
import statistics
import sys

import numpy as np

from framework import host_memory
from framework.config import from_dict, validate as validate_cfg
from perfmodel import bench, capture, costs, graph as graph_lib, learned, suite, trace_nodes


def _cfg(entry: dict, base: dict = None):
  from perfmodel.validate import _merge
  cfg = from_dict(_merge(base or suite.BASE, entry))
  cfg = validate_cfg(cfg, math.prod(cfg.mesh.sizes().values()))
  return cfg.__class__(**{**cfg.__dict__, "name": entry["name"]})


# XLA:CPU combines a program's temporaries into one buffer per execution, allocated with malloc. With glibc's
# default settings, blocks above its largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB on 64-bit)
# come from a fresh mmap and are unmapped on free, so such a step page-faults its whole temp buffer every time:
# measured here, minor faults per step = temp bytes / 4096 above 32 MiB and ~0 below, 0.4-0.5 ms of system time
# per MiB (perfmodel/JOURNAL.md, "fresh temp"). Node traces do not see it as a node of its own. The project's processes
# switch this off (framework/host_memory.py); the fresh-temp term (g) prices it for profiles calibrated without.
FRESH_ALLOC_THRESHOLD = 32 * 2 ** 20


def allocator_keeps(hw) -> bool:
  """Whether ``hw``'s step times were calibrated with malloc keeping freed blocks (no per-step page faults)."""
  regime = (getattr(hw, "calibration", None) or {}).get("regime") or {}
  return regime.get("host_malloc") == "keep_freed"


def fresh_bytes(temp_bytes: float, n_devices: int, keeps: bool = False) -> float:
  """Bytes a step page-faults afresh: each device's temp buffer when it is above the mmap threshold, none
  when malloc keeps freed blocks (``keeps``)."""
  return float(temp_bytes) * n_devices if temp_bytes > FRESH_ALLOC_THRESHOLD and not keeps else 0.0


def composition_features(g: graph_lib.ExecGraph, price, n_devices: int, region: str = None,
                         temp_bytes: float = 0.0, hw=None, keeps: bool = None, pow2: bool = False) -> list:
  """Features of a step, in COEF_NAMES order:
  a: sum of node prices x N devices      b: node executions x N      c: N (per-step constant)
  e: collectives - with ``hw``, their modelled seconds (the profile's curves, x groups); else bytes x N
  f: collective executions x N          g: fresh temp bytes (fresh_bytes; ``keeps`` None: as ``hw`` was calibrated)
  h: bytes the priced nodes move x N (decode steps stream the weights and the KV cache; :func:`compose` splits
     it at the type's knee into h and i)
  p: a again when the step's tokens per device are a power of two (``pow2``, :func:`pow2_tokens`), else 0."""
  from perfmodel import collectives  # noqa: PLC0415
  keeps = allocator_keeps(hw) if keeps is None else keeps
  t, execs, cb, ce, nb = 0.0, 0, 0.0, 0, 0.0
  for n, k in g.walk(region):
    if n.collective is not None:
      if hw is not None:
        cb += collectives.node_cost(n.collective, hw).seconds * max(1, n.collective.n_groups) * k
      else:
        cb += n.collective.bytes * k * n_devices
      ce += k
    elif n.kind in ("dot", "fusion", "other"):
      t += price(n) * k
      nb += n.bytes * k
      execs += k
  return [t * n_devices, execs * n_devices, n_devices, cb, ce * n_devices,
          0.0 if region else fresh_bytes(temp_bytes, n_devices, keeps), nb * n_devices, 0.0,
          t * n_devices if pow2 else 0.0]


def pow2_tokens(cfg) -> bool:
  """Whether a training step's tokens per device (global batch x sequence / data-parallel ways) are a power of
  two. XLA:CPU is shape-specific: in the calibration's power-of-two programs the same node classes ran
  1.2-1.65x their physical estimate against the other programs (perfmodel/JOURNAL.md, "Power-of-two shapes"), which the
  learned backend's neighbours, mostly from other programs, do not carry; the composition's p term
  (train type) lets the fit learn that scale from those programs."""
  ways = max(1, cfg.mesh.data * cfg.mesh.fsdp)
  tokens, rem = divmod(cfg.data.global_batch * cfg.data.seq_len, ways)
  return rem == 0 and tokens > 0 and tokens & (tokens - 1) == 0


# Program types compose differently on this host (measured, see perfmodel/JOURNAL.md): a single-device training step,
# N virtual devices time-sharing the pinned core (their threads interleave at every collective), and a decode
# step inside the sampler's while loop (hot caches, tiny thunks). Each type has its own coefficients; which
# features a type may use is fixed here (few calibration programs per type: keep the forms small).
LEARNED_K = (4, 8, 16)  # neighbour counts tried by calibration
# working-set exponents tried (learned.py): 0 = none; measured offline on session 7's node samples, leave one
# program out, the spread of training programs' node sums fell from 9.5% to 5.1-5.4% at 0.15. Session 8's
# calibration chose 0.2, the grid's edge; offline on its data 0.25 and 0.3 are worse (LOO 15.7%, 16.2% against
# 13.9% at k=16), so the grid now brackets the optimum.
LEARNED_BETA = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3)
TYPE_FEATURES = {"train": (0, 1, 2, 5, 8), "multi": (0, 3, 5), "decode": (0, 1, 6, 7)}
# Features whose coefficient may be negative (all others are non-negative). A decode step's thunks are tiny
# (0.1-3 us), and each traced sample carries the TraceMe's own cost, so the node sum of a decode loop body
# overstates its work by a fixed amount per thunk: the fit takes it back with a negative per-thunk term. Measured
# (session 10, refit of the 01:01 calibration): the decode programs' leave-one-out went from 18.7% to 9.7%, the
# fitted b is -0.4 us per thunk; the training type, offered the same signed term, got worse (5.9% -> 6.5%), so
# only decode has it.
SIGNED = {"decode": (1,)}
# Features a type keeps only where they lower its own leave-one-out error (chosen inside every fit, so a
# leave-one-program-out error of the whole fit includes the choice). The power-of-two term p (session 16): on the
# 22:23 calibration it took the learned backend's training programs from 10.4% to 8.6% (its five power-of-two
# programs from -9.5..-19.1% to -7.9..+5.5%, p = 0.18) and did nothing for the profiled prices (p = 0), which
# already carry the shape (perfmodel/JOURNAL.md, "Power-of-two steps in the composition").
OPTIONAL = {"train": (8,)}
# Coefficients a type takes from another when none of its own calibration programs can fit them. The power-of-two
# term p belongs to the nodes' shapes (XLA:CPU's kernels at power-of-two extents), not to the device count, but the
# calibration's multi-device programs are none of them power-of-two steps, so the multi type could never learn
# it: a multi-device step whose tokens per device are a power of two (all four of the validation suite's) took no
# uplift at all. Measured (session 20, perfmodel/JOURNAL.md) by re-pricing stored sets: see there.
BORROWED = {"multi": ("train", (8,))}
COEF_NAMES = ("a", "b", "c", "e", "f", "g", "h", "i", "p")
# A decode step streams its weights and KV cache. Measured with long generations (8 vs 56 tokens, ±2%): its time
# per byte grows with the bytes it moves, 26 ps/B at 1.7 MB to 47 ps/B at 40+ MB, as the step falls out of the
# core's cache. So decode prices bytes piecewise: h per byte up to a knee, i per byte beyond it. The knee is
# picked from this grid by the decode programs' own leave-one-program-out error (never by validation).
KNEES = tuple(float(k) * 2 ** 20 for k in (1, 2, 3, 4, 6, 8, 12, 16))


def program_type(n_devices: int, decode: bool = False) -> str:
  return "decode" if decode else ("multi" if n_devices > 1 else "train")


def split_bytes(feats: list, knee) -> list:
  """Features with the bytes feature h split at ``knee``: h = bytes up to it, i = bytes beyond (none: i = 0)."""
  f = list(feats) + [0.0] * (len(COEF_NAMES) - len(feats))
  if knee:
    f[6], f[7] = min(f[6], knee), max(0.0, f[6] - knee)
  return f


def compose(coef: dict, feats: list, ptype: str = None) -> float:
  if ptype is not None and ptype in coef:
    coef = coef[ptype]
  elif "train" in coef:  # typed coefficients but no type given: a single-device step
    coef = coef["train"]
  return sum(coef.get(k, 0.0) * v for k, v in zip(COEF_NAMES, split_bytes(feats, coef.get("knee"))))


def _fit_cols(rows, y, cols, knee=None, signed=()) -> dict:
  """Least squares over ``cols``, non-negative except the ``signed`` columns (fitted as a positive and a negated
  copy whose coefficients are subtracted)."""
  neg = [c for c in cols if c in signed]
  split = [split_bytes(r, knee) for r in rows]
  x = _nnls([[f[c] for c in cols] + [-f[c] for c in neg] for f in split], y)
  full = [0.0] * len(COEF_NAMES)
  for c, v in zip(cols, x):
    full[c] = float(v)
  for c, v in zip(neg, x[len(cols):]):
    full[c] -= float(v)
  out = _coef(full)
  if knee:
    out["knee"] = knee
  return out


def _pick_knee(rows, y, cols, signed=()):
  """The knee with the lowest leave-one-out error over these rows (all knees tie below 3 rows)."""
  if len(rows) < 3:
    return KNEES[len(KNEES) // 2]
  best = None
  for knee in KNEES:
    errs = []
    for i in range(len(rows)):
      c = _fit_cols(rows[:i] + rows[i + 1:], y[:i] + y[i + 1:], cols, knee, signed)
      errs.append(abs(compose(c, rows[i]) / y[i] - 1))
    if best is None or np.mean(errs) < best[0]:
      best = (float(np.mean(errs)), knee)
  return best[1]


def _pick_optional(rows, y, cols, optional, knee=None, signed=()) -> tuple:
  """``cols`` with or without its ``optional`` features, whichever has the lower leave-one-out error over these
  rows (a tie, too few rows, or an all-zero optional column: without)."""
  opt = tuple(c for c in optional if c in cols)
  base = tuple(c for c in cols if c not in opt)
  if not opt or len(rows) < 4 or not any(split_bytes(r, knee)[c] for r in rows for c in opt):
    return base

  def err(cs):
    return np.mean([abs(compose(_fit_cols(rows[:i] + rows[i + 1:], y[:i] + y[i + 1:], cs, knee, signed), rows[i])
                        / y[i] - 1) for i in range(len(rows))])
  return cols if err(cols) < err(base) else base


def fit_typed(rows: list, y: list, types: list) -> dict:
  """Per-type NNLS over the type's allowed features; a type without rows falls back to 'train'. A type
  using the split bytes feature (i) also gets its knee, and a type with ``OPTIONAL`` features keeps or drops
  them, both chosen by leave-one-out over its own rows."""
  out = {}
  for t, cols in TYPE_FEATURES.items():
    idx = [i for i, tt in enumerate(types) if tt == t]
    if not idx:
      continue
    sub, ys = [rows[i] for i in idx], [y[i] for i in idx]
    signed = SIGNED.get(t, ())
    knee = _pick_knee(sub, ys, cols, signed) if 7 in cols else None
    cols = _pick_optional(sub, ys, cols, OPTIONAL.get(t, ()), knee, signed)
    out[t] = _fit_cols(sub, ys, cols, knee, signed)
  for t in TYPE_FEATURES:
    out.setdefault(t, out.get("train", _coef([1.0, 0, 0, 0, 0])))
  for t, (src, cols) in BORROWED.items():  # only where the type's own rows leave the column empty
    own = [rows[i] for i, tt in enumerate(types) if tt == t]
    for c in cols:
      if not any(c < len(r) and r[c] for r in own):  # every type is in ``out`` by now
        out[t] = {**out[t], COEF_NAMES[c]: out[src].get(COEF_NAMES[c], 0.0)}
  return out


def loo_typed(rows: list, y: list, types: list, names: list, noise: list) -> list:
  cv = []
  for i in range(len(rows)):
    keep = [j for j in range(len(rows)) if j != i]
    ci = fit_typed([rows[j] for j in keep], [y[j] for j in keep], [types[j] for j in keep])
    p = compose(ci, rows[i], types[i])
    cv.append({"name": names[i], "type": types[i], "measured_s": y[i], "predicted_s": p,
               "err_pct": 100 * (p - y[i]) / y[i], "noise_pct": noise[i]})
  return cv


def _nnls(rows, y):
  from scipy.optimize import nnls
  A = np.array(rows, dtype=float)
  y = np.array(y, dtype=float)
  # relative error matters (steps span 1 ms .. 1 s): weight rows by 1/y
  w = 1.0 / y
  scale = np.maximum(np.abs(A * w[:, None]).max(axis=0), 1e-30)
  x, _ = nnls(A * w[:, None] / scale, np.ones_like(y))
  return x / scale


def _coef(x) -> dict:
  return dict(zip(COEF_NAMES, (float(v) for v in x)))


def _infer_program(entry, hw, phys, samples, reps, trace_reps, log, given_samples: list = None) -> dict:
  """A calibration decode program: TPOT = slope of two generation lengths; nodes traced at the longer one
  (here, or in a child: ``given_samples``; then the TPOT, too, comes from the child's measure_steps)."""
  from perfmodel.validate import TPOT_MIN_TIME_S, decode_loop, infer_runner
  cfg = validate_cfg(_cfg_infer(entry), 1)
  g1, g2 = entry["gen_lens"]
  if given_samples is not None:
    g = graph_lib.from_hlo_text(capture.sampler(cfg, entry["batch"], entry["prompt_len"], g2).hlo_text, 1)
    new, tpot, noise = given_samples, float("nan"), float("nan")
  else:
    g, new = _trace_decode(entry, cfg, phys, trace_reps)
    run1, _ = infer_runner(cfg, entry["batch"], entry["prompt_len"], g1)
    run2, _ = infer_runner(cfg, entry["batch"], entry["prompt_len"], g2)
    r = bench.time_slope(run1, run2, g1, g2, reps=reps, min_time=TPOT_MIN_TIME_S)
    tpot, noise = bench.seconds(r), bench.spread_pct(bench.view(r))
    log(f"calibrate {entry['name']:>18}: {len(new)} nodes traced, TPOT {tpot * 1e3:.3f} ms (±{noise:.1f}%)")
  samples.extend(new)
  loop = decode_loop(g, g2)
  graph_lib.mark_decode(g, loop.body if loop else None)
  return {"name": entry["name"], "graph": g, "n": 1, "measured": tpot, "noise": noise,
          "region": loop.body if loop else None}


def _trace_train(cfg, cap, hw, phys, trace_reps) -> tuple:
  """(graph, node samples) of a compiled training step. Node samples come from single-device programs only:
  with N virtual devices on one core, a sibling device's thread preempts a thunk mid-flight and its TraceMe
  wall time overstates the work."""
  from perfmodel.validate import train_runner  # noqa: PLC0415
  g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
  _resolve_branches(g, cfg, hw)
  if cap.n_devices != 1:
    return g, []
  run_fn = train_runner(cap, cfg)
  for _ in range(2):
    run_fn()
  traced = trace_nodes.traced_times(run_fn, reps=trace_reps, names={n.name for n, _ in g.walk()})
  return g, _node_samples(g, traced, cfg.name, phys)


def _trace_decode(entry, cfg, phys, trace_reps) -> tuple:
  from perfmodel.validate import infer_runner  # noqa: PLC0415
  run2, cap = infer_runner(cfg, entry["batch"], entry["prompt_len"], entry["gen_lens"][1])
  g = graph_lib.from_hlo_text(cap.hlo_text, 1)
  traced = trace_nodes.traced_times(run2, reps=trace_reps, names={n.name for n, _ in g.walk()})
  return g, _node_samples(g, traced, entry["name"], phys, sampler=True)


def trace_programs(prof_path: str, trace_reps: int = 3) -> dict:
  """{program: node samples} of every one-device calibration program (training and decode), traced in this
  process: the child ``python -m perfmodel.calibrate_nodes --trace-child OUT JSON``, run with exactly one
  virtual device as experiments.run runs a one-device config (with 8, the thunks hop between 8 XLA worker
  threads and a one-device step costs 1.23-1.45x more)."""
  from perfmodel import hardware  # noqa: PLC0415
  hw = hardware.load(prof_path)
  phys = costs.Calibrated(hw)
  out = {}
  for entry in suite.CALIBRATION:
    if devices_of(entry) == 1:
      cfg = _cfg(entry)
      out[entry["name"]] = _trace_train(cfg, capture.train_step(cfg, keep_compiled=True), hw, phys, trace_reps)[1]
  for entry in suite.CALIBRATION_INFER:
    out[entry["name"]] = _trace_decode(entry, validate_cfg(_cfg_infer(entry), 1), phys, trace_reps)[1]
  return out


def _cfg_infer(entry):
  from perfmodel.validate import _merge
  cfg = from_dict(_merge(suite.BASE, entry))
  return cfg.__class__(**{**cfg.__dict__, "name": entry["name"]})


def devices_of(entry: dict) -> int:
  return math.prod(_cfg(entry).mesh.sizes().values())


def measure_steps(names: list, reps: int = 7, probe: bool = True) -> dict:
  """Step times (TPOTs for decode programs) of the named calibration programs, measured by `validate`'s own
  code in a process that does nothing else: the child of validate.measure_isolated, run per device count
  (``python -m perfmodel.calibrate_nodes --measure-child OUT JSON``).

  Why a separate process: the same program measured inside `calibrate` (after micro-benchmarks and traced
  programs) ran faster than in `validate`'s process (c_d192_b12: 62 ms vs 70-72 ms, four fresh processes),
  and a composition fitted on the former under-predicted every validation config."""
  from perfmodel import speed  # noqa: PLC0415
  from perfmodel.validate import _measure_infer_entry, _measure_train_entry  # noqa: PLC0415
  prober = speed.Probe() if probe else None  # timed around every program: calibrate stores the median
  train = {e["name"]: e for e in suite.CALIBRATION}
  infer = {e["name"]: e for e in suite.CALIBRATION_INFER}
  out = {}
  for name in names:
    if name in train:
      m, _ = _measure_train_entry(_cfg(train[name]), reps, prober)
    else:
      m, _ = _measure_infer_entry(validate_cfg(_cfg_infer(infer[name]), 1), infer[name], reps, prober)
    out[name] = {"measured_s": m["measured_s"], "noise_pct": m["noise_pct"], "probe_s": m["probe_s"],
                 "p10": m["p10"], "host_malloc": host_memory.state()}
  return out


def run(hw, reps: int = 7, trace_reps: int = 3, entries: list = None, log=print, infer: bool = True,
        step_times: dict = None, traced: dict = None) -> dict:
  """``step_times``: {program: {"measured_s", "noise_pct"}} from :func:`measure_steps`; they replace the step
  times measured here for the composition fit. ``traced``: {program: node samples} from :func:`trace_programs`
  (traced in a one-device child); programs not in it are traced here."""
  from perfmodel.validate import train_runner
  entries = entries if entries is not None else suite.CALIBRATION
  # Node samples are traced with malloc keeping freed blocks, so no sample carries the page faults of a fresh
  # temp buffer (c_d160, 46 MiB: 11,900 faults and 16 ms of a 83 ms step with the default allocator, measured;
  # which instruction pays them is an accident of the buffer layout).
  log("calibrate: malloc keeps freed blocks while tracing (no per-step page faults): "
      f"{host_memory.keep_freed_memory()}")
  # The step times' allocator regime decides whether the fresh-temp term (g) has anything to fit: the child of
  # measure_steps records its own; steps timed here share this process's.
  keeps = (all(v.get("host_malloc") == "keep_freed" for v in step_times.values()) if step_times
           else host_memory.state() == "keep_freed")
  samples, programs = [], []
  phys = costs.Calibrated(hw)
  for entry in entries:
    cfg = _cfg(entry)
    given = (step_times or {}).get(entry["name"])
    if given and traced is not None and (entry["name"] in traced or math.prod(cfg.mesh.sizes().values()) > 1):
      cap = capture.train_step(cfg)  # measured and traced in children: the graph is all that is needed here
      g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
      _resolve_branches(g, cfg, hw)
      measured, noise, new = given["measured_s"], given["noise_pct"], traced.get(entry["name"], [])
    else:
      cap = capture.train_step(cfg, keep_compiled=True)
      g, new = _trace_train(cfg, cap, hw, phys, trace_reps)
      if given:
        measured, noise = given["measured_s"], given["noise_pct"]
      else:
        r = bench.time_fn(train_runner(cap, cfg), reps=reps, warmup=2)
        measured, noise = bench.seconds(r), bench.spread_pct(bench.view(r))
    samples.extend(new)
    programs.append({"name": entry["name"], "graph": g, "n": cap.n_devices, "measured": measured,
                     "noise": noise, "temp": cap.memory["temp_size_in_bytes"], "pow2": pow2_tokens(cfg)})
    log(f"calibrate {entry['name']:>18}: {len(new)} nodes traced, step {measured * 1e3:.2f} ms "
        f"(±{programs[-1]['noise']:.1f}%, {cap.n_devices} dev)")
  for entry in (suite.CALIBRATION_INFER if infer else []):
    programs.append(_infer_program(entry, hw, phys, samples, reps, trace_reps, log,
                                   (traced or {}).get(entry["name"])))
  # Leave-one-program-out node pricing -> composition features. A decode program's row is one decode step:
  # the loop body's nodes, no per-step constant (the loop does not re-enter the runtime per token).
  # The neighbour count k of the learned backend is chosen here, by the same leave-one-program-out error.
  for p in programs:  # decode programs: the child's TPOT replaces the in-process one
    if step_times and p["name"] in step_times:
      p["measured"] = step_times[p["name"]]["measured_s"]
      p["noise"] = step_times[p["name"]]["noise_pct"]
  res = select_learned(hw, programs, samples, keeps, log)
  return {"samples": samples, **res, "noise_pct_median": float(statistics.median(p["noise"] for p in programs)),
          "host_malloc": "keep_freed" if keeps else "default"}


# what select_learned chooses, stored in the profile's calibration under these names (learned.Learned reads them)
LEARNED_CHOICES = ("learned_k", "learned_beta", "learned_stat", "learned_k_decode", "learned_beta_decode",
                   "learned_stat_decode")


def select_learned(hw, programs: list, samples: list, keeps: bool, log=print) -> dict:
  """The learned backend's neighbour count k and working-set exponent beta, and the step composition, chosen by
  leave-one-program-out error over the calibration ``programs`` ({name, graph, n, measured, noise[, region,
  temp]}): each program's nodes priced without its own samples, the typed composition fitted and
  cross-validated (:func:`loo_typed`) for every (k, beta) of the grid. Decode nodes have their own classes
  (learned.py), so a decode program's row depends only on the decode (k, beta), and each type's fit only on its
  own rows: the decode pair is chosen by the decode programs' mean error, the other by the others'."""
  grid = {}
  for k, beta, stat in [(k, b, st) for k in LEARNED_K for b in LEARNED_BETA for st in learned.stats_of(samples)]:
    rows, y = [], []
    for p in programs:
      model = learned.Learned(hw, k=k, beta=beta, k_decode=k, beta_decode=beta, stat=stat, stat_decode=stat,
                              samples=[s for s in samples if s["prog"] != p["name"]])
      f = composition_features(p["graph"], lambda n: model.price(n).seconds, p["n"], p.get("region"),
                               p.get("temp", 0.0), hw=hw, keeps=keeps, pow2=p.get("pow2", False))
      if p.get("region"):
        f[2] = 0.0
      rows.append(f)
      y.append(p["measured"])
    types = [program_type(p["n"], bool(p.get("region"))) for p in programs]
    cv = loo_typed(rows, y, types, [p["name"] for p in programs], [p["noise"] for p in programs])
    dec = [abs(c["err_pct"]) for c in cv if c["type"] == "decode"]
    rest = [abs(c["err_pct"]) for c in cv if c["type"] != "decode"]
    grid[(k, beta, stat)] = (rows, float(np.mean(rest)) if rest else 0.0, float(np.mean(dec)) if dec else 0.0)
    log(f"  learned k={k} beta={beta} {stat}: leave-one-program-out MAPE "
        f"{np.mean([abs(c['err_pct']) for c in cv]):.1f}% (decode {grid[(k, beta, stat)][2]:.1f}%, others "
        f"{grid[(k, beta, stat)][1]:.1f}%)")
  best = min(grid, key=lambda kb: grid[kb][1])
  best_dec = min(grid, key=lambda kb: grid[kb][2])
  rows = [grid[best_dec if t == "decode" else best][0][i] for i, t in enumerate(types)]
  coef = fit_typed(rows, y, types)
  cv = loo_typed(rows, y, types, [p["name"] for p in programs], [p["noise"] for p in programs])
  mape = float(np.mean([abs(c["err_pct"]) for c in cv]))
  for c in cv:
    log(f"  LOO {c['name']:>18}: measured {c['measured_s'] * 1e3:8.2f} ms predicted {c['predicted_s'] * 1e3:8.2f} ms "
        f"err {c['err_pct']:+6.1f}%")
  log(f"  learned: k={best[0]} beta={best[1]} {best[2]}, decode k={best_dec[0]} beta={best_dec[1]} {best_dec[2]}: "
      f"leave-one-program-out MAPE {mape:.1f}%")
  return {"composition": coef, "loo": cv, "learned_k": best[0], "learned_beta": best[1], "learned_stat": best[2],
          "learned_k_decode": best_dec[0], "learned_beta_decode": best_dec[1], "learned_stat_decode": best_dec[2],
          "loo_mape": mape}


def _resolve_branches(g, cfg, hw) -> None:
  """A pipelined program's slots as predict resolves them (stage average; perfmodel/branches.py), so its
  composition row sees the work that runs, not the idle branches."""
  from perfmodel import branches  # noqa: PLC0415
  branches.resolve(g, costs.make_chain(hw, "roofline"), branches.schedule_of(cfg), stage=None)


def _node_samples(g, traced: dict, prog: str, phys, sampler: bool = False) -> list:
  """One learned-backend sample per distinct timed dot/fusion node of graph ``g``; a ``sampler`` program's
  samples carry the decode class (learned.py: they are the neighbours of decode nodes)."""
  out, seen = [], set()
  for n, _ in g.walk():
    if n.kind not in ("dot", "fusion", "other") or n.name not in traced or n.name in seen:
      continue
    seen.add(n.name)
    p = phys.price(n)
    out.append({"prog": prog, "cls": learned.base_class(n) + (learned.DECODE if sampler else ""), "f": learned.features(n),
                "t": trace_nodes.quantile(traced[n.name], 0.25), "t50": trace_nodes.quantile(traced[n.name], 0.5),
                "tm": float(np.mean(traced[n.name])), "phys": p.seconds if p else 0.0,
                "P": n.program_bytes, "name": n.name, "fp": n.fingerprint})
  return out


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--measure-child":
    import json  # noqa: PLC0415
    host_memory.apply()  # as the real job (experiments.run) does, before jax starts
    req = json.loads(sys.argv[3])
    with open(sys.argv[2], "w") as f:
      json.dump(measure_steps(req["names"], req["reps"], req["probe"]), f)
    sys.exit(0)
  if len(sys.argv) == 4 and sys.argv[1] == "--trace-child":
    import json  # noqa: PLC0415
    host_memory.apply()
    req = json.loads(sys.argv[3])
    with open(sys.argv[2], "w") as f:
      json.dump(trace_programs(req["profile"], req["trace_reps"]), f)
    sys.exit(0)
  sys.exit("run via `python -m perfmodel calibrate`")
