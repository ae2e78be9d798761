"""What lockstep says it cannot do is checked against what it builds (issue 23, item 5).

A message, docstring or note that says a backend is missing ("no DeepSpeed backend", "FSDP is not built",
"does not drive DeepSpeed") fails this test as soon as the backend registry can build that backend. The
texts are every string constant in the package's source (read with ``ast``, f-string parts included), the
notes of ``accelerate_api.json``, and the messages of the refusals lockstep raises at run time. The other
way round, a feature said to be "not built" must be refused: the ``TrainingArguments`` fields whose help
says so are exactly those the Trainer refuses, the Accelerator arguments documented as not built raise
``NotImplementedError``, and a refused ``distributed_type`` names no backend the registry builds.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import lockstep
from lockstep.config.enums import DistributedType
from lockstep.errors import UsageError

PACKAGE = Path(lockstep.__file__).parent

# How texts spell each backend, by the backend's registered name (the words are compared without case,
# spaces or punctuation: "Megatron-LM" is "megatronlm").
SPELLINGS = {
    "single": ("single", "singleprocess"),
    "ddp": ("ddp", "dataparallel", "dataparallelism", "distributeddataparallel"),
    "fsdp": ("fsdp", "fsdp2", "fullyshardeddataparallel", "fullyshardeddataparallelism"),
    "deepspeed": ("deepspeed", "zero", "zero3", "deepspeedzero"),
    "nd": ("nd", "ndparallel", "tensorparallel", "tensorparallelism", "contextparallelism", "tp"),
    "pipeline": ("pipeline", "pp", "pipelineparallel", "pipelineparallelism", "pipelining"),
}
# Before the registry's rewrite (issue 23, item 1): the distributed types that select each backend; the N-D
# and pipeline backends are chosen by a ParallelismConfig rather than by a distributed type.
_FALLBACK_TYPES = {
    "NO": "single",
    "MULTI_CPU": "ddp",
    "MULTI_GPU": "ddp",
    "MULTI_XPU": "ddp",
    "MULTI_MPS": "ddp",
    "FSDP": "fsdp",
    "DEEPSPEED": "deepspeed",
}
_FALLBACK_MODULES = {"nd": "lockstep.backends.nd", "pipeline": "lockstep.backends.pp"}

_NEGATION = (
    r"(?:is|are)\s+not\s+(?:built|supported|part\s+of)(?!\s+(?:with|together|under|for|on|in|when|by)\b)"
)
_CLAIMS = (
    re.compile(r"\bno\s+(?P<subject>[\w-]+)\s+backend\b", re.IGNORECASE),
    re.compile(rf"\b(?P<subject>[\w-]+)\s+backend\s+{_NEGATION}", re.IGNORECASE),
    # A list may follow: "does not drive (DeepSpeed, Megatron-LM, TPUs ...)".
    re.compile(r"\bdoes\s+not\s+(?:drive|support|integrate)\s+\(?(?P<subject>[\w ,/-]+)", re.IGNORECASE),
    re.compile(
        rf"(?:^|[.:;!?(]\s*|,\s+)(?:the\s+)?(?P<subject>[A-Za-z][\w -]{{0,30}}?)\s+{_NEGATION}",
        re.IGNORECASE | re.MULTILINE,
    ),
)


def _word(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def buildable_backends() -> set[str]:
    """The registered names of the backends lockstep can build.

    From ``lockstep.backends.registry.registered_backends()`` (each with ``.name`` and ``.config_section``)
    where it exists; before that, from the distributed types the configuration accepts and the backend
    packages present.
    """
    from lockstep.backends import registry

    if hasattr(registry, "registered_backends"):
        names = set()
        for backend in registry.registered_backends():
            names.add(_word(backend.name))
            if backend.config_section:
                names.add(_word(backend.config_section.removesuffix("_config")))
        return names
    from lockstep.config.topology import checked_distributed_type

    names = set()
    for member, name in _FALLBACK_TYPES.items():
        checked_distributed_type(member)  # raises if the configuration refuses it
        names.add(name)
    return names | {name for name, module in _FALLBACK_MODULES.items() if importlib.util.find_spec(module)}


def _backend_named(subject: str) -> str:
    word = _word(subject)
    return next((name for name, words in SPELLINGS.items() if word == name or word in words), word)


def denied_backends(text: str, buildable: set[str]) -> list[str]:
    """The buildable backends ``text`` says lockstep lacks, as the phrases that say it."""
    found = []
    for pattern in _CLAIMS:
        for match in pattern.finditer(text):
            named = {_backend_named(item) for item in re.split(r",|/|\bor\b|\band\b", match["subject"])}
            if named & buildable:
                found.append(match.group(0).strip(" .:;!?(,"))
    return found


def source_strings(root: Path = PACKAGE) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for every string constant in the package's source, f-string parts included."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield f"{path.relative_to(root.parent)}:{node.lineno}", node.value


def api_notes() -> Iterator[tuple[str, str]]:
    data = json.loads((PACKAGE / "accelerate_api.json").read_text(encoding="utf-8"))
    for section, body in data["sections"].items():
        for name, entry in body["names"].items():
            yield f"accelerate_api.json {section}.{name}", entry


# -- the backends the texts deny ----------------------------------------------------------------------
def test_the_registry_builds_the_known_backends():
    assert {"single", "ddp", "fsdp", "deepspeed", "nd", "pipeline"} <= buildable_backends()


def test_no_text_says_a_buildable_backend_is_missing():
    buildable = buildable_backends()
    texts = [*source_strings(), *api_notes()]
    assert len(texts) > 5000
    found = [f"{where}: {phrase!r}" for where, text in texts for phrase in denied_backends(text, buildable)]
    assert found == []


@pytest.mark.parametrize(
    ("text", "denied"),
    [
        ("lockstep has no DeepSpeed backend (not built yet).", ["no DeepSpeed backend"]),
        ("The FSDP backend is not built.", ["FSDP backend is not built"]),
        ("lockstep does not drive Megatron-LM or DeepSpeed.", ["does not drive Megatron-LM or DeepSpeed"]),
        ("integrations lockstep does not drive (DeepSpeed, TPUs", ["does not drive (DeepSpeed, TPUs"]),
        ("None: tensor parallelism is not built yet.", ["tensor parallelism is not built"]),
        ("x: pipeline parallelism is not part of this version", ["pipeline parallelism is not part of"]),
        ("lockstep has no FP8 backend.", []),
        ("lockstep does not drive Megatron-LM, TPUs (torch_xla) or FSDP1's API.", []),
        ("torch.compile with pipeline parallelism is not built yet.", []),
        ("DeepSpeed is not supported with a ParallelismConfig.", []),
        ("ParallelismConfig.get_submesh(): the device mesh is not built yet.", []),
    ],
)
def test_the_check_finds_denials_and_leaves_the_rest(text, denied):
    buildable = {"single", "ddp", "fsdp", "deepspeed", "nd", "pipeline"}
    assert denied_backends(text, buildable) == denied


def test_a_violation_in_a_source_file_is_reported(tmp_path):
    package = tmp_path / "lockstep"
    package.mkdir()
    (package / "bad.py").write_text(
        'def f():\n    raise ValueError(f"{f.__name__}: lockstep has no DeepSpeed backend")\n',
        encoding="utf-8",
    )
    strings = list(source_strings(package))
    assert ("lockstep/bad.py:2", ": lockstep has no DeepSpeed backend") in strings
    assert denied_backends(strings[-1][1], {"deepspeed"}) == ["no DeepSpeed backend"]


# -- what is said to be not built is refused ----------------------------------------------------------
def test_refused_distributed_types_name_no_buildable_backend():
    from lockstep.config.topology import checked_distributed_type

    buildable = buildable_backends()
    refused = {}
    for member in DistributedType:
        try:
            checked_distributed_type(member)
        except UsageError as error:
            refused[member.value] = str(error)
    assert set(refused) == {"XLA", "MEGATRON_LM"}
    assert not {_backend_named(name) for name in refused} & buildable
    assert [phrase for message in refused.values() for phrase in denied_backends(message, buildable)] == []


def test_accelerator_arguments_documented_as_not_built_raise_not_implemented():
    from lockstep import Accelerator

    documented = [
        line.split(":", 1)[0].strip()
        for line in (Accelerator.__init__.__doc__ or Accelerator.__doc__ or "").splitlines()
        if re.search(r":\s*not built\b", line)
    ]
    names = [name.strip() for entry in documented for name in entry.split(",")]
    assert names == ["torch_tp_plugin", "megatron_lm_plugin"]
    buildable = buildable_backends()
    for name in names:
        with pytest.raises(
            NotImplementedError, match=rf"Accelerator\({name}=\.\.\.\) is not supported"
        ) as caught:
            Accelerator(cpu=True, **{name: object()})
        assert denied_backends(str(caught.value), buildable) == []


def test_training_arguments_help_says_not_built_exactly_where_the_trainer_refuses():
    from dataclasses import fields

    from lockstep.trainer._field_status import _NOT_BUILT
    from lockstep.trainer.arguments import TrainingArguments

    said = {f.name for f in fields(TrainingArguments) if "not built" in f.metadata.get("help", "")}
    refused = set(_NOT_BUILT)  # transformers 5's fields and the transformers 4 ones lockstep takes
    assert said == refused and len(refused) == 24
