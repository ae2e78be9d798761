"""The spellings of "which backend?" that :mod:`tests.test_architecture` does not see (issue 44, item 5).

``tests/test_architecture.py`` catches ``DistributedType`` comparisons, ``isinstance(x, *Backend)``, config
sections as strings, plugin presence tests, mesh size tests, ``match`` on a distributed type and
``isinstance`` against classes of ``backends/``. The rules here catch the other five, each as a function over
parsed source (tested on synthetic modules, so each can fail) and then run over ``src/lockstep``:

(a) a call of a predicate of :mod:`lockstep.config.topology` (``topology.is_plain(...)``, ``is_fsdp2(...)``);
(b) ``getattr``/``hasattr`` probing an attribute of a backend's vocabulary (its plugin's fields, the plugin
    attributes of the state, the attributes that backends' optimizers and engines grow);
(c) a reference to torch's or DeepSpeed's distributed module wrappers (``FSDPModule``,
    ``DistributedDataParallel``, ``DeepSpeedEngine``, ...), ``isinstance`` against them included;
(d) a registered backend's name, ``TrainingArguments`` field or ``Accelerator`` keyword as a string constant
    that something is looked up by or compared with;
(e) ``zero_stage`` compared or tested.

Outside the homes (``backends/`` and ``config/``, plus the few modules named below with the reason), code asks
the backend for a capability (``accelerator.capability(Kind)``, :mod:`lockstep.backends.capabilities`) or
calls a function of the backend's folder.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterable, Iterator

import pytest

from tests.test_architecture import (
    IDENTITY_HOMES,
    PLUGIN_ATTRIBUTES,
    Module,
    _attributes_in,
    _tested_expressions,
    _within,
    package_modules,
    parse,
)

TOPOLOGY_MODULE = "lockstep.config.topology"
STATE_RECORD = ("lockstep.state",)
"""The process state records the Accelerator's resolved settings under its keywords (``fsdp_plugin``, the
distributed type) and answers Accelerate's questions about them (``is_fsdp2``, ``multi_device``,
``uses_deepspeed``): everything else asks the state."""
TOPOLOGY_READERS = (*STATE_RECORD, "lockstep.launcher.settings")
"""Besides the homes, who reads :mod:`lockstep.config.topology`'s answers: the state, and the launcher's
settings, which resolve the distributed type from the flags and the config file (a plain type over several
processes becomes data parallel)."""
CONNECTOR = ("lockstep.accelerator.settings",)
"""Where the ``Accelerator``'s keywords and the launcher's settings become plugin objects (Fabric's
connector): looking a plugin up by its keyword, and reading its fields, is what they do. (The Trainer's
mapping of its arguments, ``lockstep.trainer.accelerator_factory``, loops over the specs instead.)"""
WRAPPER_CLASSES = (
    "DistributedDataParallel",
    "DataParallel",
    "FSDPModule",
    "FullyShardedDataParallel",
    "DeepSpeedEngine",
    "PipelineEngine",
    "PipelineStage",
)
"""torch's and DeepSpeed's distributed module wrappers: whether a model is one tells which backend prepared
it. ``DTensor`` is not here: it is a kind of tensor, which code handling tensors must handle whichever backend
(FSDP2, tensor parallelism, the N-D layout) made it, and asking for its full value does not ask who did."""
ENGINE_ATTRIBUTES = ("step_was_skipped", "zero_optimization_stage", "zero_optimization_partition_weights")
"""Attributes that only some backends' optimizers and engines have (the fault-tolerant optimizer's commit
answer, the DeepSpeed engine's ZeRO stage). A ZeRO-3 partitioned parameter's ``ds_*`` attributes are not
here, for the reason ``DTensor`` is not among :data:`WRAPPER_CLASSES`: it is a kind of tensor."""
PROBES = ("getattr", "hasattr", "setattr", "delattr")


def _in_homes(module: Module, *extra: str) -> bool:
    return any(_within(module.name, home) for home in (*IDENTITY_HOMES, *extra))


def _sorted(found: Iterable[str]) -> list[str]:
    return sorted(
        set(found), key=lambda entry: (entry.split(":")[0], int(entry.split(":")[1].split()[0]), entry)
    )


# -- (a) topology predicates -------------------------------------------------------------------------
def _topology_names(module: Module) -> tuple[set[str], set[str]]:
    """The names the module binds to :mod:`lockstep.config.topology` itself and to its predicates."""
    modules, predicates = set(), set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom) and node.module == TOPOLOGY_MODULE:
            predicates |= {a.asname or a.name for a in node.names if a.name.startswith(("is_", "has_"))}
        elif isinstance(node, ast.ImportFrom) and node.module == "lockstep.config":
            modules |= {a.asname or a.name for a in node.names if a.name == "topology"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == TOPOLOGY_MODULE and a.asname}
    return modules, predicates


def topology_predicate_calls(modules: Iterable[Module]) -> list[str]:
    """Calls of ``is_*``/``has_*`` of :mod:`lockstep.config.topology` (``topology.is_plain(t)``, an imported
    ``is_fsdp2(t)``, ``lockstep.config.topology.is_deepspeed(t)``) outside the homes and the readers."""
    found = []
    for module in modules:
        if _in_homes(module, *TOPOLOGY_READERS):
            continue
        aliases, predicates = _topology_names(module)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in predicates:
                found.append(f"{module.name}:{node.lineno} asks the topology table {func.id}()")
            elif isinstance(func, ast.Attribute) and func.attr.startswith(("is_", "has_")):
                owner = ast.unparse(func.value)
                if owner in aliases or owner == TOPOLOGY_MODULE:
                    found.append(f"{module.name}:{node.lineno} asks the topology table {func.attr}()")
    return _sorted(found)


# -- (b) attribute probes ----------------------------------------------------------------------------
def backend_vocabulary() -> tuple[str, ...]:
    """The attribute names that belong to some backend: the plugin attributes of the state, each registered
    backend's ``Accelerator`` keyword, its plugin type's fields that are not settings of the Accelerator as a
    whole (``gradient_accumulation_steps`` is everyone's), and :data:`ENGINE_ATTRIBUTES`."""
    from lockstep import Accelerator
    from lockstep.config.backend_specs import backend_specs
    from lockstep.config.layer_specs import layer_specs

    everyones = set(inspect.signature(Accelerator).parameters)
    names = set(PLUGIN_ATTRIBUTES) | set(ENGINE_ATTRIBUTES)
    for spec in [*backend_specs(), *layer_specs()]:
        names |= {spec.accelerator_argument} if spec.accelerator_argument else set()
        plugin = spec.resolved_plugin_type()
        if plugin is not None and dataclasses.is_dataclass(plugin):
            names |= {f.name for f in dataclasses.fields(plugin)} - everyones
    return tuple(sorted(names))


def attribute_probes(modules: Iterable[Module], vocabulary: Iterable[str]) -> list[str]:
    """``getattr``/``hasattr`` (and ``setattr``/``delattr``) with a backend's attribute name as a constant,
    outside the homes and the connector. A field read from a plugin the
    caller was handed by name (``getattr(fsdp_plugin, "state_dict_type", None)``) does not ask which backend
    is active, as in :func:`tests.test_architecture.backend_identity_spellings`."""
    vocabulary = set(vocabulary)
    found = []
    for module in modules:
        if _in_homes(module, *CONNECTOR):
            continue
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in PROBES):
                continue
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and name.value in vocabulary):
                continue
            if isinstance(node.args[0], ast.Name) and node.args[0].id in vocabulary:
                continue
            found.append(f"{module.name}:{node.lineno} probes for {name.value!r}")
    return _sorted(found)


