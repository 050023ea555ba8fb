"""What would a *perfect* model score on this host? The reproducibility floor of the two validations.

  PYTHONPATH=. python benchmarks/host_floor.py [--no-results]

A perfect model of this host knows what a configuration measured before. So each validation's stored
measurements are "predicted" by other measurements of the same configurations, read and scored exactly as the
validation reads and scores a model. No model is involved: nothing here can be tuned.

* `perfmodel validate` (issue 3): the stored sets `benchmarks/perfmodel_measurements_s*_*.json` (3 rounds each;
  the config's value is the median over rounds, as `validate` takes it). MAPE over the training configs and over
  the decode configs (TPOT) separately:
    - one round predicted by the median of its set's other rounds;
    - set A's medians predicting set B's, for two sets of the same session (15-50 minutes apart) and for sets
      of different sessions (another day, often another VM). A model calibrated in one session and validated in
      another is up against the second number.
  and the same at one host speed (each round's measurements divided by its median probe time, the BASE step
  timed around every measurement): the floor of `validate`'s ``mape_speed_normalised``.
* `benchmarks/emulate_validate.py` (issue 4): every committed run of `benchmarks/emulate_validate.json` (git
  history). Each round runs the real job before and after the emulation; the median of the "before" runs
  predicting the median of the "after" runs, mean |error| over the layouts, is how well a perfect emulator can
  be shown to do by one run of that benchmark (the emulation is compared with the median of both, 2R runs
  against R emulations, so this split-half floor is somewhat pessimistic).
Prints one JSON object; appends a row to benchmarks/RESULTS.md unless --no-results.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import itertools
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
EMULATE_JSON = "benchmarks/emulate_validate.json"


# Sessions that ran on one VM boot count as one (the sets of session 12 and 13 were taken 13:56-18:03 on one
# boot; `uptime` said so). Earlier sessions each had a VM of their own.
SAME_HOST = {"s13": "s12"}


def session_of(path: str, rounds: list) -> str:
  """The host a set was measured on: its measurements' boot id (perfmodel/bench.py regime, recorded since
  session 13), else the session prefix of its name (perfmodel_measurements_s12_b.json -> 's12')."""
  boots = {m.get("regime", {}).get("boot_id") for r in rounds for m in r.values()} - {None}
  if len(boots) == 1:
    return boots.pop()
  stem = os.path.basename(path)[len("perfmodel_measurements_"):-len(".json")]
  session = stem.rsplit("_", 1)[0]
  return SAME_HOST.get(session, session)


def _scored(pred: dict, meas: dict, decode: bool) -> list:
  """The validation configs both sets have, as `validate` scores them: the suite's training configs, or its
  decode configs. The calibration anchors timed beside them (c_*, perfmodel/suite.py ANCHORS) are not scored."""
  from perfmodel import suite  # noqa: PLC0415
  scored = {c["name"] for c in (suite.INFER if decode else suite.SUITE)}
  return sorted(n for n in pred if n in meas and n in scored)


def _mape(pred: dict, meas: dict, decode: bool) -> float:
  names = _scored(pred, meas, decode)
  return statistics.mean(abs(pred[n] / meas[n] - 1) * 100 for n in names) if names else float("nan")


def _tau(pred: dict, meas: dict) -> float:
  """Kendall tau over the training configs both sets have, as `validate` scores a model's ranking."""
  from perfmodel import validate  # noqa: PLC0415
  names = _scored(pred, meas, False)
  return validate.kendall_tau([pred[n] for n in names], [meas[n] for n in names])


def _at_probe_speed(rounds: list) -> list:
  """Each measurement divided by its round's median probe time (perfmodel/speed.py: the BASE step timed around
  every measurement): the sets expressed at one host speed, as `validate`'s ``mape_speed_normalised`` does."""
  out = []
  for r in rounds:
    probe = statistics.median(v["probe_s"] for v in r.values() if v.get("probe_s"))
    out.append({n: {**v, "measured_s": v["measured_s"] / probe} for n, v in r.items()})
  return out


def _has(rounds: list, statistic: str) -> bool:
  return statistic == "median" or all(statistic in m for r in rounds for m in r.values())


def perfmodel_floor(paths: list, normalised: bool = False, statistic: str = "median") -> dict:
  """``statistic``: the reading of every measurement (bench.STATISTICS); sets measured before that reading existed
  (p10: session 28) are left out."""
  from perfmodel import rounds as R  # noqa: PLC0415 (reads the files exactly as validate does)
  loaded = {os.path.basename(p): R.load_rounds(p) for p in paths}
  loaded = {k: [{n: R.with_statistic(m, statistic) for n, m in r.items()} for r in v]
            for k, v in loaded.items() if _has(v, statistic)}
  if not loaded:
    return None
  host = {k: session_of(k, v) for k, v in loaded.items()}
  sets = {k: (_at_probe_speed(v) if normalised else v) for k, v in loaded.items() if len(v) >= 2}
  med = {k: {n: statistics.median(r[n]["measured_s"] for r in v if n in r) for n in set().union(*v)}
         for k, v in sets.items()}
  one_round = {}
  for name, rounds in sets.items():
    loo = [{n: statistics.median(o[n]["measured_s"] for j, o in enumerate(rounds) if j != i and n in o) for n in r}
           for i, r in enumerate(rounds)]
    meas = [{n: r[n]["measured_s"] for n in r} for r in rounds]
    one_round[name] = {k: statistics.mean(_mape(p, m, k == "tpot") for p, m in zip(loo, meas))
                       for k in ("train", "tpot")}
  pairs = [dict(reference=a, target=b, same_session=host[a] == host[b],
                train_mape=_mape(med[a], med[b], False), tpot_mape=_mape(med[a], med[b], True),
                train_tau=_tau(med[a], med[b]))
           for a, b in itertools.permutations(sets, 2)]

  def pooled(same):
    sel = [p for p in pairs if p["same_session"] == same]
    return {"train_mape": statistics.median(p["train_mape"] for p in sel),
            "tpot_mape": statistics.median(p["tpot_mape"] for p in sel),
            "train_tau": statistics.median(p["train_tau"] for p in sel),
            "train_tau_at_least_0_9": sum(p["train_tau"] >= 0.9 for p in sel), "ordered_pairs": len(sel)} if sel else None
  return {"statistic": statistic, "sets": sorted(sets), "one_round": one_round,
          "one_round_train_mape_median": statistics.median(v["train"] for v in one_round.values()),
          "same_session": pooled(True), "other_session": pooled(False), "pairs": pairs}


