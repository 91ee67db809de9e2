"""README's Python snippets run as written, each as its own script, as a user on a CPU-only machine.

Each ```python block is a whole script: no conftest, no forced device count (a snippet that needs
devices asks for them itself, as README tells users to), a fresh process and folder.
"""

import pathlib
import re
import subprocess
import sys

import pytest

import processes

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_has_its_snippets():
  assert len(SNIPPETS) >= 3, "README's usage, Haiku decoding and context-parallel snippets"


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_as_written(index, tmp_path):
  env = processes.env()
  script = tmp_path / f"readme_snippet_{index}.py"
  script.write_text(SNIPPETS[index])
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=540)
  assert done.returncode == 0, f"README snippet {index} failed:\n{SNIPPETS[index]}\n{done.stderr[-4000:]}"