# -- (c) distributed wrapper classes --------------------------------------------------------------------
def wrapper_class_references(modules: Iterable[Module]) -> list[str]:
    """Any reference to a class of :data:`WRAPPER_CLASSES` outside ``backends/`` (an import, ``isinstance``
    or ``issubclass`` against it, a tuple of them): the backend that wraps a model knows it did."""
    found = []
    for module in modules:
        if _within(module.name, "lockstep.backends"):
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [a.name.rpartition(".")[2] for a in node.names]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            else:
                continue
            for name in names:
                if name in WRAPPER_CLASSES:
                    found.append(f"{module.name}:{node.lineno} names {name}")
    return _sorted(found)


# -- (d) backend names as strings ----------------------------------------------------------------------
def backend_words() -> tuple[str, ...]:
    """Each registered backend's and layer's name, ``TrainingArguments`` field and ``Accelerator`` keyword."""
    from lockstep.config.backend_specs import backend_specs
    from lockstep.config.layer_specs import layer_specs

    words = set()
    for spec in [*backend_specs(), *layer_specs()]:
        words |= {w for w in (spec.name, spec.trainer_argument, spec.accelerator_argument) if w}
    return tuple(sorted(words))


LOOKUP_METHODS = ("get", "pop", "setdefault")
"""Methods whose first argument is a key (``settings.get("fsdp_plugin")``)."""


