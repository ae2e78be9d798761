"""The style guide, executable: file and function sizes, import layers, and backend identity asked in one
place only (import circles: tests/test_architecture_imports.py).

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
DELEGATION_MAX_FILE_LINES = 1300
"""The cap for the two files whose length is one-line delegations: the Accelerator's members of its parts
(``facade.py``: ``accelerator.gather(...)`` forwards to the collectives part, each member written in the class
so that readers, type checkers and grep find it) and the Trainer's methods over its helper modules. Splitting
them further would hide members again (forwarding decorators, class-body bindings); Lightning Fabric's
``fabric.py`` is 1,260 lines for the same reason."""
DELEGATION_FILES = ("lockstep.accelerator.facade", "lockstep.trainer.trainer")

# (importer prefix, imported prefixes it must not import, why)
FORBIDDEN_IMPORTS = [
    (
        "lockstep.backends",
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "backends sit below the Accelerator",
    ),
    (
        "lockstep.layers",
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "layers sit below the Accelerator, which runs their step hooks",
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
            "lockstep.layers",
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
    "lockstep.integrations",
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
    "lockstep.big_modeling",
    "lockstep.hooks",
    "lockstep.big_model",
    "lockstep.inference",
    "lockstep.step_hooks",
)
FORBIDDEN_IMPORTS += [
    (
        prefix,
        ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher"),
        "engine and feature modules sit below the Accelerator",
    )
    for prefix in BELOW_FACADE
]
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
    return [
        f"{m.name}: {m.lines} lines"
        for m in modules
        if m.lines > (DELEGATION_MAX_FILE_LINES if m.name in DELEGATION_FILES else MAX_FILE_LINES)
    ]


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
            for importer, forbidden, why in FORBIDDEN_IMPORTS:
                if _within(module.name, importer) and any(_within(imported, f) for f in forbidden):
                    found.append(f"{module.name}:{line} imports {imported} ({why})")
    return found


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


def test_no_source_file_is_over_800_lines_or_the_delegation_cap(modules):
    assert oversized_files(modules) == []


def test_no_function_is_over_100_lines(modules):
    assert oversized_functions(modules) == []


def test_imports_follow_the_layers(modules):
    assert layer_violations(modules) == []


def test_only_the_registry_and_config_ask_which_backend_is_active(modules):
    assert identity_checks(modules) == []


# -- the rules can fail ---------------------------------------------------------------------------------
def test_the_rules_catch_synthetic_violations():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    big = parse("lockstep.big", f"def f() -> None:\n{long_body}\n" + "\n" * MAX_FILE_LINES)
    assert oversized_files([big]) == [f"lockstep.big: {big.lines} lines"]
    facade = parse("lockstep.accelerator.facade", "\n" * MAX_FILE_LINES)
    assert oversized_files([facade]) == []  # over 800, under the delegation cap
    facade = parse("lockstep.accelerator.facade", "\n" * DELEGATION_MAX_FILE_LINES)
    assert oversized_files([facade]) == [
        f"lockstep.accelerator.facade: {DELEGATION_MAX_FILE_LINES + 1} lines"
    ]
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


# -- every spelling of "which backend is this?" -----------------------------------------------------------
# Asking which backend is active is the registry's job (a loop over the specs) and the configuration
# vocabulary's; everything else asks a backend for a capability. These are the spellings found in use.
IDENTITY_HOMES = ("lockstep.backends", "lockstep.layers", "lockstep.config")
"""Where backend vocabulary may be spelled: the backends' and layers' own folders (and their specs) and
config/."""
SETTINGS_RESOLUTION = (
    "lockstep.accelerator.settings",
    "lockstep.trainer.accelerator_factory",
)
"""Where arguments become plugin objects (Fabric's connector: the Accelerator's settings, and the Trainer's
mapping of TrainingArguments onto them): which plugins and mesh sizes were given is what they resolve."""
PLUGIN_ATTRIBUTES = (
    "fsdp_plugin",
    "deepspeed_plugin",
    "deepspeed_plugins",
    "torch_tp_plugin",
    "megatron_lm_plugin",
)
MESH_SIZES = (
    "pp_size",
    "tp_size",
    "cp_size",
    "sp_size",
    "dp_shard_size",
    "dp_replicate_size",
    "pp_enabled",
    "tp_enabled",
    "cp_enabled",
    "sp_enabled",
    "dp_shard_enabled",
    "dp_replicate_enabled",
)


def _backend_sections() -> tuple[str, ...]:
    from lockstep.config.backend_specs import sectioned_specs

    return tuple(spec.config_section for spec in sectioned_specs() if spec.config_section)


def _names_in(node: ast.AST) -> Iterator[str]:
    """The attribute or variable names an expression ends in (``a.b.fsdp_plugin`` -> ``fsdp_plugin``)."""
    if isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Name):
        yield node.id


def _attributes_in(node: ast.AST) -> Iterator[str]:
    """The attribute an expression reads (``a.b.fsdp_plugin`` -> ``fsdp_plugin``); a bare name (a function's
    own ``fsdp_plugin`` argument being checked) is not asking which backend is active."""
    if isinstance(node, ast.Attribute):
        yield node.attr


def _tested_expressions(tree: ast.AST) -> Iterator[tuple[ast.AST, int]]:
    """Expressions used as conditions or compared: every operand of a comparison, the test of an ``if``,
    ``while``, conditional expression or ``assert``, and the operands of ``and``/``or``/``not``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                yield operand, node.lineno
                if isinstance(operand, ast.Tuple | ast.List | ast.Set):
                    yield from ((e, node.lineno) for e in operand.elts)
        elif isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            yield node.test, node.lineno
        elif isinstance(node, ast.BoolOp):
            yield from ((v, node.lineno) for v in node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node.operand, node.lineno


def backend_identity_spellings(modules: Iterable[Module], sections: tuple[str, ...]) -> list[str]:
    """Outside the backends and config: a backend's config section compared as a string, a plugin's
    presence tested, a mesh size compared or tested, ``match`` on a distributed type."""
    found: set[str] = set()
    for module in modules:
        if any(_within(module.name, home) for home in IDENTITY_HOMES):
            continue
        resolving = any(_within(module.name, home) for home in SETTINGS_RESOLUTION)
        for expression, line in _tested_expressions(module.tree):
            names = set(_attributes_in(expression))
            if isinstance(expression, ast.Constant) and expression.value in sections:
                found.add(f"{module.name}:{line} compares the config section {expression.value!r}")
            elif names & set(PLUGIN_ATTRIBUTES) and not resolving:
                found.add(f"{module.name}:{line} tests whether {sorted(names)[0]} is given")
            elif names & set(MESH_SIZES) and not resolving:
                found.add(f"{module.name}:{line} tests the mesh size {sorted(names)[0]}")
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Match) and _is_identity_operand(node.subject):
                found.add(f"{module.name}:{node.lineno} matches on a distributed type")
    return sorted(found, key=lambda entry: (entry.split(":")[0], int(entry.split(":")[1].split()[0])))


