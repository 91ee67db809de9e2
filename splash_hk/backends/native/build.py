"""The native kernel's build: its C++ source (`native/`, shipped in the package) compiled with
the machine's compiler against `jax.ffi.include_dir()`, once per machine and jax version, cached
on disk, loaded and registered with XLA as FFI targets for CPU.

No compiler, or a build that fails: `unavailable()` says why (the backend's refusal, which
`explain` shows) and nothing else changes. The SIMD path is chosen at run time inside the
library (one build for any x86-64; a portable path elsewhere), so the build has no `-march`.

Environment: `CXX` (the compiler, default `g++`, else `c++`), `SPLASH_HK_NATIVE_CACHE` (where
builds are kept, default `~/.cache/splash_hk/native`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from absl import logging
import jax
import jaxlib

SOURCE_DIR = Path(__file__).parent  # kernel.h and handlers.cc beside this file
SOURCES = ("kernel.h", "handlers.cc")
# FFI target name -> the handler symbol in handlers.cc.
TARGETS = {"splash_hk_paged_decode": "SplashPagedDecode",
           "splash_hk_cache_decode": "SplashCacheDecode",
           "splash_hk_page_bounds": "SplashPageBounds"}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 600


def compiler() -> str | None:
  """The C++ compiler to build with: `CXX`, else g++ or c++ on PATH; None when there is none."""
  named = os.environ.get("CXX")
  if named:
    return shutil.which(named)
  return shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
  return Path(os.environ.get("SPLASH_HK_NATIVE_CACHE") or
              Path.home() / ".cache" / "splash_hk" / "native")


def build_key(cxx: str) -> str:
  """What a build depends on: the sources, jax and jaxlib versions, the compiler and the
  machine; a change in any of them is a new build."""
  digest = hashlib.sha256()
  for name in SOURCES:
    digest.update((SOURCE_DIR / name).read_bytes())
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
  for part in (jax.__version__, jaxlib.__version__, version, platform.machine(), " ".join(FLAGS)):
    digest.update(part.encode())
  return digest.hexdigest()[:20]


def compile_library(cxx: str, target: Path) -> None:
  """Compiles the sources into `target` (written whole or not at all); raises on failure."""
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    out = Path(tmp) / target.name
    command = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE_DIR / "handlers.cc"),
               "-o", str(out), "-lpthread"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
      raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}): "
                         f"{done.stderr.strip()[-2000:]}")
    os.replace(out, target)


@contextlib.contextmanager
def _locked(path: Path):
  """Holds an exclusive lock on `path` (builds in parallel processes wait for each other)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def library_path() -> Path:
  """The built library for this machine and jax, built now when not cached; raises why not."""
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler was found (set CXX, or install g++)")
  target = cache_dir() / f"splash_native_{build_key(cxx)}.so"
  if not target.exists():
    with _locked(target.with_suffix(".lock")):
      if not target.exists():
        logging.info("splash_hk: building the native kernel into %s", target)
        compile_library(cxx, target)
  return target


@functools.cache
def _load() -> str | None:
  """Builds (or finds) the library, loads it and registers its targets once per process;
  returns why not, or None."""
  if platform.system() != "Linux":
    return f"it is built for Linux only (this is {platform.system()})"
  try:
    lib = ctypes.cdll.LoadLibrary(str(library_path()))
    for name, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as failure:
    reason = f"its build failed: {failure}"
    logging.warning("splash_hk: the native kernel is unavailable: %s", reason)
    return reason
  return None


def unavailable() -> str | None:
  """Why the native kernel cannot run in this process (no compiler, a failed build), or None
  (it is built, loaded and registered)."""
  return _load()
