"""The import half of the architecture, whole: imports inside functions count, nothing imports upward across
the bands of the package, and ``lockstep.utils`` is a thin namespace above the engine.

``tests/test_architecture.py`` reads the imports that run when a module is imported (its import-cycle rule);
a function-level import is often written to break such a circle, and then the two modules still depend on
each other, only later. Here the graph has every import, wherever it is written. Each rule is a function over
parsed source, tested on synthetic modules (the rule can fail), then run over ``src/lockstep``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.test_architecture import Module, _within, imported_names, package_modules, parse
from tests.test_architecture_tree import ACCELERATE_PATH_SHIMS

PUBLIC_NAMESPACE = "lockstep"
"""The package itself (its ``__init__``): every public name, loaded on first use."""
ACCELERATE_USERS = (
    "lockstep.trainer",
    "lockstep.cli",
    "lockstep.big_modeling",
    "lockstep.hooks",
    "lockstep.big_model",
    "lockstep.inference",
)
"""What Accelerate itself builds on ``accelerate.utils``, and transformers' Trainer on ``accelerate``: the
Trainer, the command line, and the big-model API (``big_modeling``, ``hooks`` and the ``big_model`` package,
``inference``), which use ``lockstep.utils.modeling``/``offload``/``operations`` as Accelerate's use
``accelerate.utils``."""
ACCELERATE_PATHS = (
    "lockstep.utils",
    *(shim for shim in ACCELERATE_PATH_SHIMS if shim not in ACCELERATE_USERS),
)
"""Accelerate's import paths (``accelerate.utils``, ``accelerate.data_loader``, ...): namespaces over the
engine's names, for code written against Accelerate (the top-level shims are declared in
``tests/test_architecture_tree.py``; ``hooks`` and ``inference`` re-export the big-model code, with its users)."""
BANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the public namespace", (PUBLIC_NAMESPACE,)),
    ("Accelerate's users", ACCELERATE_USERS),
    ("Accelerate's import paths", ACCELERATE_PATHS),
)
"""The bands of the package, top first; every module not named here is the engine, the lowest band. A
module imports its own band and the bands below it, never one above: the engine does not know the
namespaces written over it, the namespaces do not know their users, and nothing inside the package imports
the package's top (importing a name from ``lockstep`` runs its lazy exports from inside the package; a module
reads the name where it is defined)."""
ENGINE = "the engine"

CIRCLE_EXCEPTIONS: Mapping[tuple[str, str], str] = {
    ("lockstep.data._position", "lockstep.data._stateful"): (
        "A prepared loader built with Accelerate's use_stateful_dataloader=True becomes its torchdata "
        "subclass (DataLoaderStateMixin.__new__): the subclass derives from the loader, and the loader names "
        "the subclass when it is built. torchdata is optional, so the module defining the subclass is "
        "imported by that construction only; no module below both can hold a class that derives from one "
        "and is chosen by the other."
    ),
}
"""Import edges (importer, imported) left out of the circle rule, each with why no lower module can take the
shared piece. Each must be a function-level import, and needed: with the edge, its modules form a circle."""


# -- the graph ----------------------------------------------------------------------------------------
def import_graph(modules: Iterable[Module]) -> dict[str, dict[str, int]]:
    """Module -> the lockstep modules it imports anywhere (module level, ``TYPE_CHECKING``, functions) and
    the first line of each."""
    modules = list(modules)
    known = {m.name for m in modules}
    graph: dict[str, dict[str, int]] = {}
    for module in modules:
        edges = graph.setdefault(module.name, {})
        for imported, line in imported_names(module, known):
            if imported in known and imported != module.name:
                edges[imported] = min(line, edges.get(imported, line))
    return graph


def _strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The groups of two or more nodes that reach each other (Tarjan, iterative), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


# -- rules --------------------------------------------------------------------------------------------
def import_circles(
    modules: Iterable[Module], exceptions: Mapping[tuple[str, str], str] = CIRCLE_EXCEPTIONS
) -> list[list[str]]:
    """Groups of modules that import each other, imports inside functions included, without the edges of
    ``exceptions``."""
    graph = import_graph(modules)
    return _strongly_connected(
        {name: [t for t in edges if (name, t) not in exceptions] for name, edges in graph.items()}
    )


def exception_problems(
    modules: Iterable[Module], exceptions: Mapping[tuple[str, str], str] = CIRCLE_EXCEPTIONS
) -> list[str]:
    """Exceptions to :func:`import_circles` that are not minimal: the import is gone, runs at import time
    (a circle at import time is never excused), or closes no circle."""
    modules = list(modules)
    graph = import_graph(modules)
    by_name = {m.name: m for m in modules}
    found = []
    for importer, imported in exceptions:
        if imported not in graph.get(importer, {}):
            found.append(f"{importer} no longer imports {imported}: drop the exception")
            continue
        shallow = ast.Module(
            body=[
                n for n in by_name[importer].tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)
            ],
            type_ignores=[],
        )
        known = set(graph)
        top = Module(importer, by_name[importer].path, shallow, 0)
        if imported in {name for name, _ in imported_names(top, known)}:
            found.append(
                f"{importer} imports {imported} at import time: an exception covers function-level imports"
            )
        others = {(i, t): why for (i, t), why in exceptions.items() if (i, t) != (importer, imported)}
        if not any({importer, imported} <= set(group) for group in import_circles(modules, others)):
            found.append(f"{importer} -> {imported} closes no circle: drop the exception")
    return found


def band_of(name: str) -> int:
    """The band of module ``name``: its index in :data:`BANDS`, or ``len(BANDS)`` for the engine."""
    if name == PUBLIC_NAMESPACE:
        return 0
    for number, (_, prefixes) in enumerate(BANDS[1:], start=1):
        if any(_within(name, prefix) for prefix in prefixes):
            return number
    return len(BANDS)


def _band_name(number: int) -> str:
    return BANDS[number][0] if number < len(BANDS) else ENGINE


def upward_imports(modules: Iterable[Module]) -> list[str]:
    """Imports (anywhere in a module) of a module in a band above the importer's (:data:`BANDS`)."""
    found = []
    for importer, edges in sorted(import_graph(modules).items()):
        for imported, line in sorted(edges.items(), key=lambda edge: edge[1]):
            if band_of(imported) < band_of(importer):
                found.append(
                    f"{importer}:{line} imports {imported}, of {_band_name(band_of(imported))}, from "
                    f"{_band_name(band_of(importer))} below it"
                )
    return found


