"""How a fault-tolerant job's prepared loaders deal each step's batches over the replica groups of that step
(lockstep.layers.fault_tolerance.data), with the quorum played by hand: several groups' loaders in one
process, each told the step's participants and its rank, and each step's commit decision. The same loaders
under real torchft quorums, with a group killed and relaunched: tests/backends/test_fault_tolerance_heal.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lockstep.collectives import gather_for_metrics_truncate
from lockstep.layers.fault_tolerance.data import GroupReading, QuorumDataLoader, quorum_loader

NO_REFUSALS: dict[str, bool] = {}


class _Step:
    """The quorum of the current step: which groups take part (their rank is their place in the list)."""

    def __init__(self, groups: list[int]) -> None:
        self.groups = groups

    def of(self, group: int):
        return lambda: (len(self.groups), self.groups.index(group))


def _loaders(data: DataLoader, step: _Step, groups: int = 3) -> list[QuorumDataLoader]:
    return [
        quorum_loader(
            data, quorum=step.of(g), groups=groups, device=None, data_seed=None, refusals=NO_REFUSALS
        )
        for g in range(groups)
    ]


def _take(
    iterators: dict[int, Iterator], loaders: list[QuorumDataLoader], committed: bool
) -> list[list[int]]:
    """One step: every group in ``iterators`` reads a batch, then all learn the commit decision."""
    batches = [next(iterators[g]).tolist() for g in iterators]
    for g in iterators:
        loaders[g].steps.step_ended(committed)
    return batches


def test_a_lost_group_leaves_no_sample_behind_and_a_discarded_step_is_read_again() -> None:
    data = DataLoader(torch.arange(14), batch_size=2)  # 7 global batches
    step = _Step([0, 1, 2])
    loaders = _loaders(data, step)
    its = {g: iter(loaders[g]) for g in range(3)}
    used = _take(its, loaders, committed=True)  # batches 0, 1, 2
    step.groups = [0, 1]  # group 2 is lost
    del its[2]
    discarded = _take(its, loaders, committed=False)
    assert discarded == [[6, 7], [8, 9]]
    again = _take(its, loaders, committed=True)  # not consumed: the same samples, dealt again
    assert again == discarded
    used += again
    # group 2 comes back and heals: it takes a live peer's position, as torchft hands it over
    loaders[2].load_state_dict(loaders[0].state_dict())
    step.groups = [0, 1, 2]
    its[2] = iter(loaders[2])
    last = _take(its, loaders, committed=True)  # batch 5, 6, then a pad from the epoch's start
    assert last == [[10, 11], [12, 13], [0, 1]]
    assert [loaders[g].steps.last["padded"] for g in range(3)] == [False, False, True]
    assert all(loaders[g].end_of_dataloader for g in range(3))
    used += last[:2]
    assert sorted(i for batch in used for i in batch) == list(range(14))  # each sample once
    for g in range(3):  # the epoch is over on every group at once
        assert next(its[g], None) is None and loaders[g].state_dict() == {"epoch": 1, "global_batches": 0}


def test_gradient_accumulation_deals_each_micro_batch_over_the_participants() -> None:
    data = DataLoader(torch.arange(16), batch_size=2)
    step = _Step([0, 1])
    loaders = _loaders(data, step, groups=2)
    its = {g: iter(loaders[g]) for g in range(2)}
    first = [[next(its[g]).tolist() for _ in range(2)] for g in range(2)]
    assert first == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    for loader in loaders:
        loader.steps.step_ended(True)
    assert loaders[0].state_dict()["global_batches"] == 4


def test_shuffled_data_has_one_order_on_every_group_and_epochs_differ() -> None:
    step = _Step([0, 1])
    orders = []
    for group, seed in ((0, 1), (1, 2)):  # each group's process seeds torch on its own
        torch.manual_seed(seed)
        data = DataLoader(torch.arange(8), batch_size=2, shuffle=True)
        loader = quorum_loader(
            data, quorum=step.of(group), groups=2, device=None, data_seed=5, refusals=NO_REFUSALS
        )
        epochs = []
        for _ in range(2):
            epoch = []
            for batch in loader:
                epoch.append(batch.tolist())
                loader.steps.step_ended(True)
            epochs.append(epoch)
        orders.append(epochs)
    ids = [sorted(i for b in [*orders[0][e], *orders[1][e]] for i in b) for e in range(2)]
    assert ids == [list(range(8))] * 2  # the two groups' halves make each epoch, once
    assert orders[0][0] != orders[0][1]  # seeded by the epoch


def test_a_broken_off_iteration_starts_the_epoch_again_and_a_loaded_state_continues() -> None:
    data = DataLoader(torch.arange(8), batch_size=2)
    (loader,) = _loaders(data, _Step([0]), groups=1)
    for _ in loader:
        loader.steps.step_ended(True)
        break
    assert next(iter(loader)).tolist() == [0, 1]
    loader.load_state_dict({"epoch": 0, "global_batches": 3})
    rest = []
    for batch in loader:
        rest.append(batch.tolist())
        loader.steps.step_ended(True)
    assert rest == [[6, 7]]
    with pytest.raises(ValueError, match=r"needs \['global_batches'\]"):
        loader.load_state_dict({"epoch": 0, "batches_yielded": 1})


def _never_asked() -> tuple[int, int]:
    raise AssertionError("an evaluation pass joined the step's quorum")


def _group(data: DataLoader, processes: int, evaluating: list[bool]) -> list[QuorumDataLoader]:
    """The loaders of one replica group's processes; ``evaluating[0]`` says whether models are in eval mode."""
    return [
        quorum_loader(
            data,
            quorum=_never_asked if evaluating[0] else _Step([0]).of(0),
            groups=2 * processes,
            device=None,
            data_seed=None,
            refusals=NO_REFUSALS,
            reading=GroupReading(lambda: evaluating[0], process=p, processes=processes),
        )
        for p in range(processes)
    ]


