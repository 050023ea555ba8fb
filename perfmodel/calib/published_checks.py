"""Per-row plausibility checks of a published row's prediction: MFU against the chip's best matmul, memory fit.

Every published row ran, so a prediction above what the chip's matmul unit reaches, or a program that does not fit
the chip's HBM, says the program is not the one the row ran. :func:`memory_diagnosis` names which: a feature the row
ran that the program lacks (its memory saving estimated from the analytic terms of ``perfmodel.memory``), or, when
nothing the row ran is missing, the mapping (or the model) with the program's largest terms.
"""
from __future__ import annotations

from typing import Optional

from perfmodel import hardware
from perfmodel.calib import published as P
from perfmodel.calib import published_mapping as M

GIB = 2 ** 30


def best_matmul_fraction(profile: str, precision: str = "bf16") -> tuple:
  """(best achieved fraction of the bf16 peak a matmul reaches on the chip, source), (None, why) without a curve.

  The profile's published matmul curve (its highest point, or its ``max_fraction``: the best shape found); TPU
  profiles without one use the TPU v5e curve, as the pricing does. fp8 rows: the fp8 curve times fp8 / bf16 peak."""
  from perfmodel.cost import physical  # noqa: PLC0415
  hw = hardware.load(profile)
  eff = hw.efficiency or {}
  key = "matmul_fp8" if precision == "fp8" else "matmul"
  curve, src = eff.get(key), f"{profile} efficiency.{key}"
  if curve is None and key == "matmul" and hw.device_kind.startswith("TPU"):
    stand_in = physical.ASSUMED["matmul"][0]
    curve, src = hardware.load(stand_in).efficiency["matmul"], f"{stand_in} efficiency.matmul (stand-in, as priced)"
  if curve is None:
    return None, f"{profile}: no published {key} curve"
  best = max([y for _, y in curve["value"]] + [curve.get("max_fraction", {}).get("value", 0.0)])
  if key == "matmul_fp8":
    best *= hw.peak("f8e4m3fn") / hw.peak("bf16")
  return best, src


def mfu_flag(r: P.PublishedRun, pred: dict) -> Optional[dict]:
  """The flag when the predicted MFU exceeds the chip's best matmul fraction, else None. ``program_flop_fraction``:
  the program's own FLOPs per device over the predicted step and the bf16 peak, beside it."""
  mfu = pred.get("mfu")
  best, src = best_matmul_fraction(r.hardware, r.precision)
  if mfu is None or best is None or mfu <= best:
    return None
  executed = pred.get("flops_per_device")
  return {"flag": "mfu_above_best_matmul", "mfu": mfu, "best_matmul_fraction": best, "source": src,
          "program_flop_fraction": executed / (pred["step_time_s"] * P.bf16_peak(r.hardware)) if executed else None}


def _program_has(features: dict, name: str, program: dict) -> bool:
  return all(program.get(k) == v for k, v in M.feature_pairs(name, features[name]).items())


def memory_diagnosis(r: P.PublishedRun, features: dict, program_overrides: list, pred: dict) -> str:
  """Why the row's program does not fit the chip: a missing feature (with its estimated saving) or the mapping."""
  from perfmodel import memory  # noqa: PLC0415
  cap = hardware.load(r.hardware).mem_bytes
  mem = pred.get("memory_analysis") or {}
  peak = mem.get("needed", pred.get("peak_memory_bytes")) or 0.0
  program = {o.split("=", 1)[0][len("--config."):]: o.split("=", 1)[1] for o in program_overrides}
  program = {k: _literal(v) for k, v in program.items()}
  terms = memory.analytic(M.build_config(program_overrides, r.n_chips))
  missing = [n for n in features if n not in ("recompute", "program_layers") and not _program_has(features, n, program)]
  saves, words, others = 0.0, [], []
  dp = r.data
  if "optimizer_sharding" in missing and features["optimizer_sharding"].value == "data" and dp > 1:
    saves += terms.opt_state * (1 - 1 / dp)
    words.append(f"ZeRO-1 (optimizer state {terms.opt_state / GIB:.1f} GiB replicated over dp={dp}; sharded "
                 f"{terms.opt_state / dp / GIB:.1f} GiB)")
  if "master_weights" in missing and features["master_weights"].value == "f32":
    shard = dp if features["optimizer_sharding"].value == "data" else 1
    s = terms.params * (0.5 - 1 / shard)  # fp32 parameters -> bf16 copy + fp32 master sharded with the optimizer
    text = (f"fp32 master weights (fp32 parameters {terms.params / GIB:.1f} GiB -> bf16 {terms.params / 2 / GIB:.1f} "
            f"+ master {terms.params / shard / GIB:.1f} GiB)")
    if s > 0:
      saves += s
      words.append(text)
    else:
      others.append(f"{text}, which adds {-s / GIB:.1f} GiB")
  others += [f"{n} {features[n].value}" for n in missing if n not in ("optimizer_sharding", "master_weights")]
  largest = max((("parameters", terms.params), ("optimizer state", terms.opt_state), ("gradients", terms.grads),
                 ("activations", terms.activations), ("logits", terms.logits)), key=lambda kv: kv[1])
  largest = f"largest analytic term (estimate) {largest[0]} {largest[1] / GIB:.1f} GiB"
  head = f"needs {peak / GIB:.1f} GiB of {cap / GIB:.1f} GiB"
  if "RESOURCE_EXHAUSTED" in mem.get("compile_error", ""):
    head += " (the compiler stopped: RESOURCE_EXHAUSTED)"
  tail = f"; also not in the program: {', '.join(others)}" if others else ""
  if not words:
    return (f"mapping or model: {head} with no memory-saving feature of the row missing; {largest} "
            f"(remat {features['recompute'].value}){tail}")
  left = peak - saves
  verdict = (f"fits with them ({left / GIB:.1f} GiB)" if left <= cap else
             f"still {left / GIB:.1f} GiB with them: also the mapping or another feature ({largest})")
  return f"needs {' and '.join(words)}: {head}, {verdict}{tail}"


def _literal(v: str):
  if v in ("True", "False"):
    return v == "True"
  try:
    return int(v)
  except ValueError:
    try:
      return float(v)
    except ValueError:
      return v
