"""The Python code blocks of the documentation, and which of them run.

A block runs in the test suite (``tests/docs/test_code_blocks.py``: each page's runnable blocks, in order,
as one script in a fresh folder, on CPU) unless the line just before its fence marks it::

    <!-- docs-test: gpu (why) -->            needs a GPU; checked on a GPU machine, not in CI
    <!-- docs-test: illustrative (why) -->   a fragment of the reader's own script (undefined names), or
                                             it needs processes, a network or downloads

``python docs/_gen/code_blocks.py`` lists every block that does not run in CI, with its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
KINDS = ("gpu", "illustrative")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    kind: str | None
    """None: runs in the tests; else one of :data:`KINDS`."""
    reason: str


def blocks(page: Path) -> list[Block]:
    """The ``python`` blocks of one page (relative indentation kept, list indentation removed)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        indent, start = len(match["indent"]), index
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("```"))
        if match["lang"] == "python":
            mark = _MARK.match(lines[start - 1]) if start else None
            code = "\n".join(line[indent:] for line in lines[start + 1 : end])
            found.append(
                Block(
                    page=str(page.relative_to(DOCS)),
                    line=start + 1,
                    code=code,
                    kind=mark["kind"] if mark else None,
                    reason=(mark["reason"] or "").strip() if mark else "",
                )
            )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in sorted(DOCS.rglob("*.md")) for block in blocks(page)]


if __name__ == "__main__":
    for block in all_blocks():
        if block.kind:
            print(f"{block.page}:{block.line}: {block.kind}: {block.reason}")
