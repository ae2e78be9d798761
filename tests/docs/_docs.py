"""The documentation's generators (docs/_gen/), imported from their folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "docs" / "_gen"


def load(name: str) -> ModuleType:
    """docs/_gen/<name>.py as a module (once)."""
    key = f"_lockstep_docs_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, GEN / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
