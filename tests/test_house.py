"""The shape of the house: small functions and files, and an import graph without circles."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 350


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of a function's body, its docstring left out."""
  body = node.body
  if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]
  return node.end_lineno - body[0].lineno + 1


def oversized(package: pathlib.Path) -> list[str]:
  """Files over MAX_FILE_LINES and function bodies over MAX_FUNCTION_LINES, one line each."""
  problems = []
  for path in sorted(package.rglob("*.py")):
    source = path.read_text()
    where = path.relative_to(package.parent)
    if len(source.splitlines()) > MAX_FILE_LINES:
      problems.append(f"{where}: {len(source.splitlines())} lines")
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_FUNCTION_LINES:
        problems.append(f"{where}:{node.lineno} {node.name}: {_body_lines(node)} lines")
  return problems


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
  """{module: the package's modules it imports}, package __init__ files included."""
  name = package.name
  modules = {}
  for path in package.rglob("*.py"):
    parts = path.relative_to(package.parent).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {}
  for module, path in modules.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module:  # a submodule, else the module
        targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                       else node.module for a in node.names)
    graph[module] = {t for t in targets if t in modules and t.split(".")[0] == name} - {module}
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every import circle found by a depth-first walk (each reported once, from its first node)."""
  found, state = [], {}

  def visit(node: str, stack: list[str]) -> None:
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        found.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  return found


def test_functions_and_files_are_small():
  assert oversized(ROOT / "splash_hk") == []


def test_the_import_graph_has_no_circles():
  graph = import_graph(ROOT / "splash_hk")
  assert "splash_hk.kernel" in graph and graph["splash_hk.kernel"]  # the graph was read
  assert circles(graph) == []


def test_the_checks_can_fail(tmp_path):
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("from pkg.a import thing\n\ndef f():\n" + "  x = 1\n" * 61)
  assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.a"]]
  assert oversized(pkg) == ["pkg/b.py:3 f: 61 lines"]
