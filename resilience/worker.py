"""The training worker: one jax process per node and generation.

Started by its node agent *before* it is needed (a warm standby: jax, flax, optax and the framework
imported, the corpus loaded), it waits for an assignment (generation, rank, coordinator, restore
plan), then joins ``jax.distributed`` on that generation's coordinator, builds the mesh and the
compiled step (persistent compilation cache: a swap recompiles from disk, not from scratch),
restores the state (own shared memory, a replica fetched by the agent, or orbax), and trains in
``framework.train.loop``: snapshots, step reports and heartbeats are the loop's hooks (``_Report``).

Standbys are forked from the agent's zygote (a fork server that imported everything once), so a
fresh warm standby costs milliseconds, not a jax import. A worker never survives a generation change: on any failure the controller fences every worker of
the old generation with SIGKILL (gloo collectives cannot be cancelled on CPU, resilience/README.md) and the
agents hand the next generation to their standbys. Exceptions (e.g. a gloo "connection closed" after
a peer died) are reported and the worker waits to be killed, so only real crashes show as exits.

  python -m resilience.worker --agent tcp://127.0.0.1:PORT --name node0
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import zmq

from resilience import wire
from resilience.deathsig import die_with_parent


def _log(*a):
  print(time.strftime("%H:%M:%S"), *a, flush=True)


def _heartbeat(ctx, addr, info):
  """The loop's ``on_heartbeat``: an 'hb' message per beat, on a PUSH socket that the heartbeat thread opens
  (a zmq socket stays in the thread that uses it)."""
  push = None

  def beat(done):
    nonlocal push
    if push is None:
      push = wire.new_socket(ctx, zmq.PUSH)
      push.connect(addr)
    wire.send(push, {"type": "hb", **info, "step": done, "t": wire.now()})
  return beat


def _warm(workdir: str) -> dict:
  """Everything that does not need the assignment: imports, config, corpus (seconds on a busy host)."""
  t0 = time.time()
  import jax  # noqa: F401
  import numpy as np  # noqa: F401
  from framework import checkpoint, config, data, model, train, train_step  # noqa: F401
  from parallelism import mesh, step  # noqa: F401
  from resilience import aot, layout, slots, snapshot  # noqa: F401
  aot.code_fingerprint()  # of the code as imported here: every worker forked from this zygote runs exactly it
  with open(os.path.join(workdir, "config.json")) as f:
    cfg0 = config.from_dict(json.load(f)["config"])
  return {"data_cfg": cfg0.data, "corpus": data.load(cfg0),
          "warm_s": time.time() - t0}


def zygote(args):
  """Fork server: warms up once, then forks a ready standby worker per request in milliseconds.

  Protocol on stdin/stdout with the agent: it writes 'fork N'; we answer 'forked PID', and report
  'exit PID RC' for every child that ends (we are their parent, so only we can reap them). No zmq
  context and no jax backend exist here before a fork (neither is fork-safe); children create both.
  """
  import select
  import signal
  warm = _warm(args.workdir)
  out = sys.stdout
  out.write(f"ready {warm['warm_s']:.3f}\n")
  out.flush()
  while True:
    r, _, _ = select.select([sys.stdin], [], [], 0.02)
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
      out.flush()
    if not r:
      continue
    line = sys.stdin.readline()
    if not line:  # the agent is gone
      os._exit(0)
    cmd = line.split()
    if cmd and cmd[0] == "fork":
      pid = os.fork()
      if pid == 0:
        try:
          die_with_parent()
          fd = os.open(os.path.join(args.workdir, "logs", f"{args.name}-worker{cmd[1]}.log"),
                       os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
          os.dup2(fd, 1)
          os.dup2(fd, 2)
          os.close(fd)
          null = os.open(os.devnull, os.O_RDONLY)
          os.dup2(null, 0)
          signal.signal(signal.SIGCHLD, signal.SIG_DFL)
          sys.stdout = os.fdopen(1, "w", buffering=1)
          sys.stderr = os.fdopen(2, "w", buffering=1)
          standby(args.agent, args.name, warm)
        finally:
          os._exit(4)
      out.write(f"forked {pid}\n")
      out.flush()


def standby(agent_addr: str, name: str, warm: dict):
  ctx = zmq.Context()
  agent = wire.new_socket(ctx, zmq.DEALER)
  agent.connect(agent_addr)
  wire.send(agent, {"type": "standby_ready", "pid": os.getpid(), "import_s": warm["warm_s"]})
  _, start, _ = wire.recv(agent)
  assert start["type"] == "start", start
  t_start = wire.now()
  push = wire.new_socket(ctx, zmq.PUSH)
  push.connect(start["controller_pull"])
  info = {"rank": start["rank"], "gen": start["gen"], "pid": os.getpid(), "node": name}
  from framework.train import Hooks  # noqa: PLC0415 (loaded by _warm, which times the warm-up: see the module docstring)
  # Heartbeats from now until the process ends: set-up and compilation, the loop, and the wait to be fenced.
  hooks = Hooks(on_heartbeat=[_heartbeat(ctx, start["controller_pull"], info)],
                heartbeat_s=start["settings"]["heartbeat_s"])
  with hooks.heartbeats():
    try:
      _train(start, agent, push, ctx, t_start, name, warm, hooks)
    except BaseException as e:  # noqa: BLE001 - report, then wait to be fenced (see module docstring)
      wire.send(push, {"type": "error", **info, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc()[-4000:]})
      time.sleep(3600)
      os._exit(3)
  os._exit(0)  # skip interpreter teardown: gloo/zmq threads can hang on exit


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--agent", required=True)
  ap.add_argument("--name", required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--zygote", action="store_true", help="run as the agent's fork server")
  args = ap.parse_args(argv)
  if args.zygote:
    zygote(args)
  else:
    standby(args.agent, args.name, _warm(args.workdir))


def _cache_on_every_rank():
  """jax writes persistent-cache entries only from process 0 (write contention on GCS), but on CPU the
  cache key includes the process's device assignment, so ranks >= 1 would never hit and a spare taking
  rank k would compile cold. Each rank writes its own entries here (distinct keys: no contention)."""
  from jax._src import compiler
  from jax._src import distributed as jdist
  orig = compiler._cache_write
  if getattr(orig, "_prismllm", False):
    return

  def write(*a, **k):
    pid = jdist.global_state.process_id
    jdist.global_state.process_id = 0
    try:
      return orig(*a, **k)
    finally:
      jdist.global_state.process_id = pid
  write._prismllm = True
  compiler._cache_write = write


def _train(start, agent, push, ctx, t_start, name, warm, hooks):
  import jax
  import numpy as np
  from framework import checkpoint as ckpt_lib
  from framework import config as config_lib
  from framework import data as data_lib
  from framework import stop as stop_lib
  from framework import train as train_lib
  from parallelism.mesh import make_mesh
  from jax.sharding import NamedSharding
  from parallelism.compiled import Executables
  from parallelism.step import build_step
  from resilience import aot as aot_lib
  from resilience import layout as layout_lib
  from resilience import slots as slots_lib
  from resilience.snapshot import Snapshotter

  s = start["settings"]
  gen, rank, n = start["gen"], start["rank"], start["n"]
  base = {"rank": rank, "gen": gen, "node": name}
  # Without a serialized executable (aot.py) of this job, generation 0 compiles its step fresh and serializes
  # it for later generations and reruns: an XLA:CPU executable that was itself loaded from the persistent cache
  # re-serializes without its object code ("Function ... not found" when loaded). Its other programs (state
  # init, checksums) use the persistent cache; later generations keep it as the fallback when the serialized
  # executable cannot be used.
  fresh_compile = gen == 0
  jax.config.update("jax_compilation_cache_dir", start["compile_cache_dir"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # jax's own heartbeat would abort every survivor (SIGABRT) when a peer stops; our controller
  # detects and fences first, so give jax a long timeout and let fencing be the only exit path.
  _log("start", json.dumps({k: start[k] for k in ("gen", "rank", "n", "coordinator", "restore")}))
  _cache_on_every_rank()
  jax.distributed.initialize(coordinator_address=start["coordinator"], num_processes=n, process_id=rank,
                             initialization_timeout=int(s["startup_timeout_s"]), heartbeat_timeout_seconds=600,
                             shutdown_timeout_seconds=30)
  t_init = wire.now()
  _log("distributed initialized", jax.devices())

  cfg = config_lib.validate(config_lib.from_dict(start["config"]), jax.device_count(), jax.process_count())
  msh = make_mesh(cfg.mesh)
  probe = s["snapshot"] and s["overhead_probe_block"] > 0
  plan = start["restore"]
  aot_path = aot_lib.path(start["compile_cache_dir"], aot_lib.key(start["config"], n, f"{s['snapshot']},{probe}"),
                          rank)
  loaded = None
  try:  # this rank's executable from an earlier generation or run of the same job, if there is one
    loaded = aot_lib.load(aot_path, msh)
  except Exception as e:  # noqa: BLE001 - any mismatch: rebuild and recompile instead
    _log("aot executable unusable, recompiling:", repr(e)[:300])
  step_obj = donated_obj = None
  if loaded is not None:
    fresh_compile = False
    compiled, abstract, batch_spec = loaded
  else:
    # The layer reads the state while the next step runs, so its step must not donate the state.
    step_obj = build_step(cfg, msh, donate=not s["snapshot"])
    donated_obj = build_step(cfg, msh, donate=True) if probe else None
    abstract = step_obj.abstract_state()
    batch_spec = step_obj.batch_shardings["inputs"].spec
  batch_sh = {k: NamedSharding(msh, batch_spec) for k in ("inputs", "targets")}
  lay = layout_lib.make(abstract)
  corpus = warm["corpus"] if warm["data_cfg"] == cfg.data else data_lib.load(cfg)
  t_built = wire.now()
  _log("built step; snapshot bytes", lay.nbytes)

  slot_file, snap = None, None
  if s["snapshot"]:
    wire.send(agent, {"type": "alloc", "nbytes": lay.nbytes})
    _, rep, _ = wire.recv(agent)
    slot_file = slots_lib.SlotFile(rep["path"], lay.nbytes, create=False)

  workdir = start["workdir"]
  # the orbax manager (a collective start-up: seconds on a busy host) is opened only to restore from it, else at
  # the first save: never on the way from a failure to the first step of the memory tier
  ckpt = ckpt_lib.Checkpointer(workdir, cfg.checkpoint) if plan["tier"] == "persistent" else None
  if plan["tier"] == "memory":
    slot = plan["slot"]
    view = slot_file.view(slot, lay.nbytes)
    crc = slots_lib.checksum(view)
    if crc != plan["crc"] or plan["nbytes"] != lay.nbytes:
      # corrupted in memory: the controller fences this generation and falls back to the persistent tier
      wire.send(push, {"type": "restore_failed", **base, "why": f"snapshot v{plan['version']} checksum "
                       f"{crc} != {plan['crc']} (or {plan['nbytes']} != {lay.nbytes} bytes)"})
      time.sleep(3600)
    state = layout_lib.unpack(view, lay)
    start_step = plan["version"]
  elif plan["tier"] == "persistent":
    try:
      state, _ = ckpt.restore_step(abstract, plan["version"])
    except ckpt_lib.CheckpointError as e:  # the controller sets a corrupt step aside and falls back; foreign: stop
      wire.send(push, {"type": "restore_failed", **base, "tier": "persistent", "kind": e.kind,
                       "step": plan["version"], "why": str(e)})
      time.sleep(3600)
    start_step = plan["version"]
  else:
    init_obj = step_obj or build_step(cfg, msh, donate=not s["snapshot"])  # the executable came from aot
    state = init_obj.init_state(jax.random.key(cfg.train.seed))
    start_step = 0
  jax.block_until_ready(state)
  assert int(jax.device_get(state.step)) == start_step, (int(jax.device_get(state.step)), start_step)
  t_restored = wire.now()
  _log("restored", plan)

  if loaded is not None:
    run, run_donated = compiled["run"], compiled.get("run_donated")
  else:
    if fresh_compile:  # see above: the step itself must not come from the persistent cache
      from jax._src import compilation_cache  # noqa: PLC0415 (loaded by _warm, which times the warm-up: see the module docstring)
      jax.config.update("jax_enable_compilation_cache", False)
      compilation_cache.reset_cache()
    with step_obj.context():
      run = step_obj.lower().compile()
      run_donated = donated_obj.lower().compile() if probe else None
    if fresh_compile:
      try:
        aot_lib.save(aot_path, {"run": run, "run_donated": run_donated}, abstract, batch_spec)
      except Exception as e:  # noqa: BLE001 - an accelerator only
        _log("could not serialize the executable (later generations will recompile):", repr(e)[:300])
  # Ranks compile at different speeds (a warm spare hits the cache, a busy host does not); gloo gives
  # the first collective only 30 s to find every peer, so meet at a coordination-service barrier first.
  from jax._src import distributed as jdist
  jdist.global_state.client.wait_at_barrier(f"compiled_g{gen}", int(1000 * s["startup_timeout_s"]))
  t_compiled = wire.now()
  _log("compiled", "(aot executable loaded)" if loaded is not None else "")
  wire.send(push, {"type": "timing", **base, "t_start": t_start, "t_init": t_init, "t_built": t_built,
                   "t_restored": t_restored, "t_compiled": t_compiled, "tier": plan["tier"],
                   "start_step": start_step})

  if s["snapshot"]:
    committed_slot = plan.get("slot") if plan["tier"] == "memory" else None
    snap = Snapshotter(ctx, start["agent_local"], start["controller_pub"], slot_file, lay, gen, rank,
                       committed=start_step if plan["tier"] != "init" else -1, committed_slot=committed_slot)
  total = cfg.train.steps
  # probe: a save every 2N steps only, so N-step windows after a save alternate with windows without one
  saves = train_lib.Saves(workdir, cfg.checkpoint, s["persist_every"] * (2 if s["persist_probe"] else 1),
                          last=s["persist_every"] > 0, ckpt=ckpt)
  exe = Executables({"run": run, "run_donated": run_donated}, batch_sh, cfg.data.global_batch)
  report = _Report(push, base, snap, exe, saves, start_step, s["overhead_probe_block"] if probe else 0)
  hooks.before_step.append(report.before_step)
  hooks.after_step.append(report.after_step)
  hooks.on_checkpoint.append(report.on_checkpoint)
  batches = data_lib.iterator(corpus, cfg.data, step=start_step, process_index=rank, process_count=n)
  try:
    # The controller forwards a stop (SIGINT / SIGTERM to the launcher) as SIGTERM to every worker; jax's
    # preemption notifier catches it and the loop saves at the first step every rank can reach.
    state = train_lib.loop(exe, state, batches, total, saves, hooks)
  except stop_lib.Stopped as e:
    if e.checkpoint is None:
      raise
    if snap is not None:
      snap.close()
    wire.send(push, {"type": "stopped", **base, "step": e.step})
    saves.close()
    jax.distributed.shutdown()
    return

  ckpt = saves.ckpt
  if snap is not None:
    if report.prev_on is False:  # the last probe block ran without the layer: make the final state durable too
      snap.offer(total, state)
    if not snap.wait_committed(total, timeout=s["startup_timeout_s"]):
      raise RuntimeError(f"final snapshot v{total} was not committed in time")
    snap.close()
  buf = np.zeros(lay.nbytes, np.uint8)
  layout_lib.pack(state, lay, buf)
  final_crc = slots_lib.checksum(buf)
  os.makedirs(os.path.join(workdir, "final"), exist_ok=True)
  buf.tofile(os.path.join(workdir, "final", f"rank{rank}.bin"))
  final_bytes = int(buf.size)
  stats = {}
  if snap is not None:
    stats = {"snap_copy_ms_median": 1e3 * float(np.median(snap.copy_s)) if snap.copy_s else None,
             "snap_crc_ms_median": 1e3 * float(np.median(snap.crc_s)) if snap.crc_s else None,
             "snapshots_written": snap.written, "snapshots_skipped": snap.skipped}
  if ckpt is not None and ckpt.save_s:
    stats.update(persist_saves=len(ckpt.save_s), persist_save_ms_median=1e3 * float(np.median(ckpt.save_s)))
  wire.send(push, {"type": "done", **base, "final_crc": final_crc, "final_bytes": final_bytes,
                   "snapshot_bytes": lay.nbytes, **stats})
  saves.close()
  jax.distributed.shutdown()


class _Report:
  """The worker's hooks on the loop: which executable a step runs (``run``, or ``run_donated`` in the overhead
  probe's blocks without the snapshot layer, which must not read a donated state), the state offered to the
  snapshot layer, and one 'step' message per step to the controller (loss, completed-step time, flags)."""

  def __init__(self, push, base: dict, snap, exe, saves, start_step: int, probe_block: int):
    self.push, self.base, self.snap, self.exe, self.saves = push, base, snap, exe, saves
    self.start_step, self.block = start_step, probe_block
    self.prev_on, self.on, self.transition, self.first, self.after_save = None, False, False, True, False
    self.t_prev = time.perf_counter()

  def before_step(self, step: int, state):
    on = self.snap is not None and (not self.block or ((step - self.start_step) // self.block) % 2 == 0)
    self.transition = self.prev_on is not None and on != self.prev_on
    if self.prev_on and not on:
      self.snap.drain()  # a donated step may overwrite buffers the snapshot thread still reads
    self.prev_on = self.on = on
    self.exe.use = "run" if on or not self.block else "run_donated"

  def after_step(self, done: int, state, m):
    import jax  # noqa: PLC0415 (loaded by _warm, which times the warm-up: see the module docstring)
    loss = float(m.loss)  # blocks: the step time below is a completed step
    t_now = time.perf_counter()
    dt, self.t_prev = t_now - self.t_prev, t_now
    if self.on and self.snap is not None:
      self.snap.offer(done, state)
    wire.send(self.push, {"type": "step", **self.base, "step": done, "loss": loss, "dt": dt, "on": bool(self.on),
                          "transition": self.transition, "first": self.first, "after_save": self.after_save,
                          "t": wire.now()})
    self.first = self.after_save = False
    if self.block and not self.on and self.saves.due(done):
      jax.block_until_ready(state)  # before the save reads it

  def on_checkpoint(self, done: int, saved: bool):
    self.after_save = saved  # the next step's time includes this save's blocking part


if __name__ == "__main__":
  main()
