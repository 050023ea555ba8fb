"""Expert placement for Halda: a MoE layer's experts weighted by how often tokens are routed to them.

A MoE layer's bytes are its dense part (attention, router, norms: read whenever the layer runs) plus n_expert
experts of e bytes each (gate, up and down). A token reads only its routed experts, and which ones is known only
once the router has run, so an expert that is not resident is read synchronously when routed. With activation
frequencies f_j (the probability that a token routes to expert j of this layer; sum_j f_j = top_k), keeping the
experts P resident leaves an expected read per token of  sum_{j not in P} f_j * e  bytes. For a given resident
size the hottest experts first is optimal, and as a function of the resident bytes q of one layer that read is
  g(q) = max_i (a_i - s_i q)       (convex, piecewise linear: slope -f_(i) between i and i+1 experts resident)
Spread over c layers with q bytes resident in all, c * g(q / c) = max_i (a_i c - s_i q) is linear in (c, q), so
Halda's MILP takes it exactly (``halda.solve_k``): per device a resident-expert variable q_m (k q_m in RAM) and an
expected read e_m >= a_i (w_m - n_m) - s_i q_m, e_m / disk in the chain and in the device's own disk time.
Halda's layers are alike (w counts layers), so g uses the layers' frequency profiles sorted within each layer
and averaged over layers. The plan's concrete residency (``place``) then fills each window's q_m with the
hottest (layer, expert) pairs of that window's own layers (the last one may be partly resident: pages), and
``expected_read`` gives the per-token bytes of that residency under any frequencies.

Frequencies: measured routing counts (``Experts.counts``, saved by ``python -m ondevice.run --save-expert-counts``),
or without them the uniform prior top_k / n_expert (frequency-blind: every expert alike).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from ondevice.gguf_check import EXPERT_MATS


@dataclasses.dataclass(frozen=True)
class ExpertProfile:
  freq: np.ndarray  # n_layers x n_expert: per-token activation probability, each row sums to n_used
  expert_bytes: int  # one expert of one layer (its gate, up and down)
  source: str

  @property
  def layer_expert_bytes(self) -> int:
    return self.expert_bytes * self.freq.shape[1]


def profile(info, counts: Optional[np.ndarray] = None) -> ExpertProfile:
  """Frequencies from routing counts (n_layers x n_expert tokens routed), or the uniform prior."""
  spec, L = info.moe, info.cfg.n_layers
  e = sum(info.tensors[f"blk.0.{k}.weight"].nbytes for k in EXPERT_MATS) // spec.n_expert
  if counts is None:
    return ExpertProfile(np.full((L, spec.n_expert), spec.n_used / spec.n_expert), e,
                         f"uniform prior (top_k / n_expert = {spec.n_used}/{spec.n_expert})")
  c = np.asarray(counts, np.float64)
  tot = c.sum(axis=1, keepdims=True)
  freq = np.where(tot > 0, c * spec.n_used / np.where(tot > 0, tot, 1), spec.n_used / spec.n_expert)
  return ExpertProfile(freq, e, f"measured ({int(c.sum() / spec.n_used / L)} routed tokens per layer)")


def curve(p: ExpertProfile) -> tuple:
  """The pieces (a_i bytes, s_i) of g(q) = max_i (a_i - s_i q) for the layers' mean sorted profile."""
  f = np.sort(p.freq, axis=1)[:, ::-1].mean(axis=0)
  e = float(p.expert_bytes)
  tail = np.concatenate([np.cumsum(f[::-1])[::-1], [0.0]])  # tail[i] = sum_{j >= i} f_(j)
  return tuple((e * tail[i] + f[i] * i * e, float(f[i])) for i in range(len(f)))


def place(p: ExpertProfile, windows: list, expert_pin: tuple) -> list:
  """[device][cycle] -> {layer: {expert: resident bytes}}: each window's ``expert_pin`` bytes filled with its
  layers' hottest experts (ties: lower expert id first)."""
  out = []
  for m, wins in enumerate(windows):
    out.append([])
    for layers in wins:
      left = expert_pin[m] if m < len(expert_pin) else 0.0
      pairs = sorted(((-p.freq[i, j], i, j) for i in layers for j in range(p.freq.shape[1])))
      res: dict = {}
      for _, i, j in pairs:
        if left <= 0:
          break
        take = min(float(p.expert_bytes), left)
        res.setdefault(i, {})[j] = take
        left -= take
      out[-1].append(res)
  return out


def expected_read(p: ExpertProfile, windows: list, resident: list) -> float:
  """Expected expert bytes per token read from disk for these windows and residency, under p's frequencies."""
  tot = 0.0
  for wins, res in zip(windows, resident):
    for layers, r in zip(wins, res):
      for i in layers:
        kept = np.array([r.get(i, {}).get(j, 0.0) for j in range(p.freq.shape[1])])
        tot += float((p.freq[i] * (p.expert_bytes - kept)).sum())
  return tot


def one_device_latency(t_layer_s: float, ram_bytes: float, disk_Bps: float, n_layers: int, dense_bytes: float,
                       p: ExpertProfile, kv_bytes: float = 0.0, head_s: float = 0.0) -> float:
  """Independent check of the MILP for one device and k = 1: RAM goes to the dense bytes first (each saves a
  byte read per token), then to experts hottest first by the mean sorted profile (each byte saves f < 1)."""
  ram = ram_bytes - kv_bytes * n_layers
  dense = dense_bytes * n_layers
  pin_d = min(dense, ram)
  left = ram - pin_d
  read = dense - pin_d
  for f in np.sort(p.freq, axis=1)[:, ::-1].mean(axis=0):
    q = min(left, p.expert_bytes * n_layers)
    read += f * (p.expert_bytes * n_layers - q)
    left -= q
  return t_layer_s * n_layers + read / disk_Bps + head_s


# ------------------------------------------------------------------ counts files

def save_counts(path: str, info, counts: np.ndarray) -> None:
  with open(path, "w") as f:
    json.dump({"model": os.path.basename(info.path), "n_layers": info.cfg.n_layers, "n_expert": info.moe.n_expert,
               "n_used": info.moe.n_used, "counts": np.asarray(counts, np.int64).tolist()}, f)


def load_counts(path: str, info) -> np.ndarray:
  """Routing counts for this model from a file ``save_counts`` wrote; ValueError (one line, naming the fix)."""
  fix = "pass a file written by `python -m ondevice.run --model <this model> --save-expert-counts FILE`"
  if info.moe is None:
    raise ValueError(f"--expert-counts needs a mixture-of-experts model; {info.path} is dense: drop --expert-counts")
  try:
    with open(path) as f:
      d = json.load(f)
    c = np.asarray(d["counts"], np.float64)
  except FileNotFoundError:
    raise ValueError(f"--expert-counts {path}: no such file; {fix}") from None
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"--expert-counts {path} is not a counts file ({type(e).__name__}); {fix}") from None
  want = (info.cfg.n_layers, info.moe.n_expert)
  if c.shape != want:
    raise ValueError(f"--expert-counts {path} has counts of shape {c.shape}, this model needs {want} "
                     f"(layers x experts); {fix}")
  if not np.isfinite(c).all() or (c < 0).any() or c.sum() == 0:
    raise ValueError(f"--expert-counts {path}: counts must be finite, >= 0 and not all zero; {fix}")
  return c
