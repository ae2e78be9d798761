"""MkDocs hook: adds the pages of pages.py (written from the code) and the benchmark charts to the site."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
# The pages describe this checkout's code, whichever lockstep the environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pages import generated_files, generated_pages


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for site_path, markdown in generated_pages().items():
        files.append(File.generated(config, site_path, content=markdown))
    for site_path, source in generated_files().items():
        files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files
