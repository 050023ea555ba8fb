"""What a prediction returns (perfmodel/predict.py ``predict``): one record for both modes. Training fills the step
(step_time_s, tokens_per_s, mfu, peak memory, the breakdown), inference the generation (ttft_s, tpot_s,
generation_s); ``to_dict`` is the JSON the CLI prints, with only the fields that apply."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Prediction:
  mode: str  # train | infer
  config: str
  hardware: str
  calibrated: bool
  backends: list  # the cost chain, in the order it asks
  route: Optional[str] = None  # training: compile | rank_program | analytic
  method: Optional[str] = None
  route_detail: Optional[str] = None
  route_fallback_reason: Optional[str] = None
  n_devices: Optional[int] = None
  mesh: Optional[dict] = None
  step_time_s: Optional[float] = None
  tokens_per_s: Optional[float] = None
  mfu: Optional[float] = None
  batch: Optional[int] = None
  prompt_len: Optional[int] = None
  gen_len: Optional[int] = None
  ttft_s: Optional[float] = None
  tpot_s: Optional[float] = None
  generation_s: Optional[float] = None  # infer: prefill + gen_len decode steps
  decode_tokens_per_s: Optional[float] = None
  peak_memory_bytes: Optional[float] = None
  memory_analysis: Optional[dict] = None  # the compiler's own (compile route, inference)
  memory_analytic: Optional[dict] = None
  fits_in_memory: Optional[bool] = None
  flops_per_device: Optional[float] = None
  xla_cost_analysis_flops: Optional[float] = None
  model_flops_per_step: Optional[float] = None
  collective_bytes_per_device: Optional[float] = None
  node_counts: Optional[dict] = None
  rank_param_bytes: Optional[float] = None
  breakdown: Optional[dict] = None  # by node kind / phase / layer, exposed comm, which backend priced how many
  host_device_factor: Optional[float] = None
  composition: Optional[str] = None
  conditionals: Optional[dict] = None
  pipeline_bubble_fraction: Optional[float] = None
  notes: Optional[list] = None
  compiler_flags: Optional[dict] = None  # target_compile: the XLA flag set the program was compiled with, its source
  overlap: Optional[dict] = None  # a framework's overlap options modelled in the timeline, their windows
  assumptions: Optional[list] = None  # where the profile had no published number and the cost model assumed one
  profiled_nodes: Optional[dict] = None  # what timing the program's instructions alone did (profiled backends)
  compile_s: Optional[float] = None  # wall clock of the prediction itself, from here on
  profile_s: Optional[float] = None  # timing the program's instructions alone (0 unless the backend profiles)
  trace_s: Optional[float] = None
  predict_s: Optional[float] = None
  wall_s: Optional[float] = None
  # predict(trace=True): the predicted step (infer: the generation) as placed timeline events, seconds from its
  # start, ending at step_time_s (generation_s); perfmodel/emulate/trace.py writes them. Not part of to_dict.
  events: Optional[list] = dataclasses.field(default=None, repr=False)

  def to_dict(self) -> dict:
    """The JSON the CLI prints: every field that applies to this route; ``total_s`` is the generation's seconds in
    infer mode and the prediction's wall clock on the compile route."""
    out = {k: v for k, v in dataclasses.asdict(dataclasses.replace(self, events=None)).items() if v is not None}
    total = self.generation_s if self.mode == "infer" else self.wall_s
    if total is not None:
      out["total_s"] = total
    return out
