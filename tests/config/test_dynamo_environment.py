"""``TorchDynamoPlugin`` fields left unset are read from ``accelerate launch``'s ``ACCELERATE_DYNAMO_*`` variables,
as Accelerate's plugin reads them: ``to_kwargs()`` then lists what they set (Accelerate 1.15's own test sets
two of them and expects both back; lockstep returned ``{}``). Checked against the real Accelerate, case by case.
"""

from __future__ import annotations

import json

import pytest
import torch

from lockstep import Accelerator, TorchDynamoPlugin
from lockstep.config.enums import DynamoBackend
from tests.helpers.reference import run_reference

CASES: list[tuple[dict[str, str], dict[str, str]]] = [
    # (ACCELERATE_DYNAMO_* variables, TorchDynamoPlugin arguments)
    ({"BACKEND": "aot_ts_nvfuser", "MODE": "reduce-overhead"}, {}),  # Accelerate's own test
    ({"BACKEND": "INDUCTOR", "USE_FULLGRAPH": "true", "USE_DYNAMIC": "false"}, {}),
    ({"BACKEND": "inductor", "USE_REGIONAL_COMPILATION": "yes"}, {}),  # not a torch.compile argument
    ({"BACKEND": "inductor", "MODE": "max-autotune"}, {"backend": "eager"}),  # a given field wins
    ({}, {}),
]

ACCELERATE = """
import json, os, sys
from accelerate.utils import TorchDynamoPlugin

results = []
for variables, arguments in json.loads(sys.argv[1]):
    for name in [n for n in os.environ if n.startswith("ACCELERATE_DYNAMO_")]:
        del os.environ[name]
    os.environ.update({"ACCELERATE_DYNAMO_" + name: value for name, value in variables.items()})
    results.append(TorchDynamoPlugin(**arguments).to_kwargs())
print(json.dumps(results))
"""


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION"):
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}", raising=False)


def test_to_kwargs_lists_what_the_environment_set_as_accelerate_does(tmp_path, monkeypatch):
    done = run_reference(ACCELERATE, json.dumps(CASES), folder=tmp_path)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = []
    for variables, arguments in CASES:
        _clear(monkeypatch)
        for name, value in variables.items():
            monkeypatch.setenv(f"ACCELERATE_DYNAMO_{name}", value)
        ours.append(TorchDynamoPlugin(**arguments).to_kwargs())
    assert ours == theirs
    assert ours[0] == {"backend": "aot_ts_nvfuser", "mode": "reduce-overhead"}
    _clear(monkeypatch)
    assert TorchDynamoPlugin().to_kwargs() == {}  # the environment is read when built, not kept


def test_a_variable_that_is_not_a_value_names_itself(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "maybe")
    with pytest.raises(
        ValueError, match=r"^ACCELERATE_DYNAMO_USE_FULLGRAPH must be true or false, got 'maybe'$"
    ):
        TorchDynamoPlugin()
    assert TorchDynamoPlugin(fullgraph=True).fullgraph is True  # a given field does not read it


def test_the_accelerator_compiles_with_the_backend_accelerate_launch_set(monkeypatch):
    """``accelerate launch --dynamo_backend eager script.py`` sets ACCELERATE_DYNAMO_BACKEND for the script:
    Accelerate's Accelerator compiles with it, and so does lockstep's (its state says so too)."""
    _clear(monkeypatch)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    accelerator = Accelerator(cpu=True)
    assert accelerator.state.dynamo_plugin.backend is DynamoBackend.EAGER
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
