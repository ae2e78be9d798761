"""No attribute is written onto another object from outside (issue 44, items 2 and 5).

A layer acts through the step hooks it is given (:mod:`lockstep.step_hooks`), never by writing its state onto
another package's optimizer, loader or manager (``prepared._step_observer = self`` was the pattern). The rule,
over parsed source: an assignment ``<object>._name = ...`` (also augmented, annotated and inside a tuple
target) or ``setattr(<object>, "_name", ...)`` with a private, non-dunder name is a violation unless the
object is

* ``self`` or ``cls`` (an object's own state);
* a function or class defined in the same function (an object the code made itself, e.g. a marker on a
  local hook);
* a class defined at the top of the same module (its own class attribute).

Anything else is someone else's object whose private state we write: each case that stays is in
:data:`ALLOWED` with the reason (a torch or CPython workaround, Accelerate's own behaviour on the user's
model, or a write onto another instance of the writer's own class), and an entry that no longer matches
fails, so the list stays the true list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator

import pytest

from tests.test_architecture import Module, package_modules, parse

ALLOWED: dict[tuple[str, str], str] = {
    ("lockstep.integrations.regional_compilation", "copy._modules"): (
        "the shallow copy of a module made with __new__ just before gets its own children dict (torch keeps "
        "children in _modules; there is no public way to build a module from another's __dict__)"
    ),
    ("lockstep.accelerator.scheduler", "self.scheduler._step_count"): (
        "torch's LRScheduler counts its steps in _step_count, which its warning reads; Accelerate's "
        "AcceleratedScheduler advances it the same way on accumulation micro-steps"
    ),
    ("lockstep.backends.pp.model", "model._uninitialised"): (
        "torch calls the load_state_dict post-hook with the PipelinedModel it is registered on (asserted): "
        "the writer's own class, reached through torch's hook signature"
    ),
    ("lockstep.layers.expert_parallel._layer", "model._ddp_params_and_buffers_to_ignore"): (
        "torch's DistributedDataParallel reads the parameters to leave out of its broadcast and all-reduce from "
        "this attribute of the module it wraps (its _set_params_and_buffers_to_ignore_for_model writes it): "
        "expert parallelism's experts are sharded over the ranks, not replicated"
    ),
    (
        "lockstep.layers.expert_parallel._layer",
        "param._ddp_ignored",
    ): "as model._ddp_params_and_buffers_to_ignore",
    ("lockstep.data._position", "loader._continues"): (
        "_continuing_copy builds the copy as type(self)(...) two lines before: its own class, just made"
    ),
    ("lockstep.data._position", "parent._pending_skip"): (
        "skip_first_batches' copy hands its position back to the loader it continues: another instance of "
        "the writer's own class (DataLoaderStateMixin)"
    ),
    ("lockstep.data._position", "parent._resume_mid_epoch"): "as parent._pending_skip",
    ("lockstep.data._position", "parent._resume_base_seed"): "as parent._pending_skip",
    ("lockstep.data._position", "parent._pending_global"): "as parent._pending_skip",
    ("lockstep.data._position", "parent._samples_before"): "as parent._pending_skip",
    ("lockstep.data._position", "parent._resume_lookahead_rng"): "as parent._pending_skip",
    ("lockstep.data._position", "parent._active_copy"): "as parent._pending_skip",
    ("lockstep.data._position", "self._continues._active_copy"): "as parent._pending_skip",
    ("lockstep.data._position", "iterator._base_seed"): (
        "a resumed epoch replays the workers' seeds: torch's multi-process iterator draws _base_seed when "
        "it is built and has no parameter for it"
    ),
    ("lockstep.data._position", "worker._worker_info"): (
        "as iterator._base_seed: in a resumed epoch's worker, get_worker_info().seed is the interrupted "
        "epoch's seed, which torch keeps in this module global and sets before worker_init_fn runs"
    ),
    ("lockstep.big_model.module_hooks", "module._old_forward"): (
        "Accelerate's add_hook_to_module keeps the original forward on the user's module under this name, "
        "and code written for Accelerate reads it there"
    ),
    (
        "lockstep.big_model.module_hooks",
        "module._hf_hook",
    ): "as module._old_forward (Accelerate's name for the hook)",
    ("lockstep.big_model.pipeline_inference", "model._original_forward"): (
        "Accelerate's prepare_pippy keeps the user's forward on the model under this name"
    ),
    ("lockstep.big_model.pipeline_inference", "model._original_call"): "as model._original_forward",
    ("lockstep.launcher._worker", "os._exit"): (
        "a forkserver worker of torch elastic reports success through os._exit; the launcher wraps it to "
        "learn the exit code (the function's docstring)"
    ),
    ("lockstep.launcher._worker", "server._forkserver_alive_fd"): (
        "CPython's forkserver hands its keep-alive pipe to every child; closing the worker's copy lets the "
        "server end with the launcher"
    ),
    ("lockstep.launcher.notebook", "stream._buffer_lock"): (
        "ipykernel's streams guard their buffer with a lock a forked worker inherits taken; the worker gets "
        "a free one (the function's docstring)"
    ),
    ("lockstep.trainer.seq2seq", "config._from_model_config"): (
        "transformers' generate() clears this flag of the generation config once it has read the model's "
        "settings; the Trainer does what generate() does"
    ),
}
"""(module, the written target as source) -> why it stays."""


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope`` itself, not of the functions and classes nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    else:
        return
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            yield target


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _written(node: ast.AST) -> Iterator[tuple[ast.expr, str]]:
    """(the object, the text reported) of each private attribute ``node`` writes."""
    for target in _targets(node):
        if isinstance(target, ast.Attribute) and _private(target.attr):
            yield target.value, ast.unparse(target)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
            if isinstance(name, str) and _private(name):
                yield node.args[0], f"{ast.unparse(node.args[0])}.{name}"


def foreign_attribute_writes(modules: Iterable[Module]) -> list[tuple[str, str, int]]:
    """(module, written target, line) of every private attribute written onto an object the code does not
    own (see the module doc)."""
    found = []
    for module in modules:
        own_classes = {node.name for node in module.tree.body if isinstance(node, ast.ClassDef)}
        scopes = [
            module.tree,
            *(n for n in ast.walk(module.tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
        ]
        for scope in scopes:
            nodes = list(_own_nodes(scope))
            made_here = {
                node.name
                for node in nodes
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            }
            owned = {"self", "cls"} | own_classes | made_here
            for node in nodes:
                for target, text in _written(node):
                    if isinstance(target, ast.Name) and target.id in owned:
                        continue
                    found.append((module.name, text, node.lineno))
    return sorted(found, key=lambda entry: (entry[0], entry[2], entry[1]))


def violations(modules: Iterable[Module]) -> list[str]:
    return [
        f"{name}:{line} writes {text} onto an object it does not own"
        for name, text, line in foreign_attribute_writes(modules)
        if (name, text) not in ALLOWED
    ]


@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return package_modules()


def test_no_private_attribute_is_written_onto_another_object(modules):
    assert violations(modules) == []


def test_every_allowed_write_still_exists(modules):
    found = {(name, text) for name, text, _ in foreign_attribute_writes(modules)}
    assert sorted(set(ALLOWED) - found) == []


def test_the_rule_catches_synthetic_violations():
    source = (
        "import types\n"
        "class Own:\n"
        "    _context = None\n"
        "    def watch(self, prepared, optimizer):\n"
        "        prepared._step_observer = self\n"
        "        setattr(optimizer, '_on_step', self.note)\n"
        "        self.optimizer._hooks = []\n"
        "        first, prepared._pair = 1, 2\n"
        "        prepared._count += 1\n"
        "        self._mine = 1\n"
        "        Own._context = self\n"
        "        prepared.public = 1\n"
        "        prepared.__wrapped__ = None\n"
        "    @classmethod\n"
        "    def reset(cls):\n"
        "        cls._context = None\n"
        "def install(previous):\n"
        "    def hook():\n"
        "        return previous()\n"
        "    hook._marker = True\n"
        "    previous._marker = True\n"
        "    made = types.SimpleNamespace()\n"
        "    made._x = 1\n"
    )
    assert violations([parse("lockstep.fake", source)]) == [
        "lockstep.fake:5 writes prepared._step_observer onto an object it does not own",
        "lockstep.fake:6 writes optimizer._on_step onto an object it does not own",
        "lockstep.fake:7 writes self.optimizer._hooks onto an object it does not own",
        "lockstep.fake:8 writes prepared._pair onto an object it does not own",
        "lockstep.fake:9 writes prepared._count onto an object it does not own",
        "lockstep.fake:21 writes previous._marker onto an object it does not own",
        "lockstep.fake:23 writes made._x onto an object it does not own",
    ]
    allowed = parse(
        "lockstep.accelerator.scheduler", "def step(self):\n    self.scheduler._step_count += 1\n"
    )
    assert violations([allowed]) == []
