"""The Python code blocks of the documentation run (issue 30).

Each page's runnable blocks run in order as one script, in a fresh folder, on CPU; the pages run one after
another in one new interpreter (``_run_pages.py``), with lockstep's process state reset between them.
A block that cannot run here carries ``<!-- docs-test: gpu (why) -->`` or ``<!-- docs-test:
illustrative (why) -->`` on the line before its fence (``python docs/_gen/code_blocks.py`` lists them).
"""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Every page's runnable blocks, run once for the module: page -> None, or the failure's traceback."""
    root = tmp_path_factory.mktemp("pages")
    folders = {}
    for number, page in enumerate(PAGES):
        folder = root / f"page{number}"
        folder.mkdir()
        code = "\n\n".join(block.code for block in BLOCKS if block.page == page and block.kind is None)
        (folder / "page.py").write_text(code)
        folders[page] = folder
    results = root / "results.json"
    finished = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("_run_pages.py")),
            str(results),
            *map(str, folders.values()),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, f"the page runner failed:\n{finished.stdout}\n{finished.stderr}"
    by_folder = json.loads(results.read_text())
    return {page: by_folder[str(folder)] for page, folder in folders.items()}


@pytest.mark.parametrize("page", PAGES)
def test_the_page_code_runs(page: str, outcomes: dict[str, str | None]) -> None:
    assert outcomes[page] is None, f"docs/{page}'s code failed:\n{outcomes[page]}"