def _gathered(loaders: list[QuorumDataLoader]) -> list[int]:
    """What gather_for_metrics returns over a whole pass of one group's processes (their batches of each
    round, in process order, the repeats of the last round cut)."""
    out: list[int] = []
    for batches in zip(*loaders, strict=True):
        round_ids = torch.cat(batches)
        if loaders[0].end_of_dataloader:
            round_ids = gather_for_metrics_truncate(round_ids, loaders[0].remainder)
        out += round_ids.tolist()
    return out


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_an_evaluation_pass_reads_the_whole_set_in_each_group_and_gathers_each_sample_once(
    processes: int,
) -> None:
    data = DataLoader(torch.arange(11), batch_size=2)  # 6 batches, the last of one sample
    evaluating = [True]
    for _ in range(2):  # two groups: the same whole set, neither asks the quorum
        loaders = _group(data, processes, evaluating)
        assert _gathered(loaders) == list(range(11))
        assert all(loader.end_of_dataloader for loader in loaders)
        assert [loader.state_dict() for loader in loaders] == [{"epoch": 0, "global_batches": 0}] * processes


def test_an_evaluation_pass_in_the_middle_of_training_leaves_the_training_position() -> None:
    data = DataLoader(torch.arange(8), batch_size=2)
    evaluating = [False]
    (loader,) = _group(data, 1, evaluating)
    training = iter(loader)
    assert next(training).tolist() == [0, 1]
    loader.steps.step_ended(True)
    evaluating[0] = True
    assert _gathered([loader]) == list(range(8))
    assert loader.remainder == -1 and loader.state_dict() == {"epoch": 0, "global_batches": 1}
    evaluating[0] = False
    assert next(training).tolist() == [2, 3] and loader.remainder == -1


def test_a_loader_read_to_its_end_without_a_step_in_training_mode_warns_once() -> None:
    data = DataLoader(torch.arange(4), batch_size=2)
    (loader,) = _group(data, 1, [False])
    with pytest.warns(UserWarning, match=r"Call model.eval\(\) before an evaluation loop"):
        assert len(list(loader)) == 2
    list(loader)  # once per loader (warnings are errors in this suite)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    ("data", "refusals", "message"),
    [
        (DataLoader(_Stream(), batch_size=2), NO_REFUSALS, "an IterableDataset"),
        (DataLoader(torch.arange(4), batch_size=2, num_workers=2), NO_REFUSALS, "num_workers=2"),
        (
            DataLoader(torch.arange(4), batch_size=2),
            {"DataLoaderConfiguration(split_batches=True)": True},
            r"split_batches=True\)",
        ),
        (DataLoader(torch.arange(4), batch_size=None), NO_REFUSALS, "batch_size=None"),
    ],
)
def test_what_cannot_be_dealt_by_step_yet_is_refused_by_name(
    data: DataLoader, refusals: dict[str, bool], message: str
) -> None:
    with pytest.raises(NotImplementedError, match=message):
        quorum_loader(data, quorum=_Step([0]).of(0), groups=1, device=None, data_seed=None, refusals=refusals)
