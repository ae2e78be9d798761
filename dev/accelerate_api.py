"""Write Accelerate's public surface (names and signatures) to ``tests/accelerate_1_15_surface.json``.

Run it with the reference environment's python, the one that has the real ``accelerate`` (never lockstep's):

    .venv-reference/bin/python dev/accelerate_api.py

It imports ``accelerate`` and lists, for each public module, its public names:

- ``accelerate`` and ``accelerate.utils`` (packages that re-export): every name their ``__init__.py`` imports,
  those behind an ``is_X_available()`` guard included (read from the source, so that the list does not
  depend on which extras the reference environment has), private names left out;
- ``Accelerator``: its public methods and properties (``accelerator_members``) and the other public
  attributes its methods assign on ``self`` (``accelerator_attributes``);
- every other module: the classes and functions it defines, its public module-level assignments (not its
  ``logger``) and the names of its ``__all__``; what it merely imports from elsewhere is left out.

For each callable, its signature as data: ``[name, kind, default]`` per parameter, in order, with the default
as its ``repr`` (``null`` when there is none; memory addresses blanked, the home folder written ``~``). Classes give their constructor's
signature, methods include ``self``. A guarded name that does not import here is listed with
``"signature": null`` and the reason. ``tests/test_api_coverage.py`` compares lockstep with this file.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "accelerate_1_15_surface.json"
COMMAND = ".venv-reference/bin/python dev/accelerate_api.py"
PACKAGES = {"top_level": "accelerate", "utils": "accelerate.utils"}
MODULES = {
    "local_sgd": "accelerate.local_sgd",
    "hooks": "accelerate.hooks",
    "big_modeling": "accelerate.big_modeling",
    "data_loader": "accelerate.data_loader",
    "launchers": "accelerate.launchers",
    "inference": "accelerate.inference",
    "tracking": "accelerate.tracking",
    "logging": "accelerate.logging",
    "state": "accelerate.state",
    "checkpointing": "accelerate.checkpointing",
    "optimizer": "accelerate.optimizer",
    "scheduler": "accelerate.scheduler",
}
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def default_repr(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    # Memory addresses blanked, and the home folder (in defaults computed at import) written as ~.
    return _ADDRESS.sub("", repr(value)).replace(str(Path.home()), "~")


def signature_of(value: Any) -> list[list[str | None]] | None:
    """``[name, kind, default repr]`` per parameter, or None for what has no signature (a property, a value)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if not callable(value) or isinstance(value, property):
        return None
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, default_repr(p.default)] for p in signature.parameters.values()]


def kind_of(value: Any) -> str:
    if isinstance(value, property):
        return "property"
    if isinstance(value, (staticmethod, classmethod)):
        return type(value).__name__
    if inspect.isclass(value):
        return "class"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return "function"
    if inspect.ismodule(value):
        return "module"
    return "callable" if callable(value) else "value"


def entry(value: Any) -> dict[str, Any]:
    return {"kind": kind_of(value), "signature": signature_of(value)}


def imported_names(path: Path) -> dict[str, tuple[str, str]]:
    """Public names an ``__init__.py`` imports anywhere (guards included): name -> (relative module, original)."""
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            source = "." * node.level + (node.module or "")
            for alias in node.names:
                name = alias.asname or alias.name
                if not name.startswith("_"):
                    names.setdefault(name, (source, alias.name))
    return names


def package_section(package_name: str) -> dict[str, Any]:
    package = importlib.import_module(package_name)
    section: dict[str, Any] = {}
    for name, (source, original) in imported_names(Path(package.__file__)).items():
        if hasattr(package, name):
            section[name] = entry(getattr(package, name))
            continue
        try:  # behind a guard the reference environment does not meet: read it from its module
            module = importlib.import_module(source, package_name)
            section[name] = {**entry(getattr(module, original)), "guarded": True}
        except Exception as error:
            reason = f"not importable in the reference environment: {type(error).__name__}: {error}"
            section[name] = {"kind": "unknown", "signature": None, "guarded": True, "note": reason[:200]}
    return dict(sorted(section.items()))


def top_level_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body, those inside top-level ``if``/``try`` blocks included."""
    statements: list[ast.stmt] = []
    for node in body:
        statements.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                statements.extend(top_level_statements(block))
    return statements


def defined_names(module: Any) -> list[str]:
    """Classes, functions and public assignments a module defines at top level (guards included), and __all__."""
    names: list[str] = list(getattr(module, "__all__", []))
    for node in top_level_statements(ast.parse(inspect.getsource(module)).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend(t.id for t in targets if isinstance(t, ast.Name) and t.id != "logger")
    return sorted({name for name in names if not name.startswith("_") and hasattr(module, name)})


def module_section(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    return {name: entry(getattr(module, name)) for name in defined_names(module)}


def undecorated(function: Any) -> Any:
    """The function a decorator without ``functools.wraps`` wrapped (Accelerate's ``@on_main_process`` methods
    show ``(*args, **kwargs)`` otherwise): the one function in its closure."""
    signature = inspect.signature(function)
    kinds = [p.kind for p in signature.parameters.values()]
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    inner = [value for value in cells if inspect.isfunction(value)]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and len(inner) == 1:
        return inner[0]
    return function


def member_entry(value: Any) -> dict[str, Any]:
    """A member as called on an instance: ``self`` (or ``cls``) left out of its signature."""
    if isinstance(value, staticmethod) or (not callable(value) and not isinstance(value, classmethod)):
        return entry(value)
    function = value.__func__ if isinstance(value, classmethod) else undecorated(value)
    signature = signature_of(function)
    return {
        "kind": kind_of(value) if isinstance(value, classmethod) else "method",
        "signature": signature[1:],
    }


def accelerator_sections() -> tuple[dict[str, Any], dict[str, Any]]:
    from accelerate import Accelerator

    members = {
        name: member_entry(value) for name, value in vars(Accelerator).items() if not name.startswith("_")
    }
    assigned: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(Accelerator))):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self" and not target.attr.startswith("_"):
                        assigned.add(target.attr)
    attributes = {name: {"kind": "attribute", "signature": None} for name in sorted(assigned - set(members))}
    return members, attributes


def surface() -> dict[str, Any]:
    import accelerate

    members, attributes = accelerator_sections()
    sections: dict[str, Any] = {"accelerator_members": members, "accelerator_attributes": attributes}
    sections.update({section: package_section(name) for section, name in PACKAGES.items()})
    sections.update({section: module_section(name) for section, name in MODULES.items()})
    return {
        "generated_by": f"{COMMAND}  (the reference environment's python; see the script's docstring)",
        "accelerate_version": accelerate.__version__,
        "python": sys.version.split()[0],
        "modules": {
            "accelerator_members": "accelerate.Accelerator",
            "accelerator_attributes": "accelerate.Accelerator()",
        }
        | PACKAGES
        | MODULES,
        "sections": sections,
    }


def main(argv: list[str]) -> None:
    """Write the surface to ``argv[0]`` when given (the reference test compares it with the committed file),
    else to :data:`OUTPUT`."""
    output = Path(argv[0]) if argv else OUTPUT
    output.write_text(json.dumps(surface(), indent=1) + "\n", encoding="utf-8")
    data = json.loads(output.read_text(encoding="utf-8"))
    counts = {section: len(names) for section, names in data["sections"].items()}
    print(f"wrote {output} (Accelerate {data['accelerate_version']}): {counts}")


if __name__ == "__main__":
    main(sys.argv[1:])
