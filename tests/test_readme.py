"""The Python blocks of README and the guides (docs/guide/*.md) run as written, each as its
own script, as a user on a CPU-only machine.

Each ```python block is a whole script: no conftest, no forced device count (a block that needs
devices asks for them itself, as the guides tell users to), a fresh process and folder.
"""

import pathlib
import re
import subprocess
import sys

import pytest

import processes

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"^```python\n(.*?)^```$", page.read_text(),
                                               flags=re.S | re.M))]


def test_readme_and_guides_have_their_blocks():
  pages = {page for page, _, _ in BLOCKS}
  assert "README.md" in pages, "README's tour"
  for guide in ("usage", "masks", "scores", "caches", "context_parallel", "backends"):
    assert f"docs/guide/{guide}.md" in pages, guide


def test_readme_is_a_front_page_and_the_docs_hold_no_team_history():
  assert len((ROOT / "README.md").read_text().splitlines()) < 250, "the rest goes in docs/guide"
  history = re.compile(r"\b(issue \d+|issue's|sessions?|blocked|closing notes?|20\d\d-\d\d-\d\d)\b",
                       re.I)
  for page in PAGES:
    found = history.findall(page.read_text())
    assert not found, f"{page.name}: {found} (history belongs in commit messages and notes)"


@pytest.mark.parametrize("page,index", [(page, i) for page, i, _ in BLOCKS],
                         ids=[f"{page}:{i}" for page, i, _ in BLOCKS])
def test_block_runs_as_written(page, index, tmp_path):
  (block,) = [b for p, i, b in BLOCKS if (p, i) == (page, index)]
  script = tmp_path / f"block_{index}.py"
  script.write_text(block)
  env = processes.env()
  if "from examples" in block:  # the binaries' modules (not in the wheel): run from the checkout
    env["PYTHONPATH"] = str(ROOT)
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=540)
  assert done.returncode == 0, f"{page} block {index} failed:\n{block}\n{done.stderr[-4000:]}"
