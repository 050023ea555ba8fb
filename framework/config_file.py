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
    if isinstance(d, bool):
      out[key] = value.lower() in ("1", "true", "yes", "")
    elif isinstance(d, int):
      out[key] = int(value)
    elif isinstance(d, float):
      out[key] = float(value)
    else:
      out[key] = value
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
  mod_spec = importlib.util.spec_from_file_location(f"prismllm_config_{p.stem}", p)
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  if not hasattr(mod, "get_config"):
    raise ConfigError(f"{path} has no get_config(arg) function")
  return mod.get_config(arg or None)


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


def load(spec: str, overrides: Sequence[str] = ()) -> Config:
  cd = load_configdict(spec)
  apply_overrides(cd, overrides)
  return from_dict(cd)
