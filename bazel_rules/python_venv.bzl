"""The project's .venv interpreter as Bazel's Python toolchain.

Third-party packages (jax, haiku, ejkernel, ...) come from `.venv`, which
`make setup` creates: Bazel runs offline, so it cannot fetch them itself.
"""

def _venv_python_impl(rctx):
    workspace = rctx.path(Label("@//:WORKSPACE")).dirname
    python = workspace.get_child(".venv").get_child("bin").get_child("python3")
    if not python.exists:
        fail("%s does not exist: run `make setup` (or `make bazel-test`) first." % python)
    rctx.file("BUILD", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "python3",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(python = python))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    local = True,
    doc = "Declares <workspace>/.venv/bin/python3 as the Python 3 toolchain.",
)
