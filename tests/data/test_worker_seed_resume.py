"""A mid-epoch resume gives the loader's workers the interrupted epoch's seeds again.

torch's multi-process iterator draws a base seed from the global generator at the start of each epoch, and
worker ``k`` gets ``base seed + k`` as its seed (``get_worker_info().seed``, which the usual
``worker_init_fn`` passes to NumPy and ``random``). ``load_state`` restores the global generator as it was
mid-epoch, after that draw: the resumed epoch must reuse the saved base seed and not draw again, or its
workers seed themselves differently from the interrupted run's, and the next epoch must draw what the
uninterrupted run drew. Checked with the loop a user writes: save mid-epoch, load in a new Accelerator, read
on.

Not claimed: a dataset that draws from torch's generator inside its workers (``torch.rand`` in
``__getitem__``) gets the same numbers after a resume. The resumed sampler starts at the saved batch without
the workers reading the skipped ones, so each worker's stream starts where the uninterrupted run's worker
was at the epoch's start.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lockstep import Accelerator

SAMPLES, BATCH, WORKERS, STOP, EPOCHS = 24, 4, 2, 2, 2  # STOP a multiple of WORKERS: the same round robin


class SeededInWorkers(Dataset):
    """Sample ``i`` is ``(i, the seed of the worker that read it)``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        seed = -1 if info is None else info.seed % 2**31
        return torch.tensor([index, seed], dtype=torch.float64)


def _loader(accelerator: Accelerator) -> DataLoader:
    torch.manual_seed(0)
    loader = DataLoader(SeededInWorkers(), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    return accelerator.prepare(loader)


def test_a_resumed_epoch_gives_its_workers_the_interrupted_epochs_seeds(tmp_path: Path):
    loader = _loader(Accelerator(cpu=True))
    whole = [[batch.clone() for batch in loader] for _ in range(EPOCHS)]

    accelerator = Accelerator(cpu=True)
    loader = _loader(accelerator)
    for step, _ in enumerate(loader):
        if step + 1 == STOP:
            accelerator.save_state(str(tmp_path / "checkpoint"))
            break

    torch.manual_seed(123)  # a new process starts from another generator state; load_state restores it
    accelerator = Accelerator(cpu=True)
    loader = _loader(accelerator)
    accelerator.load_state(str(tmp_path / "checkpoint"))
    resumed = [[batch.clone() for batch in loader] for _ in range(EPOCHS)]

    expected = [whole[0][STOP:], whole[1]]
    assert [len(epoch) for epoch in resumed] == [len(epoch) for epoch in expected]
    for got, want in zip(itertools.chain(*resumed), itertools.chain(*expected), strict=True):
        assert torch.equal(got, want)  # the same samples, read by workers with the same seeds
    assert len({float(seed) for batch in whole[0] for seed in batch[:, 1]}) == WORKERS
