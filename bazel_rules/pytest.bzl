"""`py_pytest`: one Bazel `py_test` per pytest file."""

def py_pytest(name, src, srcs = [], deps = [], data = [], **kwargs):
    """A `py_test` that runs the pytest file `src` with bazel_rules/pytest_main.py.

    Args:
      name: target name.
      src: the test file, e.g. "tests/test_numerics.py".
      srcs: other Python files only this test uses.
      deps: py_library targets the file imports.
      data: files and binaries the tests read or run.
      **kwargs: `py_test` attributes: size, timeout, shard_count, tags, ...
    """
    native.py_test(
        name = name,
        srcs = [src, "//bazel_rules:pytest_main.py"] + srcs,
        main = "//bazel_rules:pytest_main.py",
        args = ["$(location %s)" % src],
        python_version = "PY3",
        srcs_version = "PY3",
        deps = deps,
        data = data,
        **kwargs
    )
