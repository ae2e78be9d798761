"""Workers forked from a process that has already imported torch, instead of fresh interpreters.

Every fresh worker interpreter pays for ``import torch``, at its first optimizer for ``torch._dynamo``
(measured here: about 1 CPU-second each on an idle core, 2-3 under load) and, in a transformers script,
for transformers, and keeps a private copy of those modules' memory. With ``LOCKSTEP_PRELOAD_WORKERS=1``,
``lockstep launch`` instead asks torch's elastic agent to start the workers with multiprocessing's
``forkserver`` method, the server importing those libraries once: each worker is a fork of it, running
the same bootstrap (``lockstep.launcher._worker``) as a fresh interpreter would, so the script still runs
as ``__main__`` with its own ``sys.argv``, environment, session, output streams, ``atexit`` handlers,
numpy seed and error record (``_worker.run_forked``); what the server imported stays out of the worker's
garbage collection, so that its pages stay shared. Off by default: torchrun and ``accelerate launch``
start fresh interpreters, and a fork can differ from one in ways no check here covers.

The server imports :data:`BASE_MODULES` and those of :data:`FORK_SAFE_LIBRARIES` that the script imports at
its top level, read from its source without running it (:func:`libraries_to_preload`). Fresh interpreters
are kept where preloading could change what the script sees, or would gain nothing:

- the script imports none of those libraries at its top level (a script without torch, ``--no-python``);
- the script writes ``os.environ`` (or ``os.putenv``) at its top level: a library it imports afterwards may
  read the variable at import time (``HF_HOME``, ``TORCH_LOGS``, ...), and a preloaded one would not;
- a second launch from one process with another environment (the forkserver keeps the one it started
  with).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import Any

from lockstep import _env

PRELOAD_WORKERS = _env.PRELOAD_WORKERS

BASE_MODULES = ("lockstep.launcher._worker", "torch", "torch.distributed", "torch._dynamo", "lockstep")
"""What the server imports for any script it preloads (``torch._dynamo``: the first optimizer imports it)."""

FORK_SAFE_LIBRARIES = frozenset(
    {
        "torch",
        "lockstep",
        "numpy",
        "transformers",
        "datasets",
        "evaluate",
        "peft",
        "safetensors",
        "accelerate",
    }
)
"""Libraries whose import starts no thread and opens nothing a fork would share: the server may import
them for a script that imports them at its top level (``torch`` or ``lockstep`` brings :data:`BASE_MODULES`)."""

_server_environment: dict[str, str] | None = None
"""The environment the forkserver of this process started with, once it has."""


def preloading_requested(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(PRELOAD_WORKERS, "").strip().lower() in {"1", "true", "yes", "on"}


def libraries_to_preload(target: str, *, module: bool = False) -> list[str]:
    """The modules the server should import for ``target`` (a script path, or a module name with
    ``module``), or ``[]`` for fresh interpreters (see the module's docstring for when).

    Example:
        >>> import tempfile
        >>> script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
        >>> _ = script.write("import os\\nimport torch\\nfrom transformers import AutoModel\\nimport mylib\\n")
        >>> script.close()
        >>> libraries_to_preload(script.name)[-1]
        'transformers'
    """
    source = _source_of(target, module)
    if source is None:
        return []
    try:
        statements = _top_level_statements(ast.parse(source).body)
    except (SyntaxError, ValueError):
        return []  # the fresh interpreter will report it as Python does
    if any(_writes_the_environment(statement) for statement in statements):
        return []
    imported = {name for statement in statements for name in _imported_roots(statement)}
    libraries = sorted((imported & FORK_SAFE_LIBRARIES) - {"torch", "lockstep"})
    if not imported & FORK_SAFE_LIBRARIES:
        return []
    return [*BASE_MODULES, *(name for name in libraries if importlib.util.find_spec(name) is not None)]


def _source_of(target: str, module: bool) -> str | None:
    try:
        if module:
            spec = importlib.util.find_spec(target)
            origin = spec.origin if spec is not None else None
            if origin is None or not origin.endswith(".py"):
                return None
            target = origin
        return Path(target).read_text(encoding="utf-8")
    except (OSError, ImportError, ValueError, UnicodeDecodeError):
        return None


def _top_level_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when the module runs: into ``if``/``try``/``with`` blocks, not into
    function or class bodies."""
    found: list[ast.stmt] = []
    for statement in body:
        found.append(statement)
        if isinstance(statement, (ast.If, ast.With, ast.For, ast.While)):
            found += _top_level_statements(statement.body + getattr(statement, "orelse", []))
        elif isinstance(statement, ast.Try):
            handlers = [line for handler in statement.handlers for line in handler.body]
            found += _top_level_statements(statement.body + handlers + statement.orelse + statement.finalbody)
    return found


def _imported_roots(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Import):
        return [alias.name.split(".")[0] for alias in statement.names]
    if isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
        return [statement.module.split(".")[0]]
    return []


def _writes_the_environment(statement: ast.stmt) -> bool:
    """``os.environ[...] = ...``, ``del os.environ[...]``, ``os.environ.update/setdefault/pop(...)``,
    ``os.putenv(...)`` and the like in a top-level statement (reading the environment is fine)."""
    for node in _nodes_outside_functions(statement):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
                return True
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if name in {"putenv", "unsetenv"}:
                return True
            if (
                isinstance(function, ast.Attribute)
                and _is_environ(function.value)
                and name in _WRITING_METHODS
            ):
                return True
    return False


_WRITING_METHODS = frozenset(
    {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
)


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _nodes_outside_functions(node: ast.AST) -> list[ast.AST]:
    found, pending = [], [node]
    while pending:
        current = pending.pop()
        found.append(current)
        if not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(current))
    return found


def can_preload() -> bool:
    """Whether this launch may fork its workers from a preloaded server: asked for, and this process has
    no forkserver yet or one started with the same environment."""
    if not preloading_requested():
        return False
    return _server_environment is None or _server_environment == dict(os.environ)


def preloaded_start(modules: list[str]) -> tuple[Any, str]:
    """Start the forkserver (it imports ``modules`` while the launcher goes on) and return the worker
    entry point and start method for torch's agent. Call it once the workers' environment is set: the
    server and every worker forked from it start with this process's environment."""
    import multiprocessing
    from multiprocessing import forkserver

    global _server_environment
    from lockstep.launcher import _worker

    multiprocessing.set_forkserver_preload(modules)
    forkserver.ensure_running()
    _server_environment = dict(os.environ)
    return _worker.run_forked, "forkserver"
