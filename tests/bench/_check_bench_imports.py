"""Import every script under bench/ and bench/peers/ as its runner would, call its ``main()`` with ``--help``,
and check that every name it imports from a local module or a package exists. Prints one JSON report.

    python tests/bench/_check_bench_imports.py REPO

Run in its own interpreter (by tests/bench/test_bench_scripts.py): the scripts set torch's thread count
and put bench/ on ``sys.path``, and two of them share module names with nothing else here only by luck.

A script's path is the one its runner gives it: bench/*.py run with bench/ first (``python bench/x.py``);
bench/peers/*.py run with bench/peers/ then bench/ (``bench/peers/run.py`` sets ``PYTHONPATH``). The
peers' packages (``accelerate``, ``lightning_fabric``) are imported inside functions only; where they are
not installed, the names taken from them are listed as ``unchecked`` instead of being checked.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import sys
from pathlib import Path

PEER_PACKAGES = ("accelerate", "lightning_fabric")


def search_path(script: Path, bench: Path) -> list[Path]:
    return [script.parent, bench] if script.parent != bench else [bench]


def imported_names(tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """(module, name or None for ``import module``, line) for every import, at any depth."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


def local_file(module: str, folders: list[Path]) -> Path | None:
    parts = module.split(".")
    for folder in folders:
        candidate = folder.joinpath(*parts).with_suffix(".py")
        if candidate.is_file():
            return candidate
    return None


def check_import(module: str, name: str | None, *, script: Path, bench: Path) -> str | None:
    """None when ``module`` (and ``name`` in it) can be imported from ``script``; else what is wrong;
    ``"unchecked"`` for a peers' package that is not installed here."""
    top = module.split(".")[0]
    everywhere = [bench, bench / "peers"]
    if local_file(module, everywhere) and not local_file(module, search_path(script, bench)):
        return f"{module} is a bench module, but not on the path {script.name} runs with"
    if top in PEER_PACKAGES and importlib.util.find_spec(top) is None:
        return "unchecked"
    if name is None and top not in ("lockstep", *PEER_PACKAGES) and not local_file(module, everywhere):
        # a plain third-party ``import x.y``: found is enough (matplotlib.pyplot alone costs 1.5 s)
        return None if importlib.util.find_spec(module) else f"no module named {module!r} is installed"
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        return f"import {module} failed: {error}"
    if name is None or hasattr(imported, name) or _submodule_exists(f"{module}.{name}"):
        return None
    return f"{module} defines no {name!r}"


def _submodule_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def run_help(module: object) -> str | None:
    """Call the script's ``main()`` with ``--help``: argparse builds its parser and exits 0."""
    main = getattr(module, "main", None)
    if main is None:
        return None
    sys.argv = [f"{module.__name__}.py", "--help"]
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            main()
    except SystemExit as exit_:
        if exit_.code in (0, None) and "usage:" in output.getvalue():
            return None
        return f"main() --help exited {exit_.code!r}: {output.getvalue()[-500:]}"
    return "main() --help returned without exiting (it ran the benchmark?)"


def check_script(script: Path, bench: Path) -> dict:
    report: dict = {"problems": [], "unchecked": []}
    tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    sys.path[:0] = [str(p) for p in search_path(script, bench)]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module(script.stem)
        report["help"] = "main" in vars(module)
        problem = run_help(module)
        if problem:
            report["problems"].append(problem)
        for imported, name, line in imported_names(tree):
            problem = check_import(imported, name, script=script, bench=bench)
            where = (
                f"line {line}: from {imported} import {name}" if name else f"line {line}: import {imported}"
            )
            if problem == "unchecked":
                report["unchecked"].append(where)
            elif problem:
                report["problems"].append(f"{where}: {problem}")
    except Exception as error:  # the report names every script's failure, not only the first
        report["problems"].append(f"{type(error).__name__}: {error}")
    finally:
        del sys.path[: len(search_path(script, bench))]
    return report


def main() -> None:
    bench = Path(sys.argv[1]).resolve() / "bench"
    scripts = sorted(bench.glob("*.py")) + sorted(bench.glob("peers/*.py"))
    report = {str(script.relative_to(bench.parent)): check_script(script, bench) for script in scripts}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
