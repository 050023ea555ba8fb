"""`python -m perfmodel calibrate`: fit the ``cpu`` profile on this host.

It writes the profile and its node data into the user's cache (``<cache>/profiles/cpu.json`` and
``<cache>/profiles/db/``, ``<cache>`` = ``$PRISMLLM_CACHE`` or ``~/.cache/prismllm``), which prediction then reads in
place of the committed ones (perfmodel/hardware.py); ``--commit`` writes the committed ``perfmodel/profiles/`` files.

Two stages:
  1. micro-benchmarks (:func:`curves`; never the validation configs, so validation stays an honest test):
     * dot curve: square f32 matmuls 16..1024 -> achieved FLOP/s vs FLOPs; skinny shapes fit ``skinny_dim``;
     * stream curve: x*a+b over 4 KB..64 MB -> achieved bytes/s vs bytes (cache levels show up here);
     * vector rate: a 16-multiply fused chain; transcendental rate: exp;
     * per-node overhead: a scanned loop of tiny dots, divided by the nodes its compiled body has;
     * step overhead: dispatch of a trivial jitted call;
     * host parallelism: the same per-device matmul work on 1 vs 2 virtual devices;
     * collectives: in-process all-reduce / all-gather / collective-permute over 2 virtual devices, 1 KB..16 MB,
       each the marginal cost of one inside a program (perfmodel/calib/collective_bench.py);
  2. the calibration programs (:func:`node_stage`): their step times measured in fresh children per device count,
     each bracketed by the host-speed probe (perfmodel/calib/host.py), their nodes traced in fresh one-device
     children, and the learned backend with its composition fitted (perfmodel/calib/nodes.py, fit.py).
A calibration whose own leave-one-program-out error is above ``MAX_LOO_PCT`` is refused (:func:`gate`): the
previous files are put back and the new ones kept aside (``rejected/`` beside the profile) for inspection.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from perfmodel import hardware
from perfmodel.calib import bench, collective_bench, nodes, runners, store, suite
from perfmodel.calib.host import HostSpeed
from perfmodel.compositions import Calibration
from perfmodel.cost import database, learned, regime
from perfmodel.graph.from_hlo import from_hlo_text
from perfmodel.hardware import interp_log

# rounds of the calibration programs' step measurement, pooled by median (about 11 minutes each on a 2-core host)
STEP_ROUNDS = 3
# Which reading of a step time the compositions are fitted on (bench.STATISTICS): the p10. On a shared host other
# tenants only ever slow a step down (contention for caches and memory, which the CPU-time clock still counts), so
# the low tail of a program's call times is its speed with the least contention, and it repeats far better than the
# median (the speed probe's median moved 21% across eight 15 s windows of one hour, its p10 6%).
STEP_STATISTIC = "p10"
# fresh processes the one-device calibration programs' nodes are traced in (nodes.pool_traced), a few minutes each:
# one program's in-program node times move together by up to 1.45x between fresh processes while its step does not
TRACE_ROUNDS = 3
# A calibration whose own leave-one-program-out error is above this is refused (``calibrate --max-loo``). Kept
# calibrations came out at 7.4-14.0%; one taken while a measuring child ran in a slow window of the host came out
# at 20% and validated far worse than the ones before it.
MAX_LOO_PCT = 15.0
PROFILE = os.path.join(hardware.PROFILE_DIR, "cpu.json")  # the committed profile (``calibrate --commit``)


def destination(commit: bool = False, profile: str = "cpu") -> str:
  """The profile file a calibration writes: the committed one with ``commit``, else the user's, which starts as a
  copy of the profile in effect (its sourced fields and any composition a partial calibration keeps)."""
  if commit:
    return os.path.join(hardware.PROFILE_DIR, f"{profile}.json")
  dst = os.path.join(hardware.user_profile_dir(), f"{profile}.json")
  if not os.path.exists(dst):
    with open(hardware.profile_path(profile), "rb") as f:
      store.write_bytes(dst, f.read())
  return dst


def curves(quick: bool = False, prof_path: str = PROFILE) -> dict:
  """Stage 1: the micro-benchmarks, written into the profile with a fresh calibration (its compositions come with
  stage 2)."""
  reps = 3 if quick else 7
  dev = jax.devices()[0]
  noise = []
  put = lambda x: jax.device_put(x, dev)  # noqa: E731

  dispatch = bench.time_fn(jax.jit(lambda v: v + 1), put(jnp.ones((4,))), reps=50)
  step_overhead = bench.seconds(dispatch)

  dot_curve = []
  for n in (16, 32, 64, 128, 256, 384, 512, 768, 1024) if not quick else (32, 128, 512):
    a = put(jnp.ones((n, n), jnp.float32))
    r = bench.time_fn(jax.jit(lambda x: x @ x), a, reps=reps, min_time=0.1)
    noise.append(bench.spread_pct(bench.view(r)))
    flops = 2.0 * n ** 3
    dot_curve.append([flops, flops / max(1e-9, bench.seconds(r) - step_overhead)])
  # Skinny matmuls: fit d in rate = curve(flops) * min(1, sqrt(min_dim / d)).
  skinny = []
  for m, k, n in ((8, 512, 512), (16, 1024, 256), (4, 256, 1024), (32, 512, 512)):
    a, b = put(jnp.ones((m, k), jnp.float32)), put(jnp.ones((k, n), jnp.float32))
    r = bench.time_fn(jax.jit(lambda x, y: x @ y), a, b, reps=reps, min_time=0.05)
    flops = 2.0 * m * k * n
    ratio = (flops / max(1e-9, bench.seconds(r) - step_overhead)) / interp_log(dot_curve, flops)
    skinny.append((min(m, k, n), ratio))
  skinny_dim = statistics.median([s / max(1e-6, min(1.0, r)) ** 2 for s, r in skinny])

  stream_curve = []
  sizes = [2 ** p for p in range(10, 25, 2)] if not quick else [2 ** 12, 2 ** 18, 2 ** 22]
  for n in sizes:
    x = put(jnp.ones((n,), jnp.float32))
    r = bench.time_fn(jax.jit(lambda v: v * 1.5 + 0.5), x, reps=reps, min_time=0.05)
    nbytes = 8.0 * n
    stream_curve.append([nbytes, nbytes / max(1e-9, bench.seconds(r) - step_overhead)])
  big = 2 ** 22
  x = put(jnp.ones((big,), jnp.float32))
  t_stream = 8.0 * big / interp_log(stream_curve, 8.0 * big)

  def chain16(v):
    for _ in range(16):
      v = v * 1.0001
    return v
  r = bench.time_fn(jax.jit(chain16), x, reps=reps)
  # Under heavy load the subtraction can go negative: never credit more than 10x the measured rate.
  vector_rate = 16 * big / max(0.1 * bench.seconds(r), bench.seconds(r) - step_overhead - t_stream)
  r = bench.time_fn(jax.jit(jnp.exp), x, reps=reps)
  trans_rate = big / max(0.1 * bench.seconds(r), bench.seconds(r) - step_overhead - t_stream)

  # Per-node overhead: a scan of tiny dots; the compiled body's node count comes from our own parser.
  w = put(jnp.ones((4, 4), jnp.float32))
  trips = 512

  def loop(v):
    return jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ w), v)
  f = jax.jit(loop)
  g = from_hlo_text(f.lower(w).compile().as_text())
  body_nodes = max(sum(1 for _ in g.walk(n.body)) for n in g.regions[g.entry].nodes if n.kind == "loop")
  r = bench.time_fn(f, w, reps=reps)
  launch = max(1e-7, bench.seconds(r) / trips / max(1, body_nodes))

  # Host parallelism: N virtual devices doing the per-device work of one.
  host_par = 1.0
  if len(jax.devices()) >= 2:
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    a1 = put(jnp.ones((256, 256), jnp.float32))
    a2 = jax.device_put(jnp.ones((512, 256), jnp.float32), NamedSharding(mesh, P("d", None)))
    f1 = jax.jit(lambda x: jnp.tanh(jnp.tanh(x @ x.T[:, :256]) @ x[:256]))
    r1 = bench.time_fn(f1, a1, reps=reps, min_time=0.2)
    f2 = jax.jit(jax.shard_map(lambda x: jnp.tanh(jnp.tanh(x @ x.T[:, :256]) @ x[:256]), mesh=mesh,
                               in_specs=P("d", None), out_specs=P("d", None), check_vma=False))
    r2 = bench.time_fn(f2, a2, reps=reps, min_time=0.2)
    host_par = 2.0 * bench.seconds(r1) / bench.seconds(r2)

  coll = {}
  if len(jax.devices()) >= 2:
    # each collective's marginal cost inside a program (perfmodel/calib/collective_bench.py: k chained in one
    # loop, minus the loop without them), not a lone jitted call's, which carries the call's dispatch
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
    sizes = [4 ** p for p in range(5, 13)] if not quick else [4 ** 5, 4 ** 9]
    for kind in collective_bench.KINDS:
      coll[kind] = collective_bench.marginal_curve(mesh, kind, sizes, k=8, reps=5 if quick else 15)
    coll["reduce-scatter"] = [[s, t] for s, t in coll["all-gather"]]


  src = (f"python -m perfmodel calibrate on {platform.machine()} {os.cpu_count()}-core host {datetime.date.today().isoformat()}, "
         f"jax {jax.__version__}, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f}")
  base = store.read_json(prof_path)
  peak = max(r for _, r in dot_curve)
  cal = Calibration(date=datetime.datetime.now().isoformat(timespec="seconds"), host=f"{platform.machine()} {os.cpu_count()} cores",
                    jax=jax.__version__, vector_flops_per_s=vector_rate, skinny_dim=skinny_dim,
                    step_overhead_s=step_overhead, host_parallelism=host_par,
                    provenance={"noise_pct_median": statistics.median(noise), "quick": quick,
                                "load_avg": os.getloadavg()[0], "regime": bench.regime(),
                                "clock": "cpu" if regime.pinned() else "wall"})
  base.update({
      "peak_flops": {"f32": {"value": peak, "source": src + ": best square f32 matmul"},
                     "bf16": base["peak_flops"].get("bf16", {"value": peak / 2, "source": "estimate"})},
      "mem_bandwidth": {"value": stream_curve[-1][1], "source": src + ": x*a+b at the largest size"},
      "launch_overhead": {"value": launch, "source": src + f": fori_loop of tiny dots / {body_nodes} nodes per trip"},
      "transcendental_rate": {"value": trans_rate, "source": src + ": exp over 4M f32"},
      "dot_curve": {"value": dot_curve, "source": src},
      "stream_curve": {"value": stream_curve, "source": src},
      "collective_curve": coll,
      "calibrated": {"value": True, "source": src},
      "calibration": {"value": cal.to_dict(), "source": src},
  })
  store.write_json(prof_path, base, indent=1)
  return {"profile": prof_path, "peak_f32_flops": peak, "dram_bw": stream_curve[-1][1], "launch_s": launch,
          "step_overhead_s": step_overhead, "vector_flops_per_s": vector_rate, "trans_per_s": trans_rate,
          "skinny_dim": skinny_dim, "host_parallelism": host_par, "noise_pct": statistics.median(noise),
          "regime": bench.regime()}


def snapshot(paths: list) -> dict:
  """{path: bytes or None}: what a calibration is about to overwrite."""
  out = {}
  for p in paths:
    out[p] = None
    if os.path.exists(p):
      with open(p, "rb") as f:
        out[p] = f.read()
  return out


def gate(snap: dict, loo_mape, max_loo: float = MAX_LOO_PCT, rejected_dir: str = None) -> dict:
  """Keeps a fresh calibration when its leave-one-program-out error is at most ``max_loo`` percent. Otherwise the
  fresh files move to ``rejected_dir`` (same file names, for inspection) and the ones in ``snap`` (written by
  :func:`snapshot` before the calibration) are put back, so a calibration taken while the host swung does not
  silently replace a good profile. Nothing is lost either way."""
  if loo_mape is None or loo_mape <= max_loo:
    return {"accepted": True, "loo_mape": loo_mape, "max_loo": max_loo}
  rejected_dir = rejected_dir or os.path.join(os.path.dirname(next(iter(snap))), "rejected")
  os.makedirs(rejected_dir, exist_ok=True)
  moved = []
  for path, old in snap.items():
    if not os.path.exists(path):
      continue
    dst = os.path.join(rejected_dir, os.path.basename(path))
    os.replace(path, dst)
    moved.append(dst)
    if old is not None:
      store.write_bytes(path, old)
  return {"accepted": False, "loo_mape": loo_mape, "max_loo": max_loo, "rejected_files": moved,
          "message": f"calibration refused: leave-one-program-out error {loo_mape:.1f}% > {max_loo:.1f}% (the host "
                     f"was too unsteady to calibrate on?); the previous profile is kept, the new files are in "
                     f"{rejected_dir}; rerun later, or pass --max-loo to accept it"}


def step_times(host: HostSpeed) -> dict:
  """One round of the calibration programs' step times, measured by validate's own code in fresh children, one per
  device count (exactly that many virtual devices; same pinned core and XLA flags), each child bracketed by
  one-device probes in fresh processes (the host's speed in its window), read in ``host``'s statistic."""
  groups = {}
  for entry in suite.CALIBRATION:
    groups.setdefault(nodes.devices_of(entry), []).append(entry["name"])
  groups.setdefault(1, []).extend(e["name"] for e in suite.CALIBRATION_INFER)
  out = {}
  for n, names in sorted(groups.items()):
    before = host.one_device_probe()
    got = runners.measure_isolated(None, names, n, reps=7, probe=True)
    after = host.one_device_probe()
    for v in got.values():
      for st in bench.STATISTICS:
        (v if st == "median" else v[st])["window_probe_1dev_s"] = [before[st], after[st]]
    out.update({name: host.read(v) for name, v in got.items()})
  return out


def node_stage(quick: bool = False, prof_path: str = PROFILE, step_rounds: int = STEP_ROUNDS,
               step_statistic: str = STEP_STATISTIC, log=print) -> dict:
  """Stage 2: the calibration programs (uses the curves already in the profile for the physical estimates)."""
  hw = hardware.load(prof_path)
  src = (f"python -m perfmodel calibrate on {platform.machine()} {os.cpu_count()}-core host {datetime.date.today().isoformat()}, "
         f"jax {jax.__version__}, load avg {os.getloadavg()[0]:.2f}, regime {bench.regime()}")
  host = HostSpeed(step_statistic)
  steps, ref, refs, windows, traced = None, None, {}, {}, None
  if not quick:
    steps, ref, refs, windows = host.calibration_steps([step_times(host) for _ in range(max(1, step_rounds))])
    traced = nodes.pool_traced([runners.child_json("trace", {"profile": os.path.abspath(prof_path), "trace_reps": 2},
                                                   1, "calibration trace child") for _ in range(TRACE_ROUNDS)])
  res = nodes.run(hw, reps=3 if quick else 5, trace_reps=2, log=log, step_times=steps, traced=traced)
  store.write_json(database.calibration_db_path(database.samples_name(hw.name), os.path.dirname(prof_path)), {
      "meta": {"source": src, "method": "XLA TraceMe per thunk, p25 (t), median (t50), mean (tm) of occurrences, "
                                        "calibration suite perfmodel/calib/suite.py:CALIBRATION(+_INFER)",
               "features_version": learned.FEATURES_VERSION}, "samples": res["samples"]})
  host_speed = {}
  if ref:
    probes = [v["probe_s"] for v in steps.values() if v.get("probe_s")]
    host_speed = {"probe_ref_s": ref, "probe_ref_by_devices": {str(n): r for n, r in sorted(refs.items())},
                  "probe_windows_1dev": {str(n): w for n, w in sorted(windows.items())}, "step_rounds": step_rounds,
                  "source": f"{src}: median of the speed probe timed around each calibration program "
                            f"({len(steps)} programs x {step_rounds} rounds, probe {step_statistic}s "
                            f"{min(probes) * 1e3:.2f}-{max(probes) * 1e3:.2f} ms)"}
  # the profiled and hybrid compositions were fitted on the step times replaced here: dropped with them (`calibrate`
  # refits them once the gate accepts; until then `auto` is learned)
  comp = dataclasses.replace(res["composition"], source=src)
  cal = store.update_calibration(
      prof_path, compositions={"learned": comp}, neighbours={"learned": res["neighbours"]},
      host_malloc=res["host_malloc"], host_speed=host_speed, profiled_date=None,
      # quick mode fits on steps timed in this process, read as medians
      step_statistic=step_statistic if steps else "median")
  return {"profile": prof_path, "samples": len(res["samples"]), "loo_mape": comp.loo_mape,
          "neighbours": {g: dataclasses.asdict(n) for g, n in cal.neighbours["learned"].items()},
          "composition": comp.to_dict()["forms"], "node_noise_pct": res["noise_pct_median"]}


def run(quick: bool = False, nodes_stage: bool = True, nodes_only: bool = False, step_rounds: int = STEP_ROUNDS,
        step_statistic: str = STEP_STATISTIC, prof_path: str = PROFILE, log=print) -> dict:
  if step_statistic not in bench.STATISTICS:
    raise ValueError(f"step_statistic={step_statistic!r}: one of {bench.STATISTICS}")
  out = {} if nodes_only else curves(quick, prof_path)
  out["profile"] = prof_path
  if nodes_stage or nodes_only:
    out["nodes"] = node_stage(quick, prof_path, step_rounds, step_statistic, log)
  return out


def files(prof_path: str) -> list:
  """What a calibration of ``prof_path`` writes: the profile, its node samples and its profiled database."""
  profile, folder = os.path.basename(prof_path)[:-len(".json")], os.path.dirname(prof_path)
  return [prof_path, database.calibration_db_path(database.samples_name(profile), folder),
          database.calibration_db_path(database.db_name(profile), folder)]
