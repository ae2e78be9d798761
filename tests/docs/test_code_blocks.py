"""The Python code blocks of the documentation run (issue 30).

Each page's runnable blocks run in order as one script, in a fresh folder, on CPU, in a new interpreter.
A block that cannot run here carries ``<!-- docs-test: gpu (why) -->`` or ``<!-- docs-test:
illustrative (why) -->`` on the line before its fence (``python docs/_gen/code_blocks.py`` lists them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs._docs import load

_blocks = load("code_blocks")
BLOCKS = _blocks.all_blocks()
PAGES = sorted({block.page for block in BLOCKS if block.kind is None})


def test_blocks_are_found_and_most_marked_ones_say_why() -> None:
    assert len(PAGES) >= 4, PAGES
    for block in BLOCKS:
        if block.kind is not None:
            assert block.kind in _blocks.KINDS, f"{block.page}:{block.line}: unknown kind {block.kind!r}"
            assert block.reason, f"{block.page}:{block.line}: say why the block does not run"


@pytest.mark.parametrize("page", PAGES)
def test_the_page_code_runs(page: str, tmp_path: Path) -> None:
    code = "\n\n".join(block.code for block in BLOCKS if block.page == page and block.kind is None)
    script = tmp_path / "page.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"docs/{page}'s code failed:\n{result.stdout}\n{result.stderr}"
