"""BUILD cannot drift: every library and test file belongs to a Bazel target.

BUILD and the .bzl files it loads are Starlark, which (for what they use) is
Python: they are evaluated here with stand-ins for Bazel's rules that record
each target's files, so the check needs no Bazel and runs in `make test`.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap
import types
from typing import Any
from xml.etree import ElementTree

import pytest

ROOT = pathlib.Path(__file__).parent.parent
RULES = ("py_library", "py_binary", "py_test", "cc_binary")


def _label_path(root: pathlib.Path, label: str) -> pathlib.Path | None:
  """The file a label names ("//pkg:file", "file"), or None for a target (":name")."""
  if label.startswith((":", "@")):
    return None
  if label.startswith("//"):
    package, _, name = label[2:].partition(":")
    return root / package / name
  return root / label


def build_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The project's BUILD files: the root's and its packages' (not the vendored ones)."""
  found = [root / "BUILD", *root.glob("*/BUILD"), *root.glob("*/*/BUILD")]
  top = lambda f: f.relative_to(root).parts[0]  # bazel-*: Bazel's links to its output trees
  return [f for f in found if f.is_file() and top(f) != "third_party"
          and not top(f).startswith(("bazel-", "."))]


def read_targets(root: pathlib.Path) -> dict[str, dict[str, Any]]:
  """Evaluates every BUILD file; returns {label: {"rule", "srcs", "size", ...}}.

  A target of the root package is keyed by its name ("test_masks"), any other by
  its label ("//examples/train:train").
  """
  targets: dict[str, dict[str, Any]] = {}
  for build in build_files(root):
    _read_package(root, build.parent.relative_to(root).as_posix().strip("."), targets)
  return targets


def _read_package(root: pathlib.Path, package: str, targets: dict[str, dict[str, Any]]) -> None:
  """Evaluates root/package/BUILD into `targets`."""
  here = root / package

  def rule(kind: str):
    def record(name: str, **attrs: Any) -> None:
      key = f"//{package}:{name}" if package else name
      if key in targets:
        raise ValueError(f"BUILD defines {key!r} twice")
      srcs = [_label_path(here, s) if not s.startswith("//") else _label_path(root, s)
              for s in attrs.get("srcs", [])]
      targets[key] = {**attrs, "rule": kind, "srcs": [s for s in srcs if s is not None]}
    return record

  def glob(include: list[str], exclude: tuple[str, ...] = (), **_: Any) -> list[str]:
    drop = {p for pattern in exclude for p in here.glob(pattern)}
    return sorted(str(p.relative_to(here)) for pattern in include for p in here.glob(pattern)
                  if p.is_file() and p not in drop)

  def ignore(*_: Any, **__: Any) -> None:
    return None

  native = types.SimpleNamespace(glob=glob, package_name=lambda: package,
                                 **{kind: rule(kind) for kind in RULES})
  scope: dict[str, Any] = {"glob": glob, "package": ignore, "exports_files": ignore,
                           "filegroup": ignore, **{kind: rule(kind) for kind in RULES}}

  def load(label: str, *names: str, **aliases: str) -> None:
    bzl: dict[str, Any] = {"native": native}
    exec(compile(_label_path(root, label).read_text(), label, "exec"), bzl)  # noqa: S102
    scope.update({n: bzl[n] for n in names})
    scope.update({alias: bzl[n] for alias, n in aliases.items()})

  scope["load"] = load
  build = here / "BUILD"
  exec(compile(build.read_text(), str(build.relative_to(root)), "exec"), scope)  # noqa: S102


def _label(key: str) -> str:
  return key if key.startswith("//") else f"//:{key}"


def drift(root: pathlib.Path) -> list[str]:
  """What BUILD misses or names wrongly, one line each; empty when in sync."""
  targets = read_targets(root)
  problems = []
  covered = {s.resolve() for t in targets.values() for s in t["srcs"]}
  tested = {s.resolve() for t in targets.values() if t["rule"] == "py_test" for s in t["srcs"]}
  files = sorted([*root.glob("tests/*.py"), *root.glob("splash_hk/**/*.py"),
                  *root.glob("examples/**/*.py"), *root.glob("benchmarks/**/*.py")])
  for f in files:
    where = f.relative_to(root)
    if f.resolve() not in covered:
      problems.append(f"{where} is in no BUILD target's srcs")
    elif f.name.startswith("test_") and f.parent.name == "tests" and f.resolve() not in tested:
      problems.append(f"{where} is a test file but in no py_test")
  for name, t in targets.items():
    for s in t["srcs"]:
      if not s.is_file():
        problems.append(f"{_label(name)} names {s.relative_to(root)}, which does not exist")
    if t["rule"] == "py_test" and "size" not in t:
      problems.append(f"{_label(name)} has no size")
  return problems


def test_build_covers_every_file():
  assert drift(ROOT) == []


