"""The project's .venv interpreter as Bazel's Python toolchain.

Third-party packages (jax, haiku, ejkernel, ...) come from `.venv`, which
`make setup` creates: Bazel runs offline, so it cannot fetch them itself.
"""

def _venv_python_impl(rctx):
    workspace = rctx.path(Label("@//:WORKSPACE")).dirname
    python = workspace.get_child(".venv").get_child("bin").get_child("python3")
    if not python.exists:
        fail("%s does not exist: run `make setup` (or `make bazel-test`) first." % python)
    include = rctx.execute([python, "-c", "import jax; print(jax.ffi.include_dir())"])
    if include.return_code != 0:
        fail("jax.ffi.include_dir() failed in %s: %s" % (python, include.stderr))
    rctx.symlink(include.stdout.strip(), "include")
    rctx.file("BUILD", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

# The XLA FFI headers of .venv's jaxlib (`jax.ffi.include_dir()`): the native kernel's one
# C++ dependency.
cc_library(
    name = "jax_ffi",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)

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
    doc = "Declares <workspace>/.venv/bin/python3 as the Python 3 toolchain, and its jaxlib's " +
          "XLA FFI headers as @venv_python//:jax_ffi.",
)
