"""Coverage of Accelerate 1.15's public API is a test, not a claim (issue 15, item 8).

``src/lockstep/accelerate_api.json`` gives each public name of Accelerate 1.15.0 (the Accelerator's members and
attributes, and the names of every public module: ``accelerate``, ``accelerate.utils``, ``accelerate.hooks``,
``accelerate.data_loader``, ...) a status: ``implemented``, ``unsupported`` or ``absent``. The names themselves
come from the real package: ``tests/accelerate_1_15_surface.json``, written by ``dev/accelerate_api.py`` in the
reference environment, and the statuses must cover exactly those names. This file checks every entry against
lockstep at the same path (``accelerate.X.name`` -> ``lockstep.X.name``): implemented names resolve and are
lockstep's own code, unsupported ones resolve and raise ``NotImplementedError`` when used, absent ones do not
resolve. ``tests/test_api_signatures.py`` compares the signatures of the implemented callables. The flags of ``accelerate launch`` are checked by
``tests/cli/test_accelerate_launch_flags.py``; the summary below counts them too.

``python -m tests.test_api_coverage`` prints the coverage figures.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep import Accelerator

PACKAGE = Path(lockstep.__file__).parent
DATA = json.loads((PACKAGE / "accelerate_api.json").read_text(encoding="utf-8"))
SURFACE = json.loads((Path(__file__).parent / "accelerate_1_15_surface.json").read_text(encoding="utf-8"))
SECTIONS: dict[str, dict[str, str]] = {name: section["names"] for name, section in DATA["sections"].items()}
STATUSES = ("implemented", "unsupported", "absent")
# Arguments for the unsupported Accelerator methods (properties are read instead).
METHOD_ARGUMENTS: dict[str, tuple[Any, ...]] = {"lomo_backward": (torch.tensor(1.0), 0.1)}


def status_of(entry: str) -> str:
    return entry.split(":", 1)[0]


def entries(section: str, status: str) -> list[str]:
    return [name for name, entry in SECTIONS[section].items() if status_of(entry) == status]


def is_stub(value: Any) -> bool:
    """Whether ``value`` is one of lockstep's raising stand-ins (``lockstep.utils.unsupported``)."""
    doc = getattr(value, "__doc__", None) or ""
    return callable(value) and doc.startswith("Not supported: raises NotImplementedError.")


def launch_flag_counts() -> Counter:
    """Statuses of ``accelerate launch``'s 1.15 flags in ``cli/accelerate_launch_flags.txt``."""
    counts: Counter = Counter()
    section = ""
    for line in (PACKAGE / DATA["launch_flags"]).read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.strip() and not line.startswith("#") and section == "accelerate 1.15":
            counts[line.split(" | ")[2].strip()] += 1
    return counts


def coverage_figures() -> dict[str, dict[str, int]]:
    """Per section: how many names, and how many of each status."""
    figures = {
        section: {"names": len(names), **Counter(status_of(entry) for entry in names.values())}
        for section, names in SECTIONS.items()
    }
    flags = launch_flag_counts()
    figures["launch_flags"] = {"names": sum(flags.values()), **flags}
    return figures


def summary() -> str:
    lines = [f"lockstep's coverage of Accelerate {DATA['accelerate_version']}'s public API:"]
    for section, counts in coverage_figures().items():
        total = counts["names"]
        parts = ", ".join(f"{counts[s]} {s}" for s in (*STATUSES, "accepted") if counts.get(s))
        lines.append(f"  {section}: {counts.get('implemented', 0)}/{total} implemented ({parts})")
    return "\n".join(lines)


# -- the file itself ----------------------------------------------------------------------------------
def test_the_statuses_cover_exactly_the_names_of_the_real_package():
    assert DATA["accelerate_version"] == SURFACE["accelerate_version"] == "1.15.0"
    assert list(SECTIONS) == list(SURFACE["sections"])
    for section, names in SECTIONS.items():
        assert sorted(names) == sorted(SURFACE["sections"][section]), section
    assert {section: len(names) for section, names in SECTIONS.items()} == {
        "accelerator_members": 86,
        "accelerator_attributes": 28,
        "top_level": 30,
        "utils": 264,
        "local_sgd": 1,
        "hooks": 12,
        "big_modeling": 8,
        "data_loader": 12,
        "launchers": 3,
        "inference": 5,
        "tracking": 15,
        "logging": 2,
        "state": 7,
        "checkpointing": 4,
        "optimizer": 3,
        "scheduler": 1,
    }
    for names in SECTIONS.values():
        assert {status_of(entry) for entry in names.values()} <= set(STATUSES)
        for entry in names.values():  # an absent name always says why
            assert status_of(entry) != "absent" or len(entry.split(":", 1)[1].strip()) > 20
    assert not set(SECTIONS["accelerator_members"]) & set(SECTIONS["accelerator_attributes"])


def test_the_surface_file_says_how_it_was_generated():
    command = SURFACE["generated_by"].split("  ")[0]
    assert command == ".venv-reference/bin/python dev/accelerate_api.py"
    assert (Path(__file__).parents[1] / "dev" / "accelerate_api.py").is_file()
    assert SURFACE["modules"]["data_loader"] == "accelerate.data_loader"


