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


# The folders whose files launch whole jobs (a minute or more per file): collected first, so that the two
# pytest-xdist workers (`make test`: -n 2 --dist loadfile) start on them and end on short unit files, not
# one worker finishing a long end-to-end file alone while the other idles.
_LONG_FILES_FIRST = (
    "tests/e2e/",
    "tests/reference/",
    "tests/diagnostics/",
    "tests/trainer/",
    "tests/backends/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next(
            (i for i, prefix in enumerate(_LONG_FILES_FIRST) if path.startswith(prefix)),
            len(_LONG_FILES_FIRST),
        )

    items.sort(key=rank)
