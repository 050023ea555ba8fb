"""The one boundary where experiment files become typed configs.

An experiment file is a Python module with ``get_config(arg: str | None) -> ConfigDict`` (big_vision
style: its docstring is the experiment record). ``load('experiments/configs/x.py:runlocal=True',
['--config.model.n_layers=4'])`` imports it, applies command-line overrides to the *locked*
ConfigDict (a typo'd key is an error, never a silent no-op), and converts it with
:func:`framework.config.from_dict`.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import types
from typing import Iterable, Optional, Sequence

from framework import config as config_lib
from framework.config import Config, ConfigError, from_dict


def lock(cd):
  """A config file's ConfigDict, rebuilt from plain dicts (nested ``dict(...)`` sections become ConfigDicts) and
  locked, so a command-line override of a key it does not have is an error."""
  import ml_collections  # noqa: PLC0415 (config files only)
  cd = ml_collections.ConfigDict(cd.to_dict())
  cd.lock()
  return cd


def parse_arg(arg: Optional[str], **defaults) -> types.SimpleNamespace:
  """'runlocal=True,model=tiny' -> namespace(runlocal=True, model='tiny'), typed like the defaults."""
  out = dict(defaults)
  if not arg:
    return types.SimpleNamespace(**out)
  for item in arg.split(","):
    if not item:
      continue
    key, _, value = item.partition("=")
    if key not in defaults:
      raise ConfigError(f"unknown config argument {key!r}; known: {sorted(defaults)}")
    d = defaults[key]
    try:
      if isinstance(d, bool):
        if value.lower() not in ("1", "true", "yes", "", "0", "false", "no"):
          raise ValueError(value)
        out[key] = value.lower() in ("1", "true", "yes", "")
      elif isinstance(d, int):
        out[key] = int(value)
      elif isinstance(d, float):
        out[key] = float(value)
      else:
        out[key] = value
    except ValueError:
      raise ConfigError(f"config argument {key}={value!r} must be {type(d).__name__} (like {key}={d})") from None
  return types.SimpleNamespace(**out)


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # bare strings: --config.data.corpus=/some/path


def load_configdict(spec: str):
  path, _, arg = spec.partition(":")
  p = pathlib.Path(path)
  if not p.exists():
    raise ConfigError(f"config file {path} does not exist (try experiments/configs/quickstart.py)")
  if p.is_dir() or p.suffix != ".py":
    raise ConfigError(f"config {path} is not a Python file: pass experiments/configs/<name>.py[:arg]")
  mod_spec = importlib.util.spec_from_file_location(f"prismllm_config_{p.stem}", p)
  mod = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(mod)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001 - any error in the user's file: say where, not a traceback
    raise ConfigError(f"config file {path} does not import: {_where(e, path)}; fix the file") from None
  if not hasattr(mod, "get_config"):
    raise ConfigError(f"{path} has no get_config(arg) function: add one that returns an ml_collections.ConfigDict "
                      f"(see experiments/configs/quickstart.py)")
  try:
    return mod.get_config(arg or None)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001
    raise ConfigError(f"get_config({arg or None!r}) in {path} raised {_where(e, path)}; fix the file or "
                      f"the argument after ':'") from None


def _where(e: BaseException, path: str) -> str:
  """'SyntaxError: invalid syntax (line 12)' / 'TypeError: ... (line 30)': the line in the config file."""
  line = getattr(e, "lineno", None)
  if line is None:
    tb = e.__traceback__
    while tb is not None:
      if pathlib.Path(tb.tb_frame.f_code.co_filename).resolve() == pathlib.Path(path).resolve():
        line = tb.tb_lineno
      tb = tb.tb_next
  msg = getattr(e, "msg", None) if isinstance(e, SyntaxError) else str(e)
  return f"{type(e).__name__}: {msg}" + (f" (line {line})" if line else "")


def apply_overrides(cd, overrides: Iterable[str]):
  """Applies ['--config.a.b=v', ...] to a ConfigDict; unknown keys raise ConfigError."""
  for ov in overrides:
    if not ov.startswith("--config."):
      raise ConfigError(f"override {ov!r} must look like --config.section.key=value")
    key, eq, value = ov[len("--config."):].partition("=")
    if not eq:
      raise ConfigError(f"override {ov!r} has no '=value'")
    *parents, leaf = key.split(".")
    if parents and parents[0] not in _typed_keys([]) and "extras" in cd and parents[0] in cd["extras"]:
      parents = ["extras"] + parents  # --config.resilience.x is short for --config.extras.resilience.x
      key = "extras." + key
    typed = _typed_keys(parents)
    node = cd
    for i, part in enumerate(parents):
      if part not in node:
        if i == 0 and part in _typed_keys([]):  # a typed section the file did not set
          with node.unlocked() if hasattr(node, "unlocked") else _null():
            node[part] = {}
        else:
          raise ConfigError(f"unknown config key '{'.'.join(parents[:i + 1])}' in {ov!r}")
      node = node[part]
    if leaf not in node and leaf not in typed and ".".join(parents[:1]) != "extras":
      raise ConfigError(f"unknown config key '{key}' in {ov!r}; known keys there: "
                        f"{sorted(set(node.keys()) | typed)}")
    v = _literal(value)
    old = node[leaf] if leaf in node else None
    if isinstance(old, float) and isinstance(v, int) and not isinstance(v, bool):
      v = float(v)
    if isinstance(old, str) and not isinstance(v, str):
      v = value
    try:
      with node.unlocked() if hasattr(node, "unlocked") else _null():
        node[leaf] = v
    except TypeError as e:  # ml_collections keeps each field's type: say which value to pass
      raise ConfigError(f"{ov!r}: {key} must be {type(old).__name__}, got {v!r}") from e
  return cd


def _typed_keys(parents) -> set:
  """Keys the typed config accepts at this path, whether or not the experiment file set them."""
  if not parents:
    return {f.name for f in dataclasses.fields(config_lib.Config)}
  cls = config_lib._SECTION_TYPES.get(parents[0]) if len(parents) == 1 else None
  return {f.name for f in dataclasses.fields(cls)} if cls else set()


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


# Value ranges a config must satisfy to run at all (sizes, counts, rates); types are checked by from_dict.
# (section, key, lowest allowed, lowest is exclusive)
RANGES = (
    ("model", "vocab_size", 1, False), ("model", "d_model", 1, False), ("model", "n_layers", 1, False),
    ("model", "n_heads", 1, False), ("model", "n_kv_heads", 1, False), ("model", "head_dim", 0, False),
    ("model", "d_ff", 0, False), ("model", "max_seq_len", 1, False), ("model", "norm_eps", 0, True),
    ("model", "rope_theta", 0, True), ("model", "init_std", 0, False),
    ("data", "max_bytes", 1, False), ("data", "seq_len", 1, False), ("data", "global_batch", 1, False),
    ("data", "eval_fraction", 0, False),
    ("optim", "lr", 0, False), ("optim", "warmup_steps", 0, False), ("optim", "decay_steps", 0, False),
    ("optim", "min_lr_ratio", 0, False), ("optim", "weight_decay", 0, False), ("optim", "grad_clip", 0, False),
    ("optim", "eps", 0, True),
    ("mesh", "microbatches", 1, False), ("mesh", "virtual_stages", 1, False),
    ("checkpoint", "every", 0, False), ("checkpoint", "keep", 1, False),
    ("train", "steps", 0, False), ("train", "log_every", 1, False), ("train", "eval_every", 0, False),
    ("train", "eval_batches", 1, False), ("train", "sample_tokens", 0, False),
    ("train", "sample_temperature", 0, False), ("train", "peak_flops", 0, False),
)


def check_ranges(cfg: Config) -> Config:
  """Negative sizes, zero batches, ...: one ConfigError naming the key, instead of a crash deep in jax."""
  for section, key, low, exclusive in RANGES:
    v = getattr(getattr(cfg, section), key, None)
    if v is None or isinstance(v, bool):
      continue
    if v < low or (exclusive and v == low):
      op = ">" if exclusive else ">="
      raise ConfigError(f"{section}.{key}={v!r} is out of range: it must be {op} {low}")
  if not cfg.data.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction!r} must be < 1 (it is the held-out share)")
  return cfg


def load(spec: str, overrides: Sequence[str] = ()) -> Config:
  cd = load_configdict(spec)
  apply_overrides(cd, overrides)
  return check_ranges(from_dict(cd))
