"""Paths from the command line, resolved where the user typed the command."""

from __future__ import annotations

import os


def user_path(path: str) -> str:
  """`path` made absolute against the user's working directory.

  `bazel run` starts a binary inside its runfiles tree and names the user's
  directory in `BUILD_WORKING_DIRECTORY`; without Bazel it is the current one.

  Args:
    path: a flag value such as `--out=bench_out` or `--checkpoint_dir=~/ckpt`.

  Returns:
    An absolute path (unchanged if `path` already was one).
  """
  return os.path.join(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()),
                      os.path.expanduser(path))
