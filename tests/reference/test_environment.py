"""The reference environment holds what ``dev/reference-requirements.txt`` pins, apart from lockstep."""

from __future__ import annotations

import json
import re

from tests.helpers.reference import REPO, run_reference

_VERSIONS = """
import importlib.util, json
import accelerate, peft, torch, transformers
print(json.dumps({
    "accelerate": accelerate.__version__,
    "peft": peft.__version__,
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "lockstep": importlib.util.find_spec("lockstep") is not None,
}))
"""


def _pins() -> dict[str, str]:
    text = (REPO / "dev" / "reference-requirements.txt").read_text()
    return dict(re.findall(r"^([a-z]+)==(\S+)$", text, flags=re.MULTILINE))


def test_the_reference_environment_has_the_pinned_libraries_and_no_lockstep(tmp_path):
    versions = json.loads(run_reference(_VERSIONS, folder=tmp_path).stdout.strip().splitlines()[-1])
    pins = _pins()
    assert set(pins) == {"torch", "accelerate", "transformers", "peft"}
    assert versions["accelerate"].startswith(pins["accelerate"].rstrip("*")), versions
    assert versions["transformers"] == pins["transformers"], versions
    assert versions["peft"] == pins["peft"], versions
    assert versions["torch"].split("+")[0] == pins["torch"], versions
    assert versions["lockstep"] is False  # the reference runs see the real libraries only