def test_the_surface_file_is_what_the_generator_writes_from_the_real_package(tmp_path):
    """Regenerated in the reference environment (``.venv-reference``, built by ``make test``): the committed file
    must be what Accelerate 1.15 gives today. Skips without that environment, fails without it under CI."""
    repo = Path(__file__).parents[1]
    python = repo / ".venv-reference" / "bin" / "python"
    if not python.is_file():
        message = f"the reference environment is missing ({python}); build it with make test"
        if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}:
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    fresh = tmp_path / "surface.json"
    changing = ("LOCKSTEP_", "ACCELERATE_", "HF_HOME", "XDG_CACHE_HOME")  # they change Accelerate's defaults
    env = {key: value for key, value in os.environ.items() if not key.startswith(changing)}
    command = [str(python), str(repo / "dev" / "accelerate_api.py"), str(fresh)]
    subprocess.run(command, check=True, cwd=tmp_path, env={**env, "PYTHONPATH": ""}, timeout=300)
    assert json.loads(fresh.read_text(encoding="utf-8"))["sections"] == SURFACE["sections"]


def test_the_coverage_figures():
    print(summary())
    figures = coverage_figures()
    assert figures == {
        "accelerator_members": {"names": 86, "implemented": 85, "unsupported": 1},
        "accelerator_attributes": {"names": 28, "implemented": 26, "absent": 2},
        "top_level": {"names": 30, "implemented": 29, "absent": 1},
        "utils": {"names": 264, "implemented": 215, "unsupported": 38, "absent": 11},
        "local_sgd": {"names": 1, "implemented": 1},
        "hooks": {"names": 12, "implemented": 11, "absent": 1},
        "big_modeling": {"names": 8, "implemented": 7, "absent": 1},
        "data_loader": {"names": 12, "implemented": 8, "absent": 4},
        "launchers": {"names": 3, "implemented": 2, "absent": 1},
        "inference": {"names": 5, "implemented": 1, "absent": 4},
        "tracking": {"names": 15, "implemented": 9, "absent": 6},
        "logging": {"names": 2, "implemented": 2},
        "state": {"names": 7, "implemented": 3, "absent": 4},
        "checkpointing": {"names": 4, "absent": 4},
        "optimizer": {"names": 3, "implemented": 1, "absent": 2},
        "scheduler": {"names": 1, "implemented": 1},
        "launch_flags": {"names": 124, "implemented": 61, "accepted": 9, "unsupported": 54},
    }


def test_the_data_file_ships_with_the_package():
    pyproject = (PACKAGE.parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    table = pyproject.split("\n[tool.setuptools.package-data]\n")[1].split("\n[")[0]
    (entry,) = [line for line in table.splitlines() if line.startswith("lockstep = ")]
    assert '"accelerate_api.json"' in entry


# -- the Accelerator ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


@pytest.mark.parametrize("name", entries("accelerator_members", "implemented"))
def test_implemented_accelerator_members_are_defined_by_lockstep(name):
    member = getattr(
        Accelerator, name
    )  # the facade's own, or the function or property of the part it forwards to
    function = member.fget if isinstance(member, property) else member
    assert callable(function)
    assert function.__module__.startswith("lockstep.accelerator.")
    assert not is_stub(function)


@pytest.mark.parametrize("name", entries("accelerator_members", "unsupported"))
def test_unsupported_accelerator_members_raise_the_not_yet_error(accelerator, name):
    member = inspect.getattr_static(Accelerator, name)
    with pytest.raises(NotImplementedError, match=rf"Accelerator\.{name}(\(\))? is not supported"):
        if isinstance(member, property):
            getattr(accelerator, name)
        else:
            getattr(accelerator, name)(*METHOD_ARGUMENTS[name])


@pytest.mark.parametrize("name", entries("accelerator_attributes", "implemented"))
def test_implemented_accelerator_attributes_are_readable(accelerator, name):
    getattr(accelerator, name)


@pytest.mark.parametrize("name", entries("accelerator_attributes", "absent"))
def test_absent_accelerator_attributes_do_not_resolve(accelerator, name):
    assert not hasattr(accelerator, name)


# -- the modules --------------------------------------------------------------------------------------
MODULE_SECTIONS = [section for section in SECTIONS if not section.startswith("accelerator_")]


def lockstep_module(section: str) -> Any:
    """The lockstep module at Accelerate's path (``lockstep.data_loader`` for ``accelerate.data_loader``), or
    None where lockstep has none (every name of such a section is absent)."""
    try:
        return importlib.import_module(DATA["sections"][section]["lockstep"])
    except ModuleNotFoundError:
        return None


MODULE_CASES = [
    pytest.param(section, name, status_of(entry), id=f"{section}.{name}")
    for section in MODULE_SECTIONS
    for name, entry in SECTIONS[section].items()
]


@pytest.mark.parametrize(("section", "name", "status"), MODULE_CASES)
def test_every_module_name_resolves_as_listed(section, name, status):
    module = lockstep_module(section)
    if status == "absent":
        assert not hasattr(module, name)
        return
    value = getattr(module, name)
    if status == "implemented":
        assert not is_stub(value)
        return
    assert is_stub(value)
    with pytest.raises(NotImplementedError) as caught:
        value(object(), key="anything")  # whatever is passed: constructing or calling raises
    assert str(caught.value).startswith(f"{name} is not supported by lockstep: ")


def test_top_level_names_are_exported():
    listed = [name for name, entry in SECTIONS["top_level"].items() if status_of(entry) != "absent"]
    assert set(listed) <= set(lockstep.__all__)


if __name__ == "__main__":
    print(summary())