def utils_namespace_violations(modules: Iterable[Module]) -> list[str]:
    """``lockstep.utils`` is Accelerate's ``accelerate.utils``: a namespace above the engine. Two rules:

    1. The engine never imports it. Accelerate's users (:data:`ACCELERATE_USERS`) and the public namespace
       may; a constant or helper the engine needs lives in the engine, and ``utils`` re-exports it. (The
       bands of :func:`upward_imports` say the same; this names ``utils`` in the message.)
    2. It imports the engine's public names only: no name that starts with ``_``, and no module that a
       package keeps private (``lockstep.<package>._<module>`` at any depth, as :mod:`tests.test_architecture`
       's private-import rule reads it for every package). The engine's own top-level modules
       (``lockstep._env``, ``lockstep._nested``) are private to the ``lockstep`` package, which ``utils`` is
       part of, as ``lockstep.utils._loading`` is private to ``utils``: they are the engine's public surface
       to it. Function-level imports count too.
    """
    modules = list(modules)
    graph = import_graph(modules)
    found = []
    for importer, edges in sorted(graph.items()):
        if _within(importer, "lockstep.utils") or band_of(importer) < band_of("lockstep.utils"):
            continue
        found += [
            f"{importer}:{line} imports {imported}: the engine does not import lockstep.utils"
            for imported, line in sorted(edges.items())
            if _within(imported, "lockstep.utils")
        ]
    for module in modules:
        if not _within(module.name, "lockstep.utils"):
            continue
        for node in ast.walk(module.tree):
            if (
                not isinstance(node, ast.ImportFrom)
                or node.level
                or not (node.module or "").startswith("lockstep")
            ):
                continue
            target = node.module or ""
            if _within(target, "lockstep.utils"):
                continue
            parts = target.split(".")
            private_module = next((p for p in parts[2:] if p.startswith("_")), None)
            names = [
                a.name for a in node.names if a.name.startswith("_") and f"{target}.{a.name}" not in graph
            ]
            if private_module is not None:
                found.append(f"{module.name}:{node.lineno} imports {target}, a module private to its package")
            elif names:
                found.append(f"{module.name}:{node.lineno} imports {target}.{names[0]}, a private name")
    return found


# -- the rules hold for lockstep ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return package_modules()


def test_no_import_circles_even_through_imports_inside_functions(modules):
    assert import_circles(modules) == []


def test_each_circle_exception_is_a_needed_function_level_import(modules):
    assert exception_problems(modules) == []


def test_nothing_imports_a_band_above_its_own(modules):
    assert upward_imports(modules) == []


def test_lockstep_utils_is_a_namespace_above_the_engine(modules):
    assert utils_namespace_violations(modules) == []


def test_the_bands_name_modules_that_exist(modules):
    names = {m.name for m in modules}
    for _, prefixes in BANDS:
        assert [p for p in prefixes if not any(_within(n, p) for n in names)] == []


