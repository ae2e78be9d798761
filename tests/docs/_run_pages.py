"""Run the documentation's code, one page after another, in this one interpreter (started by
test_code_blocks.py: one start of torch for all pages instead of one per page).

Usage: ``python _run_pages.py RESULTS.json FOLDER...``; each FOLDER holds ``page.py`` (a page's runnable
blocks) and is that page's working folder. Each page runs as ``__main__`` in fresh globals, with lockstep's
process state reset first; RESULTS.json gets, per folder, None or the traceback of the failure.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def run(folder: Path) -> str | None:
    from lockstep.state import GradientState, PartialState

    PartialState._reset_state()
    GradientState._reset_state()
    os.chdir(folder)
    code = (folder / "page.py").read_text()
    try:
        exec(compile(code, str(folder / "page.py"), "exec"), {"__name__": "__main__"})
    except BaseException:  # a page's failure is reported, and the next page still runs
        return traceback.format_exc()
    return None


if __name__ == "__main__":
    out, folders = Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]]
    results = {str(folder): run(folder) for folder in folders}
    out.write_text(json.dumps(results))