def emulate_floor() -> dict:
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import emulate_validate  # noqa: PLC0415 (its committed_runs: the same walk over git as the re-aggregation)
  runs = []
  for h, when, d in emulate_validate.committed_runs(EMULATE_JSON):
    rounds = d.get("raw_rounds") or []
    lays = list(rounds[0]["layouts"]) if rounds else []
    if not lays or any(not rd["layouts"][k].get("real_after") for rd in rounds for k in lays):
      continue  # runs from before the real job was measured on both sides of the emulation
    errs = {k: 100 * (statistics.median(rd["layouts"][k]["real"]["median"] for rd in rounds)
                      / statistics.median(rd["layouts"][k]["real_after"]["median"] for rd in rounds) - 1)
            for k in lays}
    runs.append({"commit": h, "committed": when[:16], "rounds": len(rounds),
                 "mean_abs_before_vs_after_pct": statistics.mean(abs(v) for v in errs.values()),
                 "emulation_mean_abs_error_pct": d.get("mean_abs_error_pct"),
                 "per_layout_pct": {k: round(v, 1) for k, v in errs.items()}})
  floors = [r["mean_abs_before_vs_after_pct"] for r in runs]
  return {"runs": runs, "median_pct": statistics.median(floors) if floors else None,
          "mean_pct": statistics.mean(floors) if floors else None,
          "runs_at_or_below_2pct": sum(f <= 2.0 for f in floors)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--no-results", action="store_true")
  args = ap.parse_args(argv)
  paths = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "perfmodel_measurements_s*_*.json")))
  out = {"benchmark": "host_floor", "perfmodel": perfmodel_floor(paths),
         "perfmodel_at_probe_speed": perfmodel_floor(paths, normalised=True),
         # the p10 reading (perfmodel/README.md, "Which statistic a step time is"): sets since session 28 only
         "perfmodel_p10": perfmodel_floor(paths, statistic="p10"), "emulate": emulate_floor()}
  for p, q in zip(out["perfmodel"]["pairs"], out["perfmodel_at_probe_speed"]["pairs"]):
    print(f"{p['reference']:>38} -> {p['target']:<38} train {p['train_mape']:5.1f}% ({q['train_mape']:4.1f}% at one "
          f"speed)  TPOT {p['tpot_mape']:5.1f}% ({q['tpot_mape']:4.1f}%)  tau {p['train_tau']:.3f}  "
          f"{'same session' if p['same_session'] else 'other session'}", file=sys.stderr)
  if out["perfmodel_p10"]:
    for p in out["perfmodel_p10"]["pairs"]:
      print(f"{p['reference']:>38} -> {p['target']:<38} p10 reading: train {p['train_mape']:5.1f}%  TPOT "
            f"{p['tpot_mape']:5.1f}%  tau {p['train_tau']:.3f}", file=sys.stderr)
  for r in out["emulate"]["runs"]:
    print(f"emulate run {r['commit']} ({r['committed']}): real before vs after {r['mean_abs_before_vs_after_pct']:.1f}%"
          f"  (emulation's error in that run {r['emulation_mean_abs_error_pct']:.1f}%)", file=sys.stderr)
  print(json.dumps(out))
  if not args.no_results:
    pm, pn, em, p10 = out["perfmodel"], out["perfmodel_at_probe_speed"], out["emulate"], out["perfmodel_p10"]
    f = lambda d: (f"training {d['train_mape']:.1f}% / TPOT {d['tpot_mape']:.1f}% / Kendall tau {d['train_tau']:.3f}, "
                   f">= 0.9 in {d['train_tau_at_least_0_9']} ({d['ordered_pairs']} ordered pairs)")
    row = (f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `PYTHONPATH=. python benchmarks/host_floor.py`"
           f" | offline (stored measurements) | reproducibility floor, a perfect model = another measurement of the "
           f"same configs: perfmodel validate ({len(pm['sets'])} stored 3-round sets): one round vs the other rounds "
           f"training {pm['one_round_train_mape_median']:.1f}%; set vs set, same session {f(pm['same_session'])}; "
           f"other session {f(pm['other_session'])}; at one host speed (each round divided by its median probe) same "
           f"session {f(pn['same_session'])}, other session {f(pn['other_session'])}. emulate_validate ({len(em['runs'])} committed runs): real "
           f"before vs real after the emulation, mean abs over layouts, median {em['median_pct']:.1f}%, mean "
           f"{em['mean_pct']:.1f}%, {em['runs_at_or_below_2pct']} of {len(em['runs'])} runs <= 2%"
           + (f". p10 reading ({len(p10['sets'])} sets since session 28): one round vs the other rounds training "
              f"{p10['one_round_train_mape_median']:.1f}%; set vs set, same session "
              f"{f(p10['same_session']) if p10['same_session'] else 'n/a (one set)'}" if p10 else "") + " |")
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
      fh.write(row + "\n")
  return out


if __name__ == "__main__":
  main()