def _vocabulary_functions(tree: ast.AST) -> set[str]:
    """Names bound to functions of the configuration vocabulary (``from lockstep.config.x import f``):
    what they are called with is a lookup in it (``launched_plugin(launch, "fault_tolerance")``)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and _within(node.module or "", "lockstep.config")
        for alias in node.names
    }


def _looked_up_constants(tree: ast.AST) -> Iterator[tuple[ast.AST, int]]:
    """String constants something is looked up by or compared with: comparison operands (and the members of
    a container compared against), subscript keys, the key of ``.get``/``getattr`` and the arguments of the
    configuration vocabulary's functions, and constants bound to a name (``KEY = "..."``). A package name
    given to an import probe (``find_spec("deepspeed")``) or a word in a message is none of these."""
    lookups = _vocabulary_functions(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            yield node.slice, node.lineno
        elif isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in lookups:
                yield from ((arg, node.lineno) for arg in (*node.args, *(k.value for k in node.keywords)))
            elif called in LOOKUP_METHODS and isinstance(node.func, ast.Attribute):
                yield from ((arg, node.lineno) for arg in node.args[:1])
            elif called in PROBES:
                yield from ((arg, node.lineno) for arg in node.args[1:2])
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            yield node.value, node.lineno
    yield from _tested_expressions(tree)


def backend_word_constants(modules: Iterable[Module], words: Iterable[str]) -> list[str]:
    """A backend's name, field or keyword (:func:`backend_words`) as a looked-up string constant outside the
    homes, the state's record and the connector."""
    words = set(words)
    found = []
    for module in modules:
        if _in_homes(module, *STATE_RECORD, *CONNECTOR):
            continue
        for node, line in _looked_up_constants(module.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
                found.append(f"{module.name}:{line} spells the backend word {node.value!r}")
    return _sorted(found)


# -- (e) zero_stage -----------------------------------------------------------------------------------
def zero_stage_tests(modules: Iterable[Module]) -> list[str]:
    """``zero_stage`` (an attribute, or a name bound to one) compared or tested outside the homes."""
    found = []
    for module in modules:
        if _in_homes(module):
            continue
        for expression, line in _tested_expressions(module.tree):
            names = set(_attributes_in(expression)) | {getattr(expression, "id", "")}
            probed = isinstance(expression, ast.Call) and getattr(expression.func, "id", None) in PROBES
            if probed:
                names |= {a.value for a in expression.args[1:2] if isinstance(a, ast.Constant)}
            if "zero_stage" in names:
                found.append(f"{module.name}:{line} tests zero_stage")
    return _sorted(found)


# -- the rules hold for lockstep ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return package_modules()


def test_no_topology_predicate_is_called_outside_its_readers(modules):
    assert topology_predicate_calls(modules) == []


def test_no_attribute_of_a_backend_is_probed(modules):
    assert attribute_probes(modules, backend_vocabulary()) == []


def test_no_distributed_wrapper_class_is_named_outside_backends(modules):
    assert wrapper_class_references(modules) == []


def test_no_backend_word_is_a_string_outside_the_homes(modules):
    assert backend_word_constants(modules, backend_words()) == []


def test_no_zero_stage_is_tested_outside_the_homes(modules):
    assert zero_stage_tests(modules) == []


def test_the_vocabularies_come_from_the_registered_specs():
    assert {"fsdp_plugin", "deepspeed_plugin", "zero_stage", "state_dict_type", "step_was_skipped"} <= set(
        backend_vocabulary()
    )
    assert {"fault_tolerance", "deepspeed", "fsdp", "fsdp_plugin", "ddp"} <= set(backend_words())


# -- the rules can fail ---------------------------------------------------------------------------------
SYNTHETIC = (
    "from lockstep.config import topology\n"  # 1
    "from lockstep.config.topology import is_fsdp2 as sharded, data_parallel_type\n"  # 2
    "import lockstep.config.topology as topo\n"  # 3
    "from torch.distributed.fsdp import FSDPModule\n"  # 4 (launched_plugin: see line 21)
    "def f(state, model, launch):\n"  # 5
    "    if topology.is_plain(state.distributed_type) or sharded(state.distributed_type):\n"  # 6
    "        pass\n"
    "    ok = topo.has_mesh(state) and data_parallel_type(processes=2, cpu=True)\n"  # 8
    "    plugin = getattr(state, 'deepspeed_plugin', None)\n"  # 9
    "    if hasattr(model, 'ds_tensor'):\n"  # 10
    "        pass\n"
    "    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, FSDPModule)):\n"  # 12
    "        pass\n"
    "    plugin = launched_plugin(launch, 'fault_tolerance')\n"  # 14
    "    if launch['distributed'] == 'deepspeed':\n"  # 15
    "        pass\n"
    "    if plugin.zero_stage == 3 or getattr(plugin, 'zero_stage', 0) > 2:\n"  # 17
    "        pass\n"
    "    return getattr(model, 'batch_size', None), {'fsdp': 1}, kind == 'fsdp_ish'\n"  # 19
    "KEY = 'fault_tolerance'\n"  # 20
    "from lockstep.config.backend_specs import launched_plugin\n"  # 21
    "x = find_spec('deepspeed'), ClusterEnvironment(source='ddp'), settings.get('fsdp_plugin')\n"  # 22
)


def test_the_spelling_rules_catch_synthetic_violations():
    fake = parse("lockstep.accelerator.fake", SYNTHETIC)
    assert topology_predicate_calls([fake]) == [
        "lockstep.accelerator.fake:6 asks the topology table is_plain()",
        "lockstep.accelerator.fake:6 asks the topology table sharded()",
        "lockstep.accelerator.fake:8 asks the topology table has_mesh()",
    ]
    assert attribute_probes([fake], ("deepspeed_plugin", "ds_tensor", "zero_stage")) == [
        "lockstep.accelerator.fake:9 probes for 'deepspeed_plugin'",
        "lockstep.accelerator.fake:10 probes for 'ds_tensor'",
        "lockstep.accelerator.fake:17 probes for 'zero_stage'",
    ]
    assert wrapper_class_references([fake]) == [
        "lockstep.accelerator.fake:4 names FSDPModule",
        "lockstep.accelerator.fake:12 names DistributedDataParallel",
        "lockstep.accelerator.fake:12 names FSDPModule",
    ]
    assert backend_word_constants([fake], ("fault_tolerance", "deepspeed", "fsdp", "ddp", "fsdp_plugin")) == [
        "lockstep.accelerator.fake:14 spells the backend word 'fault_tolerance'",
        "lockstep.accelerator.fake:15 spells the backend word 'deepspeed'",
        "lockstep.accelerator.fake:20 spells the backend word 'fault_tolerance'",
        "lockstep.accelerator.fake:22 spells the backend word 'fsdp_plugin'",
    ]
    assert zero_stage_tests([fake]) == [
        "lockstep.accelerator.fake:17 tests zero_stage",
    ]


def test_the_homes_may_spell_their_own_vocabulary():
    for home in ("lockstep.backends.deepspeed.plugin", "lockstep.config.plugins"):
        module = parse(home, SYNTHETIC)
        assert topology_predicate_calls([module]) == []
        assert attribute_probes([module], ("deepspeed_plugin",)) == []
        assert backend_word_constants([module], ("fault_tolerance",)) == []
        assert zero_stage_tests([module]) == []
    assert wrapper_class_references([parse("lockstep.backends.ddp.x", SYNTHETIC)]) == []
    reader = parse("lockstep.state", SYNTHETIC)
    assert topology_predicate_calls([reader]) == []
    assert attribute_probes([reader], ("deepspeed_plugin",)) != []  # a reader of the table, nothing more
