"""Profiled backend, fusions too: every compute instruction of a compiled program, cut out and timed alone.

Charon's profiled database times operators on the real device at their real shapes. A fusion has no jax spelling
to rebuild it from, so this module cuts every instruction out of the program text itself:

* a fusion's fused computation becomes the ENTRY of a new module (XLA fuses it again, as it did in the
  program); any other instruction (metadata and control edges dropped) becomes the ROOT of a new ENTRY whose
  parameters have its operands' exact types, layouts included;
* every computation it calls (reducers, ...) is copied with it;
* HLO text -> ``HloModule`` (``xla_client.hlo.hlo_module_from_text``) -> StableHLO
  (``_jax.mlir.hlo_to_stablehlo``) -> compiled by the same XLA client that runs the job.
  StableHLO has no layouts, so the entry's parameter and result layouts are pinned with
  ``mhlo.layout_mode`` (as jax does for user layouts): a ``copy`` that transposes in the program
  transposes here too, instead of becoming a memcpy.

The module is compiled again, so XLA may fuse its body differently from the original: what is timed is
"these ops at these shapes and layouts, compiled by this XLA", which is what a profiled database means.
In-place updates (a ``dynamic-update-slice``, alone or as a fusion's root, writes into its operand's buffer
in the program) are timed with that argument donated, so XLA does not copy the whole buffer first. Left to
the other backends (counted in the result, never silently): instructions with tuple-typed operands,
layout-changing bitcasts inside a fusion, and anything that fails to compile (the reason is kept; a
compiler abort kills only the child that compiles).

Timing: XLA:CPU's own per-thunk trace events of the standalone program (perfmodel/cost/trace_nodes.py, as the
calibration traces nodes inside whole programs), low quartile over calls; see :func:`thunk_seconds`. The
compiling and timing run in a child process (:class:`_Worker`, ``python -m perfmodel.cost.worker``) pinned
like its parent.

Where the times go (perfmodel/cost/database.py): ``calibrate`` passes the committed database; everything else
(``predict`` / ``validate`` profiling a program) writes the user's cache.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import Optional

import jax
import numpy as np
from jax._src import compiler, xla_bridge
from jax._src.interpreters import mlir as jmlir
from jax._src.lib import _jax, xla_client as xc
from jax._src.lib.mlir import ir

from framework import xla_flags
from perfmodel.cost import database, regime, trace_nodes
from perfmodel.graph import hlo_parse as hp
from perfmodel.graph.from_hlo import build_graph
from perfmodel.graph.nodes import COMPUTE_KINDS

SKIP_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
            "partition-id", "replica-id", "after-all", "opt-barrier", "add-dependency", "send", "recv",
            "send-done", "recv-done", "infeed", "outfeed", "rng-get-and-update-state", "domain"}
_LAYOUT = re.compile(r"\{([\d,]*)\}")


def _strip_attr(line: str, key: str) -> str:
  """Drops ``, key={...}`` (balanced braces) from an HLO line."""
  i = line.find(f", {key}=")
  while i >= 0:
    j = line.index("=", i) + 1
    if line[j] == "{":
      end = hp._match_close(line, j) + 1
    else:
      end = j
      while end < len(line) and line[end] not in ",":
        end += 1
    line = line[:i] + line[end:]
    i = line.find(f", {key}=")
  return line


def _clean(line: str) -> str:
  for key in ("metadata", "control-predecessors", "frontend_attributes", "statistics"):
    line = _strip_attr(line, key)
  return line


def _type_text(line: str) -> str:
  """The result type of an instruction line, as printed (``f32[8,64]{1,0}`` or a parenthesised tuple)."""
  rest = hp._INSTR.match(line).group(3).strip()
  if rest.startswith("("):
    return rest[:hp._match_close(rest, 0) + 1]
  return rest.split(None, 1)[0]


class ProgramText:
  """A compiled module's computations as printed: parsed instructions with their lines, and headers
  (``hlo_parse.parse_module`` keeps both)."""

  def __init__(self, text: str):
    self.module = mod = hp.parse_module(text)
    self.headers = {c.name: c.header for c in mod.computations.values()}
    self.instrs = {c.name: {i.name: (i, i.line) for i in c.instructions} for c in mod.computations.values()}

  def called_closure(self, ins: hp.Instruction) -> list:
    out, todo = [], [c.lstrip("%") for c in ins.called()]
    while todo:
      c = todo.pop()
      if c in out or c not in self.instrs:
        continue
      out.append(c)
      for sub, _ in self.instrs[c].values():
        todo.extend(x.lstrip("%") for x in sub.called())
    return out

  def _block(self, comp: str, header: str = None) -> list:
    """Computation ``comp`` as lines of a standalone module (its own header unless ``header`` is given)."""
    return [header or self.headers[comp]] + [self._portable(comp, i) for i, _ in self.instrs[comp].values()] + ["}", ""]

  def _portable(self, comp: str, ins: hp.Instruction) -> str:
    """A called computation's line as StableHLO can carry it: StableHLO has no layouts, so a ``bitcast``
    (a reinterpretation of the layout) becomes the ``reshape`` it is when both sides are row-major; any
    other bitcast cannot be carried (the compiler aborts on it) and the instruction is not profiled."""
    line = _clean(ins.line)
    if ins.opcode == "bitcast":
      src = _type_text(self.instrs[comp][ins.operands[0]][1])
      if not (_descending(_type_text(line)) and _descending(src)):
        raise ValueError("layout-changing bitcast inside")
      line = line.replace(" bitcast(", " reshape(", 1)
    return line

  def in_place_param(self, comp: str, name: str):
    """The parameter an in-place update writes into (the standalone entry's parameter number), or None.
    In the program a ``dynamic-update-slice`` (alone or as a fusion's root) writes into its operand's
    buffer; alone, XLA would first copy the whole buffer to keep the caller's argument intact, so the
    profiler donates that argument instead (``tf.aliasing_output``)."""
    ins, _ = self.instrs[comp][name]
    if ins.opcode == "dynamic-update-slice":
      return 0
    if ins.opcode != "fusion":
      return None
    fused = self.called_closure(ins)[0]
    root = next(i for i, _ in self.instrs[fused].values() if i.is_root)
    if root.opcode != "dynamic-update-slice":
      return None
    buf = self.instrs[fused].get(root.operands[0], (None,))[0]
    return int(buf.attrs["parameter_number"]) if buf is not None and buf.opcode == "parameter" else None

  def standalone(self, comp: str, name: str) -> tuple:
    """(module text, operand types, result type) of instruction ``name`` of computation ``comp`` alone;
    raises ValueError with the reason when it cannot be cut out."""
    ins, line = self.instrs[comp][name]
    if ins.opcode in SKIP_OPS or hp.collective_kind(ins.opcode) or hp.async_role(ins.opcode):
      raise ValueError(f"not a compute instruction ({ins.opcode})")
    called = self.called_closure(ins)
    roots = [self.instrs[c][n][0] for c in called[:1] for n in self.instrs[c] if self.instrs[c][n][0].is_root]
    if ins.opcode == "dynamic-update-slice" or any(r.opcode == "dynamic-update-slice" for r in roots):
      if self.in_place_param(comp, name) is None:
        raise ValueError("in-place update of a buffer that is not a parameter")
    types = []
    for o in ins.operands:
      if o not in self.instrs[comp]:
        raise ValueError(f"operand {o} not found")
      t = _type_text(self.instrs[comp][o][1])
      if t.startswith("("):
        raise ValueError("tuple-typed operand")
      types.append(t)
    out_type = _type_text(line)
    parts = ["HloModule standalone", ""]
    if ins.opcode == "fusion":
      # The fused computation itself becomes the entry: XLA fuses it again as it would in the program (a
      # fusion instruction carried through StableHLO loses the layouts its body was built for).
      fused, nested = called[0], called[1:]
      for c in reversed(nested):
        parts += self._block(c)
      parts += self._block(fused, "ENTRY " + self.headers[fused].lstrip())
      params = sorted((int(i.attrs["parameter_number"]), _type_text(ln))
                      for i, ln in self.instrs[fused].values() if i.opcode == "parameter")
      return "\n".join(parts), [t for _, t in params], out_type
    body = _clean(line).strip()
    if body.startswith("ROOT "):
      body = body[5:]
    rhs = body.split("=", 1)[1].strip()
    open_i = re.search(re.escape(ins.opcode) + r"\(", rhs).end() - 1
    close_i = hp._match_close(rhs, open_i)
    args = ", ".join(f"%p{i}" for i in range(len(types)))
    for c in reversed(called):
      parts += self._block(c)
    parts.append("ENTRY %main {")
    parts += [f"  %p{i} = {t} parameter({i})" for i, t in enumerate(types)]
    parts += [f"  ROOT %target = {rhs[:open_i]}({args}){rhs[close_i + 1:]}", "}", ""]
    return "\n".join(parts), types, out_type


def _descending(t: str) -> bool:
  """Whether an array type's bytes are in row-major order: its layout, without the dimensions of size 1
  (which do not move bytes), is descending; true when no layout is printed."""
  m = _LAYOUT.search(t)
  if not m or not m.group(1):
    return True
  sizes = hp.parse_shape(t)[0].dims
  order = [int(x) for x in m.group(1).split(",") if sizes[int(x)] != 1]
  return order == sorted(order, reverse=True)


def _layout_mode(t: str) -> str:
  m = _LAYOUT.search(t)
  return "{" + m.group(1) + "}" if m else "default"


def _array_spec(t: str):
  shapes = hp.parse_shape(t)
  if len(shapes) != 1:
    raise ValueError(f"not an array type: {t}")
  return shapes[0]


_NP_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "s32": "int32",
             "s64": "int64", "u32": "uint32", "u8": "uint8", "s8": "int8", "pred": "bool", "u64": "uint64",
             "s16": "int16", "u16": "uint16"}


def compile_standalone(text: str, types: list, out_type: str, alias=None):
  """Compiles a standalone module on the first local device with its entry layouts pinned; parameter
  ``alias`` (if any) is donated to the result (an in-place update writes into it, as in the program)."""
  mod = xc.hlo.hlo_module_from_text(text)
  st = _jax.mlir.hlo_to_stablehlo(mod.as_serialized_hlo_module_proto())
  out_layouts = re.findall(r"\{[\d,]*\}", out_type) if out_type.startswith("(") else [_layout_mode(out_type)]
  with jmlir.make_ir_context():
    m = ir.Module.parse(st)
    main = [op for op in m.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main"][0]
    i32 = ir.IntegerType.get_signless(32)
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(
        [ir.DictAttr.get({"mhlo.layout_mode": ir.StringAttr.get(_layout_mode(t)),
                          **({"tf.aliasing_output": ir.IntegerAttr.get(i32, 0)} if i == alias else {})})
         for i, t in enumerate(types)])
    n_res = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results)
    if n_res == len(out_layouts):
      main.attributes["res_attrs"] = ir.ArrayAttr.get(
          [ir.DictAttr.get({"mhlo.layout_mode": ir.StringAttr.get(lay)}) for lay in out_layouts])
    src = str(m)
  backend = xla_bridge.get_backend()
  devs = xc.DeviceList(tuple(backend.local_devices()[:1]))
  opts = compiler.get_compile_options(num_replicas=1, num_partitions=1)
  return backend.compile_and_load(src, devs, opts)


def _inputs(types: list):
  dev = jax.local_devices()[0]
  arrs = []
  for t in types:
    s = _array_spec(t)
    dt = np.dtype(_NP_DTYPE[s.dtype]) if s.dtype != "bf16" else jax.numpy.bfloat16
    arrs.append(jax.device_put(np.zeros(s.dims, dt), dev))
  return arrs


def run_standalone(exe, args) -> list:
  """Runs a compiled standalone module on ``args`` (device arrays); its outputs as jax arrays."""
  res = exe.execute_sharded(list(args))
  return [x for a in res.disassemble_into_single_device_arrays() for x in a]


def _run(exe, args):
  for x in run_standalone(exe, args):
    x.block_until_ready()


class _Worker:
  """The child process that compiles and times standalone modules. XLA aborts the whole process on some
  modules (a CHECK failure in the compiler), so that happens in a child: the parent records the instruction
  as not profiled ("compiler aborted") and starts a fresh child. The child inherits the core pinning and
  XLA flags, so it measures in the same regime as the caller."""

  def __init__(self):
    self.p = None

  def _start(self):
    env = dict(os.environ)
    # one host device, as a one-device job runs (extra virtual devices slow a step down)
    xla_flags.set_host_device_count(1, env)
    trace_nodes.enable(env)
    self.p = subprocess.Popen([sys.executable, "-m", "perfmodel.cost.worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

  def run(self, job: dict) -> dict:
    if self.p is None or self.p.poll() is not None:
      self._start()
    try:
      self.p.stdin.write(json.dumps(job) + "\n")
      self.p.stdin.flush()
      line = self.p.stdout.readline()
    except BrokenPipeError:
      line = ""
    if not line:
      self.close()
      return {"error": "compiler aborted"}
    return json.loads(line)

  def close(self):
    if self.p is not None:
      try:
        self.p.stdin.close()
      except OSError:
        pass
      self.p.kill()
      self.p.wait()
      self.p = None


def thunk_seconds(exe, types: list, alias=None, target_s: float = 0.15, max_reps: int = 50) -> float:
  """In-kernel seconds of one call of a compiled standalone module (zero-filled arguments of ``types``):
  XLA:CPU's per-thunk TraceMe events (perfmodel/cost/trace_nodes.py; the flag must be set before jax starts),
  each thunk's low quartile over the calls, summed over the thunks of the entry computation. What a call
  costs around its thunks (argument handling, output allocation, handing the work to the executor's
  thread: 7-25 us a call here, measured) is left out, as the program's own thunks do not pay it: timing
  the call instead priced a 2-us fusion at 30-70 us."""
  m = hp.parse_module(exe.hlo_modules()[0].to_string())
  names = {i.name for c in m.computations.values() if c.is_entry for i in c.instructions
           if i.opcode not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")}
  args = _inputs(types)

  def call():
    if alias is not None:  # the donated argument is consumed by each call: a fresh one (outside the thunks)
      args[alias] = _inputs([types[alias]])[0]
    _run(exe, args)
  clock = regime.clock()
  call()
  t0 = clock()
  call()
  one = max(clock() - t0, 1e-7)
  reps = int(max(5, min(max_reps, target_s / one)))
  times = trace_nodes.traced_times(call, reps=reps, names=names)
  if not times:
    raise ValueError("no thunk traced (is --xla_cpu_enable_xprof_traceme set in this process?)")
  return float(sum(trace_nodes.quantile(v, 0.25) for v in times.values()))


def worker_main() -> int:
  """The worker's loop (perfmodel/cost/worker.py runs it): one JSON job per line in, one result per line out."""
  compiled = {}  # module text -> executable: a later pass over the same instructions times, it does not compile
  for line in sys.stdin:
    job = json.loads(line)
    try:
      key = (job["text"], job.get("alias"))
      if key not in compiled:
        compiled[key] = compile_standalone(job["text"], job["types"], job["out"], job.get("alias"))
      out = {"s": max(1e-9, thunk_seconds(compiled[key], job["types"], job.get("alias")))}
    except Exception as e:  # noqa: BLE001 - the reason goes back to the parent, which reports it
      msg = str(e).strip()
      out = {"error": msg.splitlines()[0][:80] if msg else type(e).__name__}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
  return 0


def stale_before(hw) -> Optional[str]:
  """The time before which a profiled entry is not used by a profile's compositions: the later of its
  calibration (``date``) and its last ``calibrate --profiled`` (``profiled_date``, which times every calibration
  program's instructions again). Entries timed before it are timed again before they price anything."""
  dates = [d for d in (hw.calibration.date, hw.calibration.profiled_date) if d]
  return max(dates) if dates else None


def profile_program(hlo_text: str, n_devices: int = 1, profile: str = "cpu", path: Optional[str] = None,
                    passes: int = 2, log=None, retime_other_boots: bool = True,
                    stale_before: Optional[str] = None) -> dict:
  """Times every distinct compute node (by fingerprint) of a compiled program alone and adds the results to the
  profiled database ``path`` (default: the user's cache, entries of the committed database counting as timed).
  Returns what was timed and skipped.

  An entry is timed again, not reused, when:
  * it was timed on another boot (``retime_other_boots``, default; every entry records its ``regime.boot_id``): the
    database is keyed by device kind and jax version, and two VMs of one kind can differ several-fold in memory
    bandwidth, so a composition fitted on one machine's step times and another's node times fits neither;
  * it was timed before ``stale_before`` (an ISO time: the profile's calibration, :func:`stale_before`): the hybrid
    backend divides the calibration's in-program node times by these alone times, and a shared host's speed moves
    by 10% within hours, so both sides must come from one sitting.

  ``passes`` (default 2): every instruction is timed once per pass, the passes one after the other over the whole
  program, and its entry is the lowest pass (``passes_s`` keeps each): a thunk's time is its traced wall time, and a
  preemption of the pinned core that spans one instruction's short timing window (1-150 ms) inflates every sample
  of it, which no quantile within the window removes. The second pass costs timing only (the worker keeps what it
  compiled)."""
  dest = path or database.cache_path(database.db_name(profile))
  known = database.read_entries([path] if path else database.profiled_paths(profile))
  boot = regime.boot_id()
  prog = ProgramText(hlo_text)
  g = build_graph(prog.module, n_devices)  # one parse for both
  where = {name: comp for comp, ins in prog.instrs.items() for name in ins}
  cached, skipped, seconds, seen, jobs = 0, {}, {}, set(), {}
  # every region, not g.walk(): an unresolved conditional walks its first branch only, and the other branches
  # (a pipeline's per-stage slots) must be priced too
  for n in (n for r in g.regions.values() for n in r.nodes):
    if n.kind not in COMPUTE_KINDS or n.fingerprint in seen:
      continue
    seen.add(n.fingerprint)
    old = known.get(n.fingerprint)
    if (isinstance(old, dict) and old.get("method") == "isolated-traced"
        and not (retime_other_boots and old.get("boot") != boot)
        and not (stale_before and (old.get("timed_at") or "") < stale_before)):
      cached += 1
      continue
    try:
      text, types, out_type = prog.standalone(where[n.name], n.name)
      jobs[n.fingerprint] = (n, {"text": text, "types": types, "out": out_type,
                                 "alias": prog.in_place_param(where[n.name], n.name)})
    except ValueError as e:
      skipped[str(e)] = skipped.get(str(e), 0) + 1
  times, failed = {fp: [] for fp in jobs}, {}
  worker = _Worker()
  try:
    for _ in range(max(1, passes)):
      for fp, (n, job) in jobs.items():
        if fp in failed:
          continue
        r = worker.run(job)
        if "error" in r:
          failed[fp] = r["error"]
        else:
          times[fp].append(r["s"])
  finally:
    worker.close()
  for reason in failed.values():
    skipped[reason] = skipped.get(reason, 0) + 1
  new = {}
  for fp, (n, _) in jobs.items():
    if fp in failed or not times[fp]:
      continue
    s = min(times[fp])
    new[fp] = {"s": s, "passes_s": times[fp], "method": "isolated-traced", "op": n.opcode, "boot": boot,
               "timed_at": datetime.datetime.now().isoformat(timespec="seconds")}
    seconds[n.name] = s
    if log:
      log(f"  {n.name:>40} {n.opcode:>28} {s * 1e6:9.1f} us  (passes {' '.join(f'{t * 1e6:.1f}' for t in times[fp])})")
  if new or not os.path.exists(dest):  # a program seen before leaves the database file as it was
    database.merge_entries(dest, new, _meta())
  return {"timed": len(new), "cached": cached, "skipped": skipped, "db": dest, "seconds": seconds}


def _meta() -> dict:
  dev = jax.local_devices()[0]
  return {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
          "host": f"{platform.machine()} {os.cpu_count()} cores", "date": datetime.date.today().isoformat(),
          "method": "'isolated-traced': the instruction cut out of the compiled program, compiled alone, its thunks' "
                    "traced time (perfmodel/cost/profiler.py)"}

