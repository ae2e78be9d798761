"""Whether transformers can read pretrained weights on the main process only is transformers' own answer.

FSDP's ``cpu_ram_efficient_loading`` tells ``from_pretrained`` (Accelerate's two variables) that only local rank 0
needs the weights. transformers before 4.51 then takes its ``low_cpu_mem_usage`` path, which it allows only
where its ``is_accelerate_available()`` finds an installed accelerate distribution at its minimum version: an
``accelerate`` module without distribution metadata (an import shim) or an older accelerate makes every rank
fail in ``from_pretrained`` ("requires Accelerate"). lockstep announces rank-0 loading only where
``why_transformers_cannot_load_on_main_only()`` finds no reason against it; each case below checks that answer
against what ``from_pretrained`` really does under the announcement (one process, a gloo group of one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import cli_env
from tests.helpers.deadlines import scaled
from tests.helpers.reference import accelerate_pythonpath, transformers_overlay

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow]

CHECK = """
import json, os, sys, tempfile
import torch.distributed as dist
from lockstep.backends.fsdp.loading import why_transformers_cannot_load_on_main_only

reason = why_transformers_cannot_load_on_main_only()
import transformers
from transformers import BertConfig, BertModel

folder = tempfile.mkdtemp(dir=sys.argv[1])
config = BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=8, max_position_embeddings=8)
BertModel(config).save_pretrained(folder)
os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")  # what lockstep announces
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
try:
    BertModel.from_pretrained(folder)
    loaded = None
except ImportError as error:
    loaded = str(error)
dist.destroy_process_group()
print(json.dumps({"transformers": transformers.__version__, "reason": reason, "refused": loaded}))
"""


def _fake_accelerate(folder: Path, version: str | None) -> str:
    """A folder holding an ``accelerate`` module: with an installed distribution of ``version``, or (None)
    without distribution metadata, as an import shim has none."""
    (folder / "accelerate").mkdir(parents=True)
    (folder / "accelerate" / "__init__.py").write_text('__version__ = "1.15.0"\n')
    if version is not None:
        info = folder / f"accelerate-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accelerate\nVersion: {version}\n")
    return str(folder)


def test_rank0_loading_is_announced_only_where_transformers_from_pretrained_honours_it(tmp_path):
    shim, old = _fake_accelerate(tmp_path / "shim", None), _fake_accelerate(tmp_path / "old", "0.20.0")
    cases = {
        "4.40 with a shim": (transformers_overlay("4.40.2"), shim),
        "4.40 with accelerate 0.20": (transformers_overlay("4.40.2"), old),
        "4.40 with accelerate 1.15": (transformers_overlay("4.40.2"), accelerate_pythonpath()),
        "4.56 with a shim": (transformers_overlay("4.56.2"), shim),
    }
    running = {}
    for name, (overlay, accelerate) in cases.items():  # about 4 s each: run side by side
        env = cli_env()
        env["PYTHONPATH"] = os.pathsep.join([overlay, accelerate, env["PYTHONPATH"]])
        running[name] = subprocess.Popen(
            [sys.executable, "-c", CHECK, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    seen = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=scaled(180))
        assert process.returncode == 0, (name, err[-3000:])
        seen[name] = json.loads(out.strip().splitlines()[-1])
    for name, result in seen.items():  # lockstep's answer is what from_pretrained does
        assert (result["reason"] is None) == (result["refused"] is None), (name, result)
    for name in ("4.40 with a shim", "4.40 with accelerate 0.20"):
        assert "requires Accelerate" in seen[name]["refused"], seen[name]
    assert seen["4.40 with a shim"]["reason"] == (
        "transformers 4.40.2 reads the weights on the main process only through accelerate>=0.21.0, and its "
        "is_accelerate_available() says no: an accelerate module imports here, but no accelerate distribution "
        "is installed (no version)"
    )
    assert seen["4.40 with accelerate 0.20"]["reason"].endswith(
        "is_accelerate_available() says no: accelerate 0.20.0 is installed"
    )
    assert seen["4.40 with accelerate 1.15"]["reason"] is None
    # transformers 4.51 dropped low_cpu_mem_usage: 4.56 reads on the main process only without accelerate
    assert seen["4.56 with a shim"]["transformers"] == "4.56.2" and seen["4.56 with a shim"]["reason"] is None
