"""Words that name code still name code: every file name and every backticked dotted name of
ours (under splash_hk or sh, or starting with one of our modules) that a comment or docstring of
the library, tests, bench or examples mentions resolves."""

from __future__ import annotations

import ast
import importlib
import io
import pathlib
import re
import tokenize

import jax

ROOT = pathlib.Path(__file__).parent.parent
SOURCES = sorted(p for d in ("splash_hk", "tests", "benchmarks", "examples", "scripts")
                 for p in (ROOT / d).rglob("*.py"))
# Files a comment may name: ours, the contract beside the checkout (../shared, outside Bazel's
# sandbox), and JAX's (the kernels we adapt).
FILES = ({p.name for d in ("splash_hk", "tests", "benchmarks", "examples", "scripts", "bazel_rules",
                           "docs") for p in (ROOT / d).rglob("*") if p.is_file()}
         | {"DESIGN.md"}
         | {p.name for p in ROOT.glob("*") if p.is_file()}
         | {p.name for p in pathlib.Path(jax.__file__).parent.rglob("*.py")})
EXTENSIONS = ("py", "sh", "bzl", "json", "png", "md", "txt")
FILE = re.compile(r"(?<![\w.:/])((?:[\w-]+/)*[\w-]+\.(?:" + "|".join(EXTENSIONS) + r"))\b")
BACKTICKED = re.compile(r"`([A-Za-z_][\w.]*\.[A-Za-z_]\w*)[`(\[]")
# Our modules (and packages) by their last name ("plan" -> splash_hk.backends.xla.plan and
# splash_hk.backends.tpu.plan), for references that start with one (any of them may hold it);
# names that are also parameters (`config.block_sizes`, `kv_cache.length`) are left out.
PARAMETERS = {"config", "kv_cache"}
MODULES: dict[str, tuple[str, ...]] = {}
for _path in sorted(p for d in ("splash_hk", "benchmarks", "examples")
                    for p in (ROOT / d).rglob("*.py")):
  _parts = _path.relative_to(ROOT).with_suffix("").parts
  _parts = _parts[:-1] if _parts[-1] == "__init__" else _parts
  if _parts[-1] not in PARAMETERS | {"__main__"}:
    MODULES[_parts[-1]] = MODULES.get(_parts[-1], ()) + (".".join(_parts),)
MODULES.update({"sh": ("splash_hk",), "shx": ("splash_hk.flax",)})


def _resolves(name: str) -> bool:
  """Whether `a.b.c` names something, when `a` is one of our modules (else it is not ours)."""
  first, *rest = name.split(".")
  if first not in MODULES or name.endswith(tuple("." + e for e in EXTENSIONS)):
    return True
  return any(_resolves_in(module, rest) for module in MODULES[first])


def _resolves_in(module: str, rest: list[str]) -> bool:
  try:
    obj = importlib.import_module(module)
  except ImportError:
    return module == "splash_hk.flax"  # the [flax] extra may be absent
  for i, attr in enumerate(rest):
    if hasattr(obj, attr):
      obj = getattr(obj, attr)
      continue
    try:
      obj = importlib.import_module(".".join([module, *rest[:i + 1]]))
    except ImportError:
      return False
  return True


def prose(source: str) -> str:
  """The comments and docstrings of a Python source, one after another."""
  parts = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      parts.append(ast.get_docstring(node) or "")
  return "\n".join(parts)


def broken(paths: list[pathlib.Path]) -> list[str]:
  """Every mention in `paths` that names no file of ours (or JAX's) or nothing of ours."""
  out = []
  for path in paths:
    text = prose(path.read_text())
    out += [f"{path.name}: {f}" for f in FILE.findall(text) if pathlib.PurePath(f).name not in FILES]
    out += [f"{path.name}: {n}" for n in BACKTICKED.findall(text) if not _resolves(n)]
  return out


def test_every_reference_resolves():
  assert broken(SOURCES) == []


def test_the_check_can_fail(tmp_path):
  stale = tmp_path / "stale.py"
  stale.write_text('"""See `blocks.PER_ROW_WORK`, `splash_hk.masks.plan_blocks()` and\n'
                   'tests/test_triton.py; `plan.PER_ROW_WORK` and test_lse.py are right."""\n'
                   'x = "`blocks.GONE` in code, not prose"  # but `sh.masks.Gone` here\n')
  assert broken([stale]) == ["stale.py: tests/test_triton.py", "stale.py: sh.masks.Gone",
                             "stale.py: blocks.PER_ROW_WORK",
                             "stale.py: splash_hk.masks.plan_blocks"]