# -- the rules can fail ---------------------------------------------------------------------------------
def test_the_circle_rule_sees_imports_inside_functions():
    a = parse("lockstep.a", "from lockstep.b import x\n")
    b = parse("lockstep.b", "def later():\n    from lockstep.a import y\n")
    c = parse("lockstep.c", "from lockstep.a import z\n")
    assert import_circles([a, b, c], {}) == [["lockstep.a", "lockstep.b"]]
    assert import_graph([a, b, c])["lockstep.b"] == {"lockstep.a": 2}
    # Excused, the edge is minimal: a function-level import that closes the circle.
    excused = {("lockstep.b", "lockstep.a"): "why"}
    assert import_circles([a, b, c], excused) == []
    assert exception_problems([a, b, c], excused) == []
    assert exception_problems([a, b, c], {("lockstep.c", "lockstep.a"): "why"}) == [
        "lockstep.c imports lockstep.a at import time: an exception covers function-level imports",
        "lockstep.c -> lockstep.a closes no circle: drop the exception",
    ]
    assert exception_problems([a, b, c], {("lockstep.a", "lockstep.c"): "why"}) == [
        "lockstep.a no longer imports lockstep.c: drop the exception"
    ]


def test_the_circle_rule_finds_long_circles_and_type_checking_imports():
    first = parse(
        "lockstep.p.one", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lockstep.p.two\n"
    )
    second = parse("lockstep.p.two", "class C:\n    def m(self):\n        from lockstep.p import three\n")
    third = parse("lockstep.p.three", "from . import one\n", Path("lockstep/p/three.py"))
    assert import_circles([first, second, third], {}) == [
        ["lockstep.p.one", "lockstep.p.three", "lockstep.p.two"]
    ]


def test_the_band_rule_catches_upward_imports():
    modules = [
        parse("lockstep", "", Path("lockstep/__init__.py")),
        parse("lockstep.utils", "", Path("lockstep/utils/__init__.py")),
        parse("lockstep.utils.constants", "from lockstep.trainer import Trainer\n"),
        parse(
            "lockstep.accelerator.profiling", "from lockstep.utils.constants import PROFILE_PATTERN_NAME\n"
        ),
        parse("lockstep.trainer", "", Path("lockstep/trainer/__init__.py")),
        parse(
            "lockstep.trainer.reports",
            "def versions():\n    import lockstep\n    from lockstep.utils import x\n",
        ),
        parse(
            "lockstep.cli.env_cmd", "from lockstep import Accelerator\nfrom lockstep.trainer import reports\n"
        ),
        parse("lockstep.state", "from lockstep import _version\n"),
        parse("lockstep._version", ""),
    ]
    assert upward_imports(modules) == [
        "lockstep.accelerator.profiling:1 imports lockstep.utils.constants, of Accelerate's import paths, from "
        "the engine below it",
        "lockstep.cli.env_cmd:1 imports lockstep, of the public namespace, from Accelerate's users below it",
        "lockstep.trainer.reports:2 imports lockstep, of the public namespace, from Accelerate's users below it",
        "lockstep.utils.constants:1 imports lockstep.trainer, of Accelerate's users, from Accelerate's import "
        "paths below it",
    ]
    assert band_of("lockstep") == 0 and band_of("lockstep.trainer._x") == 1 and band_of("lockstep.utils") == 2
    assert band_of("lockstep.utilsx") == band_of("lockstep.state") == len(BANDS)


def test_the_utils_rule_catches_the_engine_importing_utils_and_utils_importing_internals():
    modules = [
        parse("lockstep.utils", "", Path("lockstep/utils/__init__.py")),
        parse("lockstep.utils.imports", ""),
        parse("lockstep.utils._loading", ""),
        parse("lockstep.backends.fsdp.loading", "def f():\n    from lockstep.utils.imports import why\n"),
        parse("lockstep.big_model.attach_hooks", "from lockstep.utils import offload\n"),
        parse(
            "lockstep.utils.fsdp_utils",
            "from lockstep.backends.fsdp._shards import read\n"  # 1: a module private to backends.fsdp
            "from lockstep.state import _private\n"  # 2: a private name
            "from lockstep.utils._loading import load\n"  # 3: utils' own
            "from lockstep import _env\n"  # 4: the engine's top-level module, private to lockstep
            "def f():\n    from lockstep.checkpoint._atomic import commit\n",  # 6
        ),
        parse("lockstep.state", ""),
        parse("lockstep._env", ""),
    ]
    assert utils_namespace_violations(modules) == [
        "lockstep.backends.fsdp.loading:2 imports lockstep.utils.imports: the engine does not import lockstep.utils",
        "lockstep.utils.fsdp_utils:1 imports lockstep.backends.fsdp._shards, a module private to its package",
        "lockstep.utils.fsdp_utils:2 imports lockstep.state._private, a private name",
        "lockstep.utils.fsdp_utils:6 imports lockstep.checkpoint._atomic, a module private to its package",
    ]
