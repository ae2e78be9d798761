import os

# One thread per process: two ranks on two cores with default threading run 10-50x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_lockstep_state():
    from tests.helpers.multiprocess import reset_lockstep_state

    reset_lockstep_state()
    yield
    reset_lockstep_state()
    # FSDP's cpu_ram_efficient_loading announces itself to transformers through these (os.environ): a test
    # that prepared such a model in this process must not leave them to the next test's subprocesses.
    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        os.environ.pop(name, None)
