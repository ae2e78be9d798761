"""notebook_launcher in a real Jupyter kernel (nbclient + ipykernel), and debug_launcher."""

import json
import os
import subprocess
import sys

import pytest

from lockstep import debug_launcher, notebook_launcher
from tests.helpers.cli import SCRIPTS, cli_env

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

TRAIN_CELL = """
import torch
from lockstep import Accelerator, notebook_launcher

def training_function(steps):
    accelerator = Accelerator()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(steps):
        accelerator.backward(model(torch.ones(4, 3)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    total = accelerator.reduce(torch.tensor([1.0]), reduction="sum").item()
    accelerator.print(f"trained on {accelerator.num_processes} processes ({accelerator.distributed_type}), reduce={total:.0f}, precision={accelerator.mixed_precision}")

notebook_launcher(training_function, args=(3,), num_processes=2, mixed_precision="bf16")
"""

FAILING_CELL = """
def failing_function():
    from lockstep import Accelerator
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise KeyError("missing column 'label' on rank one")
    accelerator.wait_for_everyone()

try:
    notebook_launcher(failing_function, num_processes=2)
except RuntimeError as error:
    print("CAUGHT", error)
"""


DEEPSPEED_CELL = """
import torch
from lockstep import Accelerator, notebook_launcher
from lockstep.utils import DeepSpeedPlugin

def zero3_function():
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model = torch.nn.Linear(3, 1)
    loader = torch.utils.data.DataLoader(torch.ones(8, 3), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    for batch in loader:
        accelerator.backward(model(batch).pow(2).mean())
        optimizer.step()
    accelerator.print(f"ZeRO-{model.zero_optimization_stage()} engine trained on {accelerator.num_processes} processes")

notebook_launcher(zero3_function, num_processes=2)
"""


HELD_OUTPUT_LOCK_CELL = """
import os
import sys
import threading
import time
from lockstep import notebook_launcher

def printing_function():
    print("PRINTED in a worker", flush=True)

go, taken = threading.Event(), threading.Event()

def send_output():  # as the kernel's IOPub thread takes the lock while it sends
    while True:
        go.wait()
        go.clear()
        with sys.stdout._buffer_lock:
            taken.set()
            time.sleep(0.5)

def take_the_lock_for_the_fork():
    taken.clear()
    go.set()
    taken.wait(5)

threading.Thread(target=send_output, daemon=True).start()
os.register_at_fork(before=take_the_lock_for_the_fork)  # every fork happens while the lock is taken
notebook_launcher(printing_function, num_processes=2)
"""


def _run_notebook(*cells: str, timeout: int = 180) -> list[str]:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    env_threads = os.environ.get("OMP_NUM_THREADS")
    NotebookClient(notebook, timeout=timeout, kernel_name="python3").execute()
    assert os.environ.get("OMP_NUM_THREADS") == env_threads
    texts = []
    for cell in notebook.cells:
        texts.append(
            "".join(
                output.get("text", "") for output in cell.outputs if output.get("output_type") == "stream"
            )
        )
    return texts


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_notebook_launcher_in_a_real_kernel():
    train_output, failure_output = _run_notebook(TRAIN_CELL, FAILING_CELL)
    assert "trained on 2 processes (MULTI_CPU), reduce=2, precision=bf16" in train_output
    assert "CAUGHT A worker process failed:" in failure_output
    assert (
        "rank 1" in failure_output
        and "KeyError" in failure_output
        and "missing column 'label'" in failure_output
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_workers_forked_while_the_kernel_sends_output_can_print():
    """Forked while another thread of the kernel holds its output stream's lock, the workers' prints
    waited forever for it (the cell timed out); they get a free lock of their own."""
    (output,) = _run_notebook(HELD_OUTPUT_LOCK_CELL, timeout=90)
    assert output.count("PRINTED in a worker") == 2, output


def _debug_launch(*args: str) -> dict:
    """debug_launcher, run from a fresh interpreter (see tests/scripts/debug_launch.py)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "debug_launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_debug_launcher_runs_cpu_processes(tmp_path):
    path = tmp_path / "result.txt"
    assert _debug_launch("sum", str(path)) == {"ok": True}
    assert path.read_text() == "3 6 cpu"


@pytest.mark.distributed
def test_launchers_reject_bad_process_counts():
    with pytest.raises(ValueError, match=r"notebook_launcher\(num_processes=0\) is invalid"):
        notebook_launcher(print, num_processes=0)
    with pytest.raises(ValueError, match=r"debug_launcher\(num_processes=0\) is invalid"):
        debug_launcher(print, num_processes=0)
    with pytest.raises(ValueError, match="mixed_precision='fp32' is invalid"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp32")


@pytest.mark.distributed
def test_a_failing_worker_raises_torchs_child_failed_error_with_lockstep_message():
    caught = _debug_launch("fail")
    assert caught["is_lockstep_error"] and caught["is_runtime_error"]
    # rank 0 fails too (rank 1 left its barrier); rank 1 is named first, as the cause
    assert 1 in caught["failed_ranks"] and caught["first"] == 1
    text = caught["text"]
    assert text.startswith("A worker process failed:\nrank 1 (local rank 1, pid ")
    assert "KeyError" in text and "missing column 'label' on rank one" in text
    assert "FAILED" not in text  # lockstep's lines, not torch's banner


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.usefixtures("deepspeed_preloaded")
def test_deepspeed_runs_on_the_notebook_launchers_process_group():
    pytest.importorskip("deepspeed")
    (output,) = _run_notebook(DEEPSPEED_CELL)
    assert "ZeRO-3 engine trained on 2 processes" in output
