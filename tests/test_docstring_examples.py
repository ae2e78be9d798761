"""The examples in lockstep's docstrings run, and print what they say they print.

Every module of the package is collected; each module's examples run as one doctest session in a fresh
temporary folder (so relative paths land there). Examples that need a GPU, a process group, a network or a
user's own objects carry ``# doctest: +SKIP`` in the source, where the reader sees it.
"""

from __future__ import annotations

import doctest
import importlib
import logging
import pkgutil
from pathlib import Path

import pytest

import lockstep

# Modules whose import or examples need an optional package; their examples run where it is installed.
_OPTIONAL = {
    "lockstep.memory.estimate": "transformers",
    "lockstep.memory.estimate.estimator": "transformers",
    "lockstep.tracking.mlflow": "mlflow",
    "lockstep.tracking.tensorboard": "tensorboard",
    "lockstep.tracking.wandb": "wandb",
    "lockstep.report.plots": "matplotlib",
}


def _modules() -> list[str]:
    names = [lockstep.__name__]
    names += [info.name for info in pkgutil.walk_packages(lockstep.__path__, prefix="lockstep.")]
    return sorted(names)


def _source(module_name: str) -> Path:
    folder = Path(lockstep.__file__).parent.joinpath(*module_name.split(".")[1:])
    return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")


def _modules_with_examples() -> list[str]:
    """Modules whose source holds a ``>>>`` prompt (a text scan: collection imports nothing)."""
    return [name for name in _modules() if ">>> " in _source(name).read_text(encoding="utf-8")]


def _examples(module_name: str) -> list[doctest.DocTest]:
    if module_name in _OPTIONAL:
        pytest.importorskip(_OPTIONAL[module_name])
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [test for test in finder.find(module, module_name) if test.examples]


def test_every_module_is_collected():
    modules = _modules()
    assert "lockstep.accelerator.facade" in modules and "lockstep.backends.fsdp.backend" in modules
    assert len(modules) > 100
    with_examples = _modules_with_examples()
    assert "lockstep.config.file" in with_examples and "lockstep.errors" not in with_examples
    assert sum(len(_examples(name)) for name in with_examples) >= 60


@pytest.mark.parametrize("module_name", _modules_with_examples())
def test_docstring_examples_run(module_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tests = _examples(module_name)
    assert tests, f"{module_name} has a >>> prompt but no example doctest can find"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    root_level = logging.getLogger().level  # get_logger(log_level=...) sets the root level, as in Accelerate
    try:
        for test in tests:
            test.globs = dict(test.globs)
            runner.run(test)
    finally:
        logging.getLogger().setLevel(root_level)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed"


def test_a_wrong_example_fails():
    """The check above can fail: an example whose output is wrong is reported."""
    parser = doctest.DocTestParser()
    test = parser.get_doctest(">>> 1 + 1\n3\n", {}, "wrong", "wrong.py", 0)
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda text: None)
    assert runner.summarize(verbose=False).failed == 1