def _classes_defined_under(modules: Iterable[Module], package: str) -> set[str]:
    return {
        node.name
        for module in modules
        if _within(module.name, package)
        for node in ast.walk(module.tree)
        if isinstance(node, ast.ClassDef)
    }


def backend_class_checks(modules: Iterable[Module], backend_classes: set[str]) -> list[str]:
    """``isinstance``/``issubclass`` against a class defined under ``backends/``, outside ``backends/``."""
    found = []
    for module in modules:
        if _within(module.name, "lockstep.backends"):
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                kinds = node.args[1:2]
                if kinds and isinstance(kinds[0], ast.Tuple):
                    kinds = kinds[0].elts
                named = [n for k in kinds for n in _names_in(k) if n in backend_classes]
                if named:
                    found.append(f"{module.name}:{node.lineno} asks whether an object is a {named[0]}")
    return found


def _package_of(name: str) -> str:
    """``lockstep.trainer._x`` -> ``lockstep.trainer``; top-level modules belong to ``lockstep``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else "lockstep"


def private_imports(modules: Iterable[Module]) -> list[str]:
    """``from lockstep.x._y import ...`` or ``from lockstep.x.y import _z`` outside package ``lockstep.x``
    (a package's private modules and names are its own)."""
    modules = list(modules)
    packages = {m.name for m in modules if m.path.name == "__init__.py"}
    found = []
    for module in modules:
        own = module.name if module.name in packages else module.name.rpartition(".")[0]
        for node in ast.walk(module.tree):
            if (
                not isinstance(node, ast.ImportFrom)
                or node.level
                or not (node.module or "").startswith("lockstep.")
            ):
                continue
            target = node.module or ""
            top = ".".join(target.split(".")[:2])
            if top not in packages or _within(own, top):
                continue
            private_module = any(part.startswith("_") for part in target.split(".")[2:])
            private_names = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
            if private_module or private_names:
                what = target if private_module else f"{target}.{private_names[0]}"
                found.append(f"{module.name}:{node.lineno} imports {what}, private to {top}")
    return found


def trainer_internal_imports(modules: Iterable[Module]) -> list[str]:
    """The Trainer is built on the public Accelerator API: no ``lockstep.backends.*``/``lockstep.checkpoint.*``."""
    modules = list(modules)
    known = {m.name for m in modules}
    found = []
    for module in modules:
        if not _within(module.name, "lockstep.trainer"):
            continue
        for imported, line in imported_names(module, known):
            for internal in ("lockstep.backends", "lockstep.checkpoint"):
                if imported.startswith(internal + "."):
                    found.append(f"{module.name}:{line} imports {imported} (a {internal} internal)")
    return found


def test_backend_identity_is_asked_nowhere_else(modules):
    assert backend_identity_spellings(modules, _backend_sections()) == []


def test_no_isinstance_against_backend_classes_outside_backends(modules):
    assert backend_class_checks(modules, _classes_defined_under(modules, "lockstep.backends")) == []


def test_no_package_imports_another_packages_private_names(modules):
    assert private_imports(modules) == []


def test_the_trainer_imports_no_backend_or_checkpoint_internals(modules):
    assert trainer_internal_imports(modules) == []


def test_the_identity_rules_catch_synthetic_violations():
    sections = ("fsdp_config", "deepspeed_config")
    source = (
        "def f(a, launch):\n"
        "    if config_section(a) == 'fsdp_config':\n"  # 2
        "        pass\n"
        "    if a.state.fsdp_plugin is not None:\n"  # 4
        "        pass\n"
        "    ok = a.deepspeed_plugin and True\n"  # 6
        "    if a.parallelism_config.pp_size > 1:\n"  # 7
        "        pass\n"
        "    if not a.config.cp_enabled:\n"  # 9
        "        pass\n"
        "    match a.distributed_type:\n"  # 11
        "        case DistributedType.FSDP:\n"
        "            pass\n"
        "    return isinstance(a.model, (int, PipelinedModel))\n"  # 14
    )
    fake = parse("lockstep.accelerator.fake", source)
    assert backend_identity_spellings([fake], sections) == [
        "lockstep.accelerator.fake:2 compares the config section 'fsdp_config'",
        "lockstep.accelerator.fake:4 tests whether fsdp_plugin is given",
        "lockstep.accelerator.fake:6 tests whether deepspeed_plugin is given",
        "lockstep.accelerator.fake:7 tests the mesh size pp_size",
        "lockstep.accelerator.fake:9 tests the mesh size cp_enabled",
        "lockstep.accelerator.fake:11 matches on a distributed type",
    ]
    home = parse("lockstep.backends.fsdp.spec", source)
    assert backend_identity_spellings([home], sections) == []
    defines = parse("lockstep.backends.pp.model", "class PipelinedModel:\n    pass\n")
    assert backend_class_checks(
        [fake, home, defines], _classes_defined_under([defines], "lockstep.backends")
    ) == ["lockstep.accelerator.fake:14 asks whether an object is a PipelinedModel"]

    package = parse("lockstep.data", "", Path("lockstep/data/__init__.py"))
    private = parse(
        "lockstep.trainer.fake",
        "from lockstep.data._position import x\nfrom lockstep.data.samplers import _helper\n"
        "from lockstep.trainer._own import y\nfrom lockstep.backends.fsdp.units import select_units\n",
    )
    assert private_imports(
        [package, private, parse("lockstep.trainer", "", Path("lockstep/trainer/__init__.py"))]
    ) == [
        "lockstep.trainer.fake:1 imports lockstep.data._position, private to lockstep.data",
        "lockstep.trainer.fake:2 imports lockstep.data.samplers._helper, private to lockstep.data",
    ]
    assert trainer_internal_imports([private, parse("lockstep.backends.fsdp.units", "")]) == [
        "lockstep.trainer.fake:4 imports lockstep.backends.fsdp.units (a lockstep.backends internal)"
    ]


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
