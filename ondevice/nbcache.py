"""numba settings and cache hygiene shared by the kernel modules (``matvec.py``, ``planes_kernels.py``).

numba caches a jitted function's machine code per source file and does not notice when something it inlines
from another file changes: an intrinsic (``simd.py``, ``simd_k.py``) or a jitted function of another kernel
module. ``clear_stale(here, deps)`` keeps a stamp of those files next to the module's cache and drops the
module's cached code when any of them changed. ``prefer_512_bit_vectors`` widens LLVM's vectors to zmm.
"""
from __future__ import annotations

import glob
import hashlib
import os

try:
  import numba
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover
  HAVE_NUMBA = False


def prefer_512_bit_vectors() -> None:
  """LLVM vectorises with 256-bit registers on AVX-512 Intel CPUs by default (prefer-256-bit). numba reads its
  CPU features once, at its first compilation, for the whole process, so this only takes effect if no numba
  code was compiled before; ONDEVICE_ZMM=0 or an explicit NUMBA_CPU_FEATURES leaves it alone."""
  if not HAVE_NUMBA or os.environ.get("ONDEVICE_ZMM", "1") == "0" or numba.config.CPU_FEATURES is not None:
    return
  from llvmlite import binding
  feats = binding.get_host_cpu_features().flatten()
  if "+avx512f" in feats.split(","):
    numba.config.CPU_FEATURES = feats + ",-prefer-256-bit"


def clear_stale(here: str, deps: list, anchor) -> None:
  """Drop ``here``'s cached numba code when the source of any file in ``deps`` (or the VNNI setting) changed.
  ``anchor``: any plain function defined in ``here`` (numba's cache locators start from a function)."""
  if not HAVE_NUMBA:
    return
  from numba.core import caching
  from ondevice import simd
  h = hashlib.sha1()
  for d in deps:
    with open(d, "rb") as f:
      h.update(f.read())
  stamp = h.hexdigest()[:16] + ("v" if simd.has_vnni() else "g")
  here = os.path.abspath(here)
  base = os.path.splitext(os.path.basename(here))[0]
  for cls in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator):
    try:
      loc = cls.from_function(anchor, here)
      d = loc.get_cache_path() if loc is not None else None
    except Exception:  # noqa: BLE001 - a locator that does not apply here
      continue
    if not d or not os.path.isdir(d):
      continue
    f = os.path.join(d, f"{base}.deps-stamp")
    old = open(f).read() if os.path.exists(f) else None
    if old != stamp:
      for p in glob.glob(os.path.join(d, f"{base}.*.nb[ic]")):
        try:
          os.remove(p)
        except OSError:
          pass
      try:
        with open(f, "w") as fh:
          fh.write(stamp)
      except OSError:
        pass
