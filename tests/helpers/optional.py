"""Skipping tests whose optional dependency (an extra of lockstep's) is not installed."""

from __future__ import annotations

import importlib.util

import pytest


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skip the test unless every module in ``modules`` can be imported (``pip install -e '.[test]'``)."""
    missing = [name for name in modules if not _importable(name)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install -e '.[test]')")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
