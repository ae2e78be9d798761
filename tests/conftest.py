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
