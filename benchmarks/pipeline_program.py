"""What a pipeline schedule compiles to at scale: per-device matmul FLOPs and peak memory of a target-compiled step.

  python -m benchmarks.pipeline_program --config.model.remat=minimal --config.mesh.schedule=1f1b
  python -m benchmarks.pipeline_program --config.model.remat=full --config.mesh.virtual_stages=2

A Llama-2-70B-shaped model (80 layers, d_model 8192, d_ff 28672, 64 query / 8 KV heads, vocab 32000, sequence 4096,
bf16 compute, f32 parameters and moments, cuDNN attention) on tensor 8 x pipeline 4 = 32 H100s, 16 micro-batches
of one sequence (a Megatron row's layout); any ``--config.*`` override applies on top. The step is compiled for
the target (perfmodel.program.target_train_step, compile-only GPU devices, about 20 s on 2 cores); its HLO becomes
the performance model's graph, each stage's conditionals weighted by the schedule table (perfmodel/pipeline.py),
and the dot FLOPs of each stage's step are summed. Printed (one JSON object): those per-stage FLOPs, the matmul
model FLOPs per device ``6 N_matmul tokens / devices`` (cuDNN attention is a custom call, not a dot, so attention
is left out of both), their ratio, the compiler's peak memory per device, the table's bubble and stash slots.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from framework.config import validate
from framework.config_file import load
from perfmodel import hardware, pipeline as branches, program
from perfmodel.cost import chain as costs
from perfmodel.graph import from_hlo as graph_lib

BASE = ["--config.model.vocab_size=32000", "--config.model.d_model=8192", "--config.model.n_layers=80",
        "--config.model.n_heads=64", "--config.model.n_kv_heads=8", "--config.model.head_dim=128",
        "--config.model.d_ff=28672", "--config.model.max_seq_len=4096", "--config.model.attention=cudnn",
        "--config.data.seq_len=4096", "--config.data.global_batch=16", "--config.mesh.data=1", "--config.mesh.fsdp=1",
        "--config.mesh.tensor=8", "--config.mesh.pipeline=4", "--config.mesh.microbatches=16",
        "--config.mesh.form=shard_map"]


def stage_dot_flops(g, chain, sched, stage: int) -> float:
  """Dot FLOPs of one stage's step: the graph's conditionals weighted by that stage's schedule row."""
  branches.resolve(g, chain, sched, stage=stage)
  flops = sum(n.flops * k for n, k in g.walk() if n.kind == "dot")
  for reg in g.regions.values():  # back to unresolved for the next stage
    reg.nodes[:] = [dataclasses.replace(n, branch_weights=()) if n.branches else n for n in reg.nodes]
  return flops


def main(overrides: list) -> dict:
  cfg = load("experiments/configs/llama3_70b.py", BASE + list(overrides))
  n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.pipeline * cfg.mesh.sequence
  cfg = validate(cfg, n)
  t0 = time.perf_counter()
  cap = program.target_train_step(cfg, "h100")
  g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
  chain = costs.make_chain(hardware.load("h100"), "roofline")
  sched = branches.schedule_of(cfg)
  per_stage = [stage_dot_flops(g, chain, sched, s) for s in range(cfg.mesh.pipeline)]
  m = cfg.model
  n_matmul = m.n_layers * (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.hd + m.n_heads * m.hd * m.d_model
                           + m.mlp_matrices * m.d_model * m.ff) + m.d_model * m.vocab_size
  model_flops = 6 * n_matmul * cfg.data.global_batch * cfg.data.seq_len / n
  return {"overrides": list(overrides), "compile_s": round(time.perf_counter() - t0, 1),
          "peak_GiB": round(cap.memory["peak_bytes"] / 2**30, 2),
          "dot_TFLOP_per_stage": [round(f / 1e12, 1) for f in per_stage],
          "matmul_model_TFLOP_per_device": round(model_flops / 1e12, 1),
          "ratio_busiest_stage": round(max(per_stage) / model_flops, 3),
          "bubble": round(sched.bubble_fraction(), 4), "stash_slots": sched.n_slots}


def overrides_of(argv: list) -> list:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_program", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  _, rest = ap.parse_known_args(argv)
  bad = [x for x in rest if not x.startswith("--config.")]
  if bad:
    ap.error(f"unrecognised arguments {bad} (config overrides look like --config.mesh.schedule=1f1b)")
  return rest


if __name__ == "__main__":
  print(json.dumps(main(overrides_of(sys.argv[1:]))))
