"""Built-in extensions are found, not listed (lockstep.config.vocabulary.import_built_in_specs): every folder of
``lockstep.backends`` and ``lockstep.layers`` with a ``spec`` module registers itself on import; a folder
without one, and a plain module (``lockstep.backends.ft``, fault tolerance's former path), is skipped."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.config import vocabulary
from lockstep.config.layer_specs import layer_specs
from lockstep.layers.fault_tolerance.config import FaultToleranceConfig


def _package(root: Path, name: str, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two packages of extensions on ``sys.path``, in place of lockstep's."""
    _package(tmp_path, "kinds_a", {"__init__.py": "", "one/__init__.py": "", "one/spec.py": ""})
    _package(
        tmp_path,
        "kinds_b",
        {
            "__init__.py": "",
            "two/__init__.py": "",
            "two/spec.py": "",
            "no_spec/__init__.py": "",  # a folder without a spec: no extension
            "moved.py": "raise AssertionError('a plain module is imported')\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vocabulary, "BUILT_IN_PACKAGES", ("kinds_a", "kinds_b"))
    yield
    for name in _imported():
        del sys.modules[name]


def _imported() -> list[str]:
    return sorted(name for name in sys.modules if name.split(".")[0] in ("kinds_a", "kinds_b"))


def test_every_package_s_folders_with_a_spec_are_imported_and_nothing_else(packages):
    vocabulary.import_built_in_specs()
    assert _imported() == [
        "kinds_a",
        "kinds_a.one",
        "kinds_a.one.spec",
        "kinds_b",
        "kinds_b.no_spec",  # looked into, found without a spec
        "kinds_b.two",
        "kinds_b.two.spec",
    ]


def test_a_spec_that_fails_to_import_something_else_is_not_hidden(packages, tmp_path: Path):
    (tmp_path / "kinds_b" / "two" / "spec.py").write_text("import kinds_b.missing_module\n")
    with pytest.raises(ModuleNotFoundError, match="kinds_b.missing_module"):
        vocabulary.import_built_in_specs()


def test_fault_tolerance_is_a_built_in_layer_found_in_lockstep_layers():
    assert vocabulary.BUILT_IN_PACKAGES == ("lockstep.backends", "lockstep.layers")
    (spec,) = [spec for spec in layer_specs() if spec.name == "fault_tolerance"]
    assert spec.resolved_plugin_type() is FaultToleranceConfig
    assert type(spec).__module__ == "lockstep.config.layer_specs"
    assert sys.modules["lockstep.layers.fault_tolerance.spec"].SPEC is spec


def test_the_former_import_path_re_exports_the_layer_s_names():
    from lockstep.backends import ft
    from lockstep.errors import ReplicaQuorumError
    from lockstep.layers import fault_tolerance
    from lockstep.layers.fault_tolerance.layer import FaultTolerance

    assert (
        ft.__all__
        == fault_tolerance.__all__
        == ["FaultTolerance", "FaultToleranceConfig", "ReplicaQuorumError"]
    )
    assert (ft.FaultTolerance, ft.FaultToleranceConfig, ft.ReplicaQuorumError) == (
        FaultTolerance,
        FaultToleranceConfig,
        ReplicaQuorumError,
    )
