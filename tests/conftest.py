import contextlib
import os

# One thread per process: two ranks on two cores with default threading run 10-50x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tests.helpers import forking  # noqa: F401 (notes the test runner's own threads, before any test's)

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


@pytest.fixture(scope="module")
def deepspeed_preloaded() -> None:
    """DeepSpeed imported once in this test process, before the module's tests fork their workers.

    ``import deepspeed`` takes about 11 s of CPU on the CI machine (some 3,000 modules: its autotuner imports
    mlflow, its compiler torch._dynamo); every forked worker would pay it again. The accelerator DeepSpeed
    picks at import is the CPU's, as the workers would pick (``DS_ACCELERATOR=cpu``, restored afterwards so
    that later subprocesses see the environment unchanged). Without DeepSpeed it does nothing (the tests
    skip themselves).
    """
    import importlib.util
    import warnings

    if importlib.util.find_spec("deepspeed") is None:
        return
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
            import deepspeed.ops
            import deepspeed.runtime.engine
            import deepspeed.runtime.zero.utils

            with contextlib.suppress(ImportError):
                import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = saved


# Opt-in CPU accounting (`LOCKSTEP_TEST_CPU_LOG=path make test`): the suite is CPU-bound on 2 cores, so the
# figure that decides its time is the CPU a test spends with all its processes (forked ranks, launched
# subprocesses and their workers once reaped), not its wall time, which depends on what runs beside it.
_CPU_LOG = os.environ.get("LOCKSTEP_TEST_CPU_LOG")
if _CPU_LOG:
    import resource
    import time

    def _cpu_seconds() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
        cpu, wall = _cpu_seconds(), time.monotonic()
        yield
        with open(
            _CPU_LOG, "a"
        ) as log:  # one line per test: appends from the xdist workers do not interleave
            log.write(f"{_cpu_seconds() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n")
