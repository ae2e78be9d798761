"""The style guide, executable: file and function sizes, import layers, no import cycles, and backend
identity asked in one place only.

Each rule is a function over parsed source, so the rules are tested on small synthetic modules too (the
checks can fail), then run over ``src/lockstep``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100

# (importer prefix, imported prefixes it must not import, why)
FORBIDDEN_IMPORTS = [
    (
        "lockstep.backends",
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "backends sit below the Accelerator",
    ),
    (
        "lockstep.checkpoint",
        (
            "lockstep.accelerator",
            "lockstep.trainer",
            "lockstep.cli",
            "lockstep.launcher",
            "lockstep.backends",
        ),
        "checkpoint/ is shared by every backend and knows none",
    ),
    (
        "lockstep.data",
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "data/ sits below the Accelerator",
    ),
    (
        "lockstep.config",
        (
            "lockstep.accelerator",
            "lockstep.trainer",
            "lockstep.cli",
            "lockstep.launcher",
            "lockstep.backends",
        ),
        "config/ is the vocabulary everything else uses",
    ),
    (
        "lockstep.launcher",
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli"),
        "the launcher starts processes and never knows the Accelerator",
    ),
    (
        "lockstep.accelerator",
        ("lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "the Accelerator is used by entry points, not the other way round",
    ),
    (
        "lockstep.trainer",
        ("lockstep.cli", "lockstep.launcher"),
        "the Trainer is built on the public Accelerator API",
    ),
]
# Engine and feature modules: nothing there imports the facade or an entry point.
BELOW_FACADE = (
    "lockstep.state",
    "lockstep._env",
    "lockstep._process_group",
    "lockstep._nested",
    "lockstep.precision",
    "lockstep.collectives",
    "lockstep.rng",
    "lockstep.errors",
    "lockstep.tracking",
    "lockstep.throughput",
    "lockstep.diagnostics",
    "lockstep.memory",
    "lockstep.report",
    "lockstep.progress",
    "lockstep.utils",
    "lockstep.big_modeling",
)
FORBIDDEN_IMPORTS += [
    (
        prefix,
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "engine and feature modules sit below the Accelerator",
    )
    for prefix in BELOW_FACADE
]
# The one import across these layers that is allowed, and why: Accelerate's ``accelerate.utils`` exports the
# optimizer and scheduler the loop holds under DeepSpeed, which are wrappers of the Accelerator's own
# AcceleratedOptimizer/AcceleratedScheduler; lockstep.utils re-exports them under those names (the package
# itself is a compatibility namespace). Nothing below the facade imports lockstep.utils' top level.
LAYER_EXCEPTIONS = {
    ("lockstep.utils", "lockstep.accelerator.engine_stepped"),
    ("lockstep.utils.deepspeed", "lockstep.accelerator.engine_stepped"),
}
# Where comparing against DistributedType members (or a backend's class) is allowed: the registry that
# chooses the backend, and the configuration vocabulary.
IDENTITY_ALLOWED = ("lockstep.backends.registry", "lockstep.config")


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int


def parse(name: str, source: str, path: Path | None = None) -> Module:
    return Module(name, path or Path(name), ast.parse(source), source.count("\n") + 1)


def package_modules(root: Path = SRC) -> list[Module]:
    modules = []
    for path in sorted((root / "lockstep").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules.append(parse(name, path.read_text(encoding="utf-8"), path))
    return modules


# -- rules --------------------------------------------------------------------------------------------
def oversized_files(modules: Iterable[Module]) -> list[str]:
    return [f"{m.name}: {m.lines} lines" for m in modules if m.lines > MAX_FILE_LINES]


def oversized_functions(modules: Iterable[Module]) -> list[str]:
    found = []
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{module.name}.{node.name}: {length} lines")
    return found


def imported_names(module: Module, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every lockstep module ``module`` imports (module level, TYPE_CHECKING and function level alike),
    with the line. ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lockstep"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("lockstep"):
                continue
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            yield from ((sub, node.lineno) for sub in submodules)
            if len(submodules) < len(node.names):
                yield base, node.lineno


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_violations(modules: Iterable[Module]) -> list[str]:
    modules = list(modules)
    known = {m.name for m in modules}
    found = []
    for module in modules:
        for imported, line in imported_names(module, known):
            if (module.name, imported) in LAYER_EXCEPTIONS:
                continue
            for importer, forbidden, why in FORBIDDEN_IMPORTS:
                if _within(module.name, importer) and any(_within(imported, f) for f in forbidden):
                    found.append(f"{module.name}:{line} imports {imported} ({why})")
    return found


def _module_level_imports(module: Module, known: set[str]) -> set[str]:
    """Imports that run when the module is imported (TYPE_CHECKING blocks included, function bodies not)."""
    top = ast.Module(
        body=[n for n in module.tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)],
        type_ignores=[],
    )
    shallow = Module(module.name, module.path, top, module.lines)
    return {name for name, _ in imported_names(shallow, known) if name in known and name != module.name}


def import_cycles(modules: Iterable[Module]) -> list[list[str]]:
    """Strongly connected groups of modules that import each other at import time (Tarjan)."""
    modules = list(modules)
    known = {m.name for m in modules}
    graph = {m.name: _module_level_imports(m, known) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def _is_identity_operand(node: ast.AST) -> bool:
    """``DistributedType.FSDP`` (or ``.value`` of it), or ``x.distributed_type``."""
    while isinstance(node, ast.Attribute):
        if node.attr == "distributed_type":
            return True
        if isinstance(node.value, ast.Name) and node.value.id == "DistributedType":
            return True
        node = node.value
    return False


def identity_checks(modules: Iterable[Module]) -> list[str]:
    """Comparisons against DistributedType members or ``.distributed_type``, and ``isinstance(x, *Backend)``,
    outside the registry and config."""
    found = []
    for module in modules:
        if any(_within(module.name, allowed) for allowed in IDENTITY_ALLOWED):
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                operands += [
                    e for o in operands if isinstance(o, ast.Tuple | ast.List | ast.Set) for e in o.elts
                ]
                if any(_is_identity_operand(o) for o in operands):
                    found.append(f"{module.name}:{node.lineno} compares a distributed type")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = node.args[1:] if len(node.args) > 1 else []
                names = [getattr(k, "id", getattr(k, "attr", "")) for k in kinds]
                if any(name.endswith("Backend") for name in names):
                    found.append(f"{module.name}:{node.lineno} asks which backend it has")
    return found


def _class_name(node: ast.expr) -> str:
    """``Name`` for ``Name``, ``mod.Name`` and ``Name[...]`` (a base, a decorator or a metaclass)."""
    if isinstance(node, ast.Subscript | ast.Call):
        node = node.value if isinstance(node, ast.Subscript) else node.func
    return getattr(node, "id", getattr(node, "attr", ""))


def is_abstract(node: ast.ClassDef) -> bool:
    """Whether a class declares itself abstract: ``ABC`` among its bases, ``metaclass=ABCMeta``, or a method
    of its own marked ``@abstractmethod``. An abstract method inherited and left unimplemented does not count:
    a class meant to stay abstract says so in its own body."""
    if any(_class_name(base) == "ABC" for base in node.bases):
        return True
    if any(k.arg == "metaclass" and _class_name(k.value) == "ABCMeta" for k in node.keywords):
        return True
    return any(
        _class_name(decorator) == "abstractmethod"
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        for decorator in item.decorator_list
    )


def _classes_within(modules: Iterable[Module], prefix: str) -> Iterator[tuple[Module, ast.ClassDef]]:
    for module in modules:
        if _within(module.name, prefix):
            yield from ((module, n) for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef))


def concrete_backend_subclasses(modules: Iterable[Module]) -> list[str]:
    """Classes under ``lockstep.backends`` with a base class that is defined there too and is not abstract
    (:func:`is_abstract`): shared backend logic is an abstract base, a function or a component, never a
    concrete backend to inherit from. Bases are matched by their class name; a name defined several times
    under ``backends/`` counts as concrete unless every definition is abstract."""
    modules = list(modules)
    abstract: dict[str, bool] = {}
    for _, node in _classes_within(modules, "lockstep.backends"):
        abstract[node.name] = abstract.get(node.name, True) and is_abstract(node)
    return [
        f"{module.name}:{node.lineno} {node.name} subclasses {_class_name(base)}, a concrete class of backends/"
        for module, node in _classes_within(modules, "lockstep.backends")
        for base in node.bases
        if abstract.get(_class_name(base)) is False
    ]


def open_backend_classes(modules: Iterable[Module]) -> list[str]:
    """Classes named ``*Backend`` under ``lockstep.backends`` that are neither decorated ``@final`` (or
    ``@typing.final``) nor abstract (:func:`is_abstract`)."""
    return [
        f"{module.name}:{node.lineno} {node.name} is neither @final nor abstract"
        for module, node in _classes_within(modules, "lockstep.backends")
        if node.name.endswith("Backend")
        and not is_abstract(node)
        and not any(_class_name(d) == "final" for d in node.decorator_list)
    ]


# -- the rules hold for lockstep ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return package_modules()


def test_no_source_file_is_over_800_lines(modules):
    assert oversized_files(modules) == []


def test_no_function_is_over_100_lines(modules):
    assert oversized_functions(modules) == []


def test_imports_follow_the_layers(modules):
    assert layer_violations(modules) == []


def test_no_import_cycles_not_even_for_type_checking(modules):
    assert import_cycles(modules) == []


def test_only_the_registry_and_config_ask_which_backend_is_active(modules):
    assert identity_checks(modules) == []


# -- the rules can fail ---------------------------------------------------------------------------------
def test_the_rules_catch_synthetic_violations():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    big = parse("lockstep.big", f"def f() -> None:\n{long_body}\n" + "\n" * MAX_FILE_LINES)
    assert oversized_files([big]) == [f"lockstep.big: {big.lines} lines"]
    assert oversized_functions([big]) == [f"lockstep.big.f: {MAX_FUNCTION_LINES + 2} lines"]

    backend = parse(
        "lockstep.backends.fake",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from lockstep.accelerator import Accelerator\n",
    )
    facade = parse("lockstep.accelerator", "from lockstep.backends import fake\n")
    assert layer_violations([backend, facade]) == [
        "lockstep.backends.fake:3 imports lockstep.accelerator (backends sit below the Accelerator)"
    ]
    assert import_cycles([backend, facade]) == [["lockstep.accelerator", "lockstep.backends.fake"]]

    lazy = parse(
        "lockstep.launcher.fake", "def run() -> None:\n    from lockstep.accelerator import facade\n"
    )
    assert layer_violations([lazy, parse("lockstep.accelerator.facade", "")]) == [
        "lockstep.launcher.fake:2 imports lockstep.accelerator.facade (the launcher starts processes and never "
        "knows the Accelerator)"
    ]

    branchy = parse(
        "lockstep.accelerator.fake",
        "def f(a, b):\n    if a.distributed_type == DistributedType.FSDP:\n        pass\n"
        "    if b in (DistributedType.NO, None):\n        pass\n    return isinstance(b, FSDPBackend)\n",
    )
    assert identity_checks([branchy]) == [
        "lockstep.accelerator.fake:2 compares a distributed type",
        "lockstep.accelerator.fake:4 compares a distributed type",
        "lockstep.accelerator.fake:6 asks which backend it has",
    ]
    allowed = parse("lockstep.backends.registry", "x = y.distributed_type == DistributedType.FSDP\n")
    assert identity_checks([allowed]) == []


def test_the_accelerator_loads_the_optional_parts_on_first_use():
    """`from lockstep import Accelerator` after torch stays small (BENCHMARKS.md, import cost): the utils
    package, checkpointing, safetensors, the profiler wrapper and regional compilation load when used."""
    import subprocess
    import sys

    code = (
        "import sys, torch; before = set(sys.modules); from lockstep import Accelerator; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    deferred = ("lockstep.utils", "lockstep.checkpoint", "safetensors", "lockstep.accelerator.profiling")
    assert [name for name in loaded if name.startswith(deferred) or "regional" in name] == []


# -- backends inherit from no concrete backend, and each is abstract or final ----------------------------
def test_no_backend_subclasses_a_concrete_backend(modules):
    assert concrete_backend_subclasses(modules) == []


def test_every_backend_class_is_final_or_abstract(modules):
    assert open_backend_classes(modules) == []


def test_the_backend_class_rules_catch_synthetic_violations():
    tree = parse(
        "lockstep.backends.fake",
        "import abc, typing\n"  # line 1
        "class Backend(abc.ABC):\n    pass\n"  # 2: abstract by its base
        "class SharedBackend(Backend):\n    @abc.abstractmethod\n    def mesh(self): ...\n"  # 4: abstract
        "@typing.final\nclass GoodBackend(SharedBackend):\n    pass\n"  # 8: final over an abstract base
        "class LooseBackend(Backend):\n    pass\n"  # 10: concrete and not final
        "@final\nclass ChildBackend(LooseBackend):\n    pass\n"  # 13: final, but over a concrete backend
        "class Helper(typing.Generic[T]):\n    pass\n"  # 15: concrete, not named *Backend
        "class Part(Helper[int]):\n    pass\n",  # 17: subclasses a concrete class of backends/
    )
    user_code = parse("tests.fake", "class MineBackend(LooseBackend):\n    pass\n")
    assert concrete_backend_subclasses([tree, user_code]) == [
        "lockstep.backends.fake:13 ChildBackend subclasses LooseBackend, a concrete class of backends/",
        "lockstep.backends.fake:17 Part subclasses Helper, a concrete class of backends/",
    ]
    assert open_backend_classes([tree, user_code]) == [
        "lockstep.backends.fake:10 LooseBackend is neither @final nor abstract"
    ]
    meta = parse(
        "lockstep.backends.meta", "class Base(metaclass=abc.ABCMeta):\n    pass\nclass A(Base):\n    pass\n"
    )
    assert concrete_backend_subclasses([meta]) == []
