"""The top level of ``src/lockstep``, whole: engine modules, Accelerate's import-path shims, and packages.

Every top-level module is placed deliberately: it is named in :data:`ENGINE_MODULES` (it holds code) or in
:data:`ACCELERATE_PATH_SHIMS` (it exists so that an ``accelerate.X`` import path works as ``lockstep.X``, and
holds re-exports only); anything else is a package (big-model code in ``big_model/``, third-party integrations
in ``integrations/``, ...). Each rule is a function over parsed source, tested on synthetic modules (the rule
can fail), then run over ``src/lockstep``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.test_architecture import SRC, Module, package_modules, parse

ENGINE_MODULES = (
    "lockstep._env",
    "lockstep._lazy",
    "lockstep._nested",
    "lockstep._process_group",
    "lockstep._version",
    "lockstep.big_modeling",
    "lockstep.collectives",
    "lockstep.entry_points",
    "lockstep.errors",
    "lockstep.local_sgd",
    "lockstep.logging",
    "lockstep.precision",
    "lockstep.progress",
    "lockstep.rng",
    "lockstep.state",
    "lockstep.step_hooks",
)
"""Top-level modules that hold code. Several sit at an Accelerate path because they are where that code lives
(``state``, ``logging``, ``local_sgd``, and the big-model API ``big_modeling``, built on
:mod:`lockstep.big_model`)."""
ACCELERATE_PATH_SHIMS = (
    "lockstep.data_loader",
    "lockstep.hooks",
    "lockstep.inference",
    "lockstep.launchers",
    "lockstep.memory_accounting",
    "lockstep.optimizer",
    "lockstep.parallelism_config",
    "lockstep.scheduler",
)
"""Top-level modules that exist only for an import path (``accelerate.data_loader``, ``accelerate.hooks``,
``accelerate.inference``, ``accelerate.optimizer``, ..., and the documented ``lockstep.memory_accounting``):
re-exports of names defined in a package."""
MOVED_PATH_SHIMS = ("lockstep.backends.ft",)
"""Former import paths kept for users' code after the code moved, re-exports only: fault tolerance is a layer
(``lockstep.layers.fault_tolerance``), and the docs once said ``from lockstep.backends.ft import ...``."""


def top_level_modules(root: Path = SRC) -> list[str]:
    """The modules directly under ``lockstep/`` (files, not packages), by dotted name."""
    return sorted(
        f"lockstep.{path.stem}" for path in (root / "lockstep").glob("*.py") if path.stem != "__init__"
    )


def unplaced_modules(names: Iterable[str]) -> list[str]:
    """Top-level modules named in neither tuple, and tuple entries that name no module (or both tuples)."""
    names = set(names)
    placed = set(ENGINE_MODULES) | set(ACCELERATE_PATH_SHIMS)
    found = [
        f"{name} is a top-level module in neither ENGINE_MODULES nor ACCELERATE_PATH_SHIMS: name it in one, "
        "or put it in a package"
        for name in sorted(names - placed)
    ]
    found += [f"{name} is listed but is no top-level module" for name in sorted(placed - names)]
    found += [f"{name} is listed twice" for name in sorted(set(ENGINE_MODULES) & set(ACCELERATE_PATH_SHIMS))]
    return found


def _is_reexport(node: ast.stmt, index: int) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return isinstance(node.value.value, str)  # the docstring
    targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else [node.target]
        if isinstance(node, ast.AnnAssign)
        else []
    )
    return len(targets) == 1 and isinstance(targets[0], ast.Name) and targets[0].id == "__all__"


def shim_violations(
    modules: Iterable[Module],
    shims: Iterable[str] = ACCELERATE_PATH_SHIMS,
    kind: str = "an Accelerate path shim",
) -> list[str]:
    """Statements of a shim (``kind``) other than its docstring, imports and ``__all__``."""
    shims = set(shims)
    return [
        f"{module.name}:{node.lineno} is {kind} and holds a {type(node).__name__}: "
        "a shim re-exports only (move the code into a package)"
        for module in modules
        if module.name in shims
        for index, node in enumerate(module.tree.body)
        if not _is_reexport(node, index)
    ]


# -- the rules can fail -------------------------------------------------------------------------------
def test_the_shim_rule_catches_code_in_a_shim():
    shim = parse(
        "lockstep.optimizer",
        '"""Accelerate\'s path."""\n'
        "from __future__ import annotations\n"
        "import torch\n"
        "from lockstep.accelerator.optimizer import AcceleratedOptimizer\n"
        '__all__ = ["AcceleratedOptimizer", "helper"]\n'
        "LIMIT = 3\n"
        "def helper():\n    return LIMIT\n"
        "class Extra:\n    pass\n"
        "if torch.cuda.is_available():\n    pass\n",
    )
    engine = parse("lockstep.state", "def f():\n    pass\n")
    assert shim_violations([shim, engine]) == [
        f"lockstep.optimizer:{line} is an Accelerate path shim and holds a {kind}: a shim re-exports only (move "
        "the code into a package)"
        for line, kind in ((6, "Assign"), (7, "FunctionDef"), (9, "ClassDef"), (11, "If"))
    ]
    assert shim_violations([parse("lockstep.scheduler", '"""Path."""\n"""Second string."""\n')]) == [
        "lockstep.scheduler:2 is an Accelerate path shim and holds a Expr: a shim re-exports only (move the code "
        "into a package)"
    ]
    moved = parse(
        "lockstep.backends.ft", '"""Moved."""\nfrom lockstep.errors import ReplicaQuorumError\nX = 1\n'
    )
    assert shim_violations([moved], MOVED_PATH_SHIMS, "a moved path shim") == [
        "lockstep.backends.ft:3 is a moved path shim and holds a Assign: a shim re-exports only (move the code "
        "into a package)"
    ]


def test_the_placement_rule_catches_an_unplaced_top_level_module():
    names = [*ENGINE_MODULES, *ACCELERATE_PATH_SHIMS, "lockstep._new_feature"]
    names.remove("lockstep.rng")
    assert unplaced_modules(names) == [
        "lockstep._new_feature is a top-level module in neither ENGINE_MODULES nor ACCELERATE_PATH_SHIMS: name it "
        "in one, or put it in a package",
        "lockstep.rng is listed but is no top-level module",
    ]


# -- the package --------------------------------------------------------------------------------------
def test_every_top_level_module_is_an_engine_module_or_a_shim():
    assert unplaced_modules(top_level_modules()) == []


def test_the_accelerate_path_shims_are_re_exports_only():
    modules = [m for m in package_modules() if m.name in ACCELERATE_PATH_SHIMS]
    assert sorted(m.name for m in modules) == sorted(ACCELERATE_PATH_SHIMS)
    assert shim_violations(modules) == []


def test_the_moved_path_shims_are_re_exports_only():
    modules = [m for m in package_modules() if m.name in MOVED_PATH_SHIMS]
    assert sorted(m.name for m in modules) == sorted(MOVED_PATH_SHIMS)
    assert shim_violations(modules, MOVED_PATH_SHIMS, "a moved path shim") == []