def binary_modules(root: pathlib.Path) -> dict[str, str]:
  """{module name `python -m` starts: its py_binary's label} for every binary in BUILD.

  A binary's main file is a module ("examples.train.train"); a package holding it and a
  `__main__.py` is one too ("examples.train").
  """
  modules = {}
  for label, t in read_targets(root).items():
    if t["rule"] != "py_binary":
      continue
    for src in t["srcs"]:
      parts = src.relative_to(root).with_suffix("").parts
      if src.name == "__main__.py":
        parts = parts[:-1]
      if src.name == "__main__.py" or src.name == t.get("main", "").rpartition("/")[2]:
        modules[".".join(parts)] = _label(label)
  return modules


def unstarted_binaries(root: pathlib.Path) -> list[str]:
  """Each binary a test file names as a module (what it runs with `python -m`) that is not in
  its py_test's data, one line each: Bazel's sandbox holds only what the target carries."""
  modules, problems = binary_modules(root), []
  for name, t in read_targets(root).items():
    if t["rule"] != "py_test":
      continue
    package = _label(name).partition(":")[0]
    data = {package + d if d.startswith(":") else d for d in t.get("data", [])}
    for src in t["srcs"]:
      named = {node.value for node in ast.walk(ast.parse(src.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
      for module in sorted(named & modules.keys()):
        if modules[module] not in data:
          problems.append(f"{_label(name)} starts {module} but its data lacks {modules[module]}")
  return problems


def test_every_binary_a_test_starts_is_in_its_data():
  assert unstarted_binaries(ROOT) == []


def test_a_started_binary_missing_from_data_is_reported(tmp_path):
  root = _tree(tmp_path, """
      py_binary(name = "tool", srcs = ["tools/tool.py"], main = "tools/tool.py")
      py_test(name = "test_a", srcs = ["tests/test_a.py"], size = "small")
      py_test(name = "test_b", srcs = ["tests/test_b.py"], size = "small", data = [":tool"])
      """, ["tools/tool.py", "tests/test_a.py", "tests/test_b.py"])
  for test in ("test_a", "test_b"):
    (root / "tests" / f"{test}.py").write_text('import sys\nCMD = [sys.executable, "-m", "tools.tool"]\n')
  assert unstarted_binaries(root) == ["//:test_a starts tools.tool but its data lacks //:tool"]


def _carried(targets: dict[str, dict[str, Any]], key: str) -> set[pathlib.Path]:
  """The files a target and the root package's targets it depends on (":name") carry."""
  files: set[pathlib.Path] = set()
  seen, stack = set(), [key]
  while stack:
    name = stack.pop()
    if name in seen or name not in targets:
      continue
    seen.add(name)
    files |= {s.resolve() for s in targets[name]["srcs"]}
    stack += [d[1:] for d in targets[name].get("deps", []) if d.startswith(":")]
  return files


def unresolved_test_imports(root: pathlib.Path) -> list[str]:
  """Each module of tests/ a test file imports that its py_test does not carry (in its srcs or a
  dependency's), one line each: Bazel's sandbox holds only those, where pytest sees the folder."""
  targets, problems = read_targets(root), []
  for name, t in targets.items():
    if t["rule"] != "py_test":
      continue
    carried = _carried(targets, name)
    for src in t["srcs"]:
      tree = ast.parse(src.read_text())
      imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                  for a in n.names}
      imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                   if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
      for module in sorted(imported):
        path = root / "tests" / f"{module}.py"
        if path.is_file() and path.resolve() not in carried:
          problems.append(f"{_label(name)} imports tests/{module}.py, which it does not carry")
  return problems


def test_every_tests_module_a_test_imports_is_carried():
  assert unresolved_test_imports(ROOT) == []


def test_an_import_of_another_test_file_is_reported(tmp_path):
  root = _tree(tmp_path, """
      py_library(name = "support", srcs = ["tests/cases.py"])
      py_test(name = "test_a", srcs = ["tests/test_a.py"], size = "small", deps = [":support"])
      py_test(name = "test_b", srcs = ["tests/test_b.py"], size = "small", deps = [":support"])
      """, ["tests/cases.py", "tests/test_a.py", "tests/test_b.py"])
  (root / "tests" / "test_a.py").write_text("import cases\nimport numpy\n")
  (root / "tests" / "test_b.py").write_text("import test_a\nfrom cases import X\n")
  assert unresolved_test_imports(root) == ["//:test_b imports tests/test_a.py, which it does not carry"]


def test_every_test_file_has_a_sized_py_test_of_its_own():
  targets = read_targets(ROOT)
  for f in sorted(ROOT.glob("tests/test_*.py")):
    owners = [n for n, t in targets.items()
              if t["rule"] == "py_test" and f.resolve() in {s.resolve() for s in t["srcs"]}]
    assert owners == [f.stem], f"{f.name}: py_test targets {owners}, want [{f.stem!r}]"
    assert targets[f.stem]["size"] in ("small", "medium", "large", "enormous")


def test_binaries_live_in_their_own_packages():
  targets = read_targets(ROOT)
  for label in ("//examples/train:train", "//examples/train:launch", "//examples/serve:serve",
                "//benchmarks:bench", "quickcheck"):
    assert targets[label]["rule"] == "py_binary", label
  library = {s.resolve() for s in targets["splash_hk"]["srcs"]}
  assert not [s for s in library if s.is_relative_to(ROOT / "examples")
              or s.is_relative_to(ROOT / "benchmarks")]


def _tree(tmp_path: pathlib.Path, build: str, files: list[str]) -> pathlib.Path:
  for f in files:
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).write_text("")
  (tmp_path / "BUILD").write_text(textwrap.dedent(build))
  return tmp_path


@pytest.mark.parametrize("build, files, want", [
    ("""
     py_library(name = "lib", srcs = ["splash_hk/a.py"])
     py_test(name = "test_a", srcs = ["tests/test_a.py"], size = "small")
     """, ["splash_hk/a.py", "splash_hk/b.py", "tests/test_a.py"],
     ["splash_hk/b.py is in no BUILD target's srcs"]),
    ("""
     py_library(name = "lib", srcs = glob(["splash_hk/**/*.py"]) + ["tests/test_a.py"])
     """, ["splash_hk/sub/a.py", "tests/test_a.py"],
     ["tests/test_a.py is a test file but in no py_test"]),
    ("""
     py_test(name = "test_a", srcs = ["tests/test_a.py", "tests/gone.py"])
     """, ["tests/test_a.py"],
     ["//:test_a names tests/gone.py, which does not exist", "//:test_a has no size"]),
    ("""
     py_library(name = "lib", srcs = glob(["splash_hk/**/*.py"], exclude = ["splash_hk/x/*"]))
     """, ["splash_hk/a.py", "splash_hk/x/b.py"],
     ["splash_hk/x/b.py is in no BUILD target's srcs"]),
])
def test_drift_is_reported(tmp_path, build, files, want):
  assert drift(_tree(tmp_path, build, files)) == want


def test_drift_reads_the_packages_build_files(tmp_path):
  root = _tree(tmp_path, 'py_library(name = "lib", srcs = ["splash_hk/a.py"])\n',
               ["splash_hk/a.py", "examples/train/a.py", "examples/train/b.py", "benchmarks/c.py"])
  (root / "examples" / "train" / "BUILD").write_text(
      'py_binary(name = "a", srcs = ["a.py", "//splash_hk:gone.py"])\n')
  assert drift(root) == ["benchmarks/c.py is in no BUILD target's srcs",
                         "examples/train/b.py is in no BUILD target's srcs",
                         "//examples/train:a names splash_hk/gone.py, which does not exist"]


def test_drift_sees_through_the_py_pytest_macro(tmp_path):
  root = _tree(tmp_path, """
      load("//bazel_rules:pytest.bzl", "py_pytest")
      py_pytest(name = "test_a", src = "tests/test_a.py", size = "small")
      """, ["tests/test_a.py", "tests/test_b.py", "bazel_rules/pytest_main.py"])
  (root / "bazel_rules" / "pytest.bzl").write_text((ROOT / "bazel_rules" / "pytest.bzl").read_text())
  assert drift(root) == ["tests/test_b.py is in no BUILD target's srcs"]


def _run_shard(tmp_path: pathlib.Path, index: int, total: int) -> tuple[int, list[str], bool]:
  """Runs bazel_rules/pytest_main.py as Bazel runs shard `index` of `total`."""
  xml = tmp_path / f"shard{index}.xml"
  status = tmp_path / f"status{index}"
  env = {**os.environ, "TEST_TOTAL_SHARDS": str(total), "TEST_SHARD_INDEX": str(index),
         "TEST_SHARD_STATUS_FILE": str(status), "XML_OUTPUT_FILE": str(xml),
         "TEST_TMPDIR": str(tmp_path)}
  proc = subprocess.run([sys.executable, str(ROOT / "bazel_rules" / "pytest_main.py"),
                         str(tmp_path / "test_five.py")],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
  names = ([case.get("name") for case in ElementTree.parse(xml).iter("testcase")]
           if xml.exists() else [])
  return proc.returncode, names, status.exists()


def test_bazel_shards_split_the_tests_exactly_once(tmp_path):
  (tmp_path / "test_five.py").write_text(
      "import pytest\n\n@pytest.mark.parametrize('i', range(5))\ndef test_n(i):\n  pass\n")
  runs = [_run_shard(tmp_path, index, 3) for index in range(3)]
  assert [code for code, _, _ in runs] == [0, 0, 0]
  assert all(touched for _, _, touched in runs)
  names = [n for _, shard, _ in runs for n in shard]
  assert sorted(names) == sorted(f"test_n[{i}]" for i in range(5))
  assert [len(shard) for _, shard, _ in runs] == [2, 2, 1]


def test_a_bazel_shard_without_tests_fails(tmp_path):
  (tmp_path / "test_five.py").write_text("def test_one():\n  pass\n")
  code, names, _ = _run_shard(tmp_path, 1, 2)
  assert code != 0 and names == []
