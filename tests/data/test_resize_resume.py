"""Resuming an epoch on another number of processes (real gloo groups): every sample of the epoch is read
exactly once across all attempts, for every way of sampling; the weights of a resized DDP or FSDP2 run
(sharded checkpoints, resharded by torch.distributed.checkpoint) equal a single-process replay of the logged global batches.

Processes are expensive, so one launch runs one attempt of every sampler kind: the attempts go 3 -> 2 -> 3
(chain "a") and 2 -> 3 (chain "b", which starts in the second launch).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import itertools
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from lockstep import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin
from lockstep.accelerator.elastic_resume import kept_accumulation
from lockstep.data import prepare_data_loader, skip_first_batches
from lockstep.data._sharding import IndexBatches, ShardSpec, plan_epoch, simulate_shard
from lockstep.data.resize import Resize, repeated_samples
from lockstep.report import read_run
from lockstep.state import PartialState
from lockstep.trainer._length_grouping import LengthGroupedSampler
from tests.data._stateful_data import CountingStream, PlainStream
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

N = 50  # samples per epoch
KINDS = {
    # kind: (per-process batch size, prepare_data_loader keywords, DataLoader keywords)
    "shuffled": (4, {}, {"shuffle": True}),
    "sequential_drop_last": (4, {}, {"drop_last": True}),
    "shuffled_uneven": (4, {"even_batches": False}, {"shuffle": True}),
    "seedable_uneven": (
        4,
        {"use_seedable_sampler": True, "even_batches": False},
        {"shuffle": True},
    ),
    "split_batches": (6, {"split_batches": True}, {"shuffle": True}),
    "batch_sampler": (4, {}, {}),
    "irregular_batches": (None, {"even_batches": False}, {}),
    "length_grouped": (4, {}, {}),
}
if importlib.util.find_spec("torchdata") is not None:  # a stream resumes from its dataset's own state
    KINDS["stream"] = (4, {"use_stateful_dataloader": True}, {})
EVEN = {kind for kind, (_, prepared, loader) in KINDS.items() if prepared.get("even_batches", True)}


class ShuffledBatches(BatchSampler):
    """A user's batch sampler (not torch's class): shuffled batches of 4 from its own generator."""

    def __init__(self) -> None:
        super().__init__(RandomSampler(range(N), generator=torch.Generator().manual_seed(5)), 4, False)

    def __iter__(self):
        yield from super().__iter__()


class IrregularBatches(Sampler[list[int]]):
    """Batches of 3, 5, 2, 3, 5, 2, ... (no batch size): dealt by replaying Accelerate's rules."""

    def __iter__(self):
        start, sizes = 0, [3, 5, 2]
        for index in range(len(self)):
            size = sizes[index % 3]
            yield list(range(start, min(start + size, N)))
            start += size

    def __len__(self) -> int:
        return 15  # 10 * 3 + 5 * 5 = 50 over 15 batches (the last one is 2)


def _loader(kind: str) -> DataLoader:
    torch.manual_seed(100 + PartialState().process_index)  # unsynchronised on purpose: rank 0's order rules
    batch_size, prepared, options = KINDS[kind]
    data: Any = list(range(N))
    if kind == "batch_sampler":
        original = DataLoader(data, batch_sampler=ShuffledBatches())
    elif kind == "irregular_batches":
        original = DataLoader(data, batch_sampler=IrregularBatches())
    elif kind == "length_grouped":
        sampler = LengthGroupedSampler([i % 7 + 1 for i in range(N)], batch_size=batch_size, seed=3)
        original = DataLoader(data, batch_size=batch_size, sampler=sampler)
    elif kind == "stream":
        original = DataLoader(CountingStream(N), batch_size=batch_size)
    else:
        original = DataLoader(data, batch_size=batch_size, **options)
    return prepare_data_loader(original, **prepared)


def _ids(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] if batch.dim() == 2 else batch).tolist()


def _attempt(plans: list[tuple[str, str, str | None, str | None, int | None]]) -> dict[str, Any]:
    """For each (chain, kind, load, save, steps): read ``steps`` batches (all when None) after loading
    ``load``, then save the position to ``save``; returns what this rank read."""
    faulthandler.dump_traceback_later(60)  # where a stuck attempt is, in the test's report (it takes ~1 s)
    out: dict[str, Any] = {}
    for chain, kind, load, save, steps in plans:
        loader = _loader(kind)
        if load is not None:
            loader.load_state_dict(torch.load(load, weights_only=True))
        read: list[list[int]] = []
        iterator = iter(loader)
        for batch in iterator:
            read.append(_ids(batch))
            if steps is not None and len(read) == steps:
                break
        if save is not None:
            state = loader.state_dict()
            if PartialState().is_main_process:  # as save_state: the main process's position, for every rank
                torch.save(state, save)
        iterator.close()
        resized = loader.resized
        out[f"{chain}:{kind}"] = {
            "read": read,
            "remainder": loader.remainder,
            "resized": None if resized is None else (resized.old_world, resized.new_world),
        }
    faulthandler.cancel_dump_traceback_later()
    return out


def _real_ids(ranks: list[dict[str, Any]], even: bool, finished: bool) -> list[int]:
    """The samples one attempt read, all ranks together, without the epoch end's repeated padding."""
    steps = max(len(rank["read"]) for rank in ranks)
    ids: list[int] = []
    for step in range(steps):
        batch = [i for rank in ranks if step < len(rank["read"]) for i in rank["read"][step]]
        if finished and even and step == steps - 1 and ranks[0]["remainder"] > 0:
            batch = batch[: ranks[0]["remainder"]]  # the real samples come first, rank by rank
        ids += batch
    return ids


def _launches(tmp_path: Path) -> list[list[tuple[str, str, str | None, str | None, int | None]]]:
    """Chains of attempts over five launches on 1, 3, 2, 3 and 1 processes: "a" 3 -> 2 -> 3, "b" 2 -> 3,
    "c" 2 -> 1, "d" 1 -> 2 (one process shuffles as the plain DataLoader does, several with a generator of
    their own: each must continue the other's order)."""

    def path(chain: str, kind: str, attempt: int) -> str:
        return str(tmp_path / f"{chain}_{kind}_{attempt}.pt")

    zeroth = [("d", kind, None, path("d", kind, 1), 3) for kind in KINDS]
    first = [("a", kind, None, path("a", kind, 1), 2) for kind in KINDS]
    second = [("a", kind, path("a", kind, 1), path("a", kind, 2), 1) for kind in KINDS]
    second += [("b", kind, None, path("b", kind, 1), 3) for kind in KINDS]
    second += [("c", kind, None, path("c", kind, 1), 2) for kind in KINDS]
    second += [("d", kind, path("d", kind, 1), None, None) for kind in KINDS]
    third = [("a", kind, path("a", kind, 2), None, None) for kind in KINDS]
    third += [("b", kind, path("b", kind, 1), None, None) for kind in KINDS]
    fourth = [("c", kind, path("c", kind, 1), None, None) for kind in KINDS]
    return [zeroth, first, second, third, fourth]


WORLDS = [1, 3, 2, 3, 1]  # processes of each launch
CHAINS = {"a": [1, 2, 3], "b": [2, 3], "c": [2, 4], "d": [0, 2]}  # the launches each chain goes through


# drop_last: the batch sampler drops 48 and 49 (12 batches of 4), and the last attempt drops its incomplete
# round of batches, as an uninterrupted run on that many processes would: chain a has 4 batches left for 3
# processes (44-47 dropped), b 6 for 3, c 8 for 1, d 9 for 2 (44-47 dropped).
DROP_LAST_IDS = {"a": 44, "b": 48, "c": 48, "d": 44}


def _expected_ids(kind: str, chain: str) -> set[int]:
    return set(range(DROP_LAST_IDS[chain] if kind == "sequential_drop_last" else N))


def test_every_sample_once_across_resizes_3_2_3_and_2_3_and_to_and_from_one_process(tmp_path):
    launches = zip(WORLDS, _launches(tmp_path))
    attempts = [run_distributed(_attempt, world, plans, timeout=180) for world, plans in launches]
    for chain, launches in CHAINS.items():
        for kind in KINDS:
            key = f"{chain}:{kind}"
            ids: list[int] = []
            for number, launch in enumerate(launches):
                finished = number == len(launches) - 1
                ids += _real_ids([rank[key] for rank in attempts[launch]], kind in EVEN, finished)
            counts = Counter(ids)
            assert set(counts) == _expected_ids(kind, chain) and set(counts.values()) == {1}, (
                key,
                sorted(counts.items()),
            )
            worlds = [(WORLDS[a], WORLDS[b]) for a, b in itertools.pairwise(launches)]
            resized = [attempts[launch][0][key]["resized"] for launch in launches[1:]]
            assert resized == worlds, key


def test_a_stream_without_a_state_of_its_own_is_refused_when_it_cannot_resume_exactly():
    def loader(world: int) -> DataLoader:
        return prepare_data_loader(
            DataLoader(PlainStream(N), batch_size=4), num_processes=world, process_index=0
        )

    saved = loader(3)
    iterator = iter(saved)
    next(iterator), next(iterator)  # 2 steps of 12 samples: 24
    state = saved.state_dict()
    iterator.close()
    assert (state["samples_consumed"], state["total_batch_size"]) == (24, 12)
    with pytest.raises(
        ValueError,
        match=r"saved on 3 processes after 24 samples of epoch 0 \(12 per step\).*"
        r"reads 20 per step on 5 processes.*Choices: give the dataset state_dict\(\)",
    ):
        loader(5).load_state_dict(state)
    resumed = loader(2)  # 24 samples are 3 whole steps of 8: the stream is read again exactly to there
    resumed.load_state_dict(state)
    assert [_ids(batch) for batch in resumed][:2] == [[24, 25, 26, 27], [32, 33, 34, 35]]
    assert resumed.resized is not None and resumed.resized.samples_consumed == 24


# -- weights: a resized DDP run against a single-process replay of its logged global batches ----------------


class Points(torch.utils.data.Dataset):
    """Sample ``i``: an id, 3 features and a target, all a function of ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.tensor([float(i) / N, (i % 7) / 7.0, ((i * 3) % 11) / 11.0])
        return {"id": torch.tensor(i), "x": x, "y": torch.tensor([(i % 5) / 5.0])}


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _accelerator(backend: str, keep: bool, logs: str) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if backend == "fsdp2" else None
    return Accelerator(
        gradient_accumulation_steps=2,
        elastic_keep_global_batch=keep,
        fsdp_plugin=plugin,
        log_with="jsonl",
        project_dir=logs,
    )


def _full_weights(accelerator: Accelerator, model: torch.nn.Module) -> list[torch.Tensor]:
    """The whole weights on every rank (an FSDP2 parameter is a shard: its full tensor is gathered)."""
    parameters = accelerator.unwrap_model(model).parameters()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in parameters]


def _train(
    backend: str, logs: str, load: str | None, save: str | None, micro_steps: int | None, keep: bool
) -> dict[str, Any]:
    """One attempt: ``micro_steps`` micro-batches (all when None) with 2 accumulation steps in the script."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.checkpoint").addHandler(handler)
    accelerator = _accelerator(backend, keep, logs)
    model, optimizer = _model_and_optimizer()
    loader = DataLoader(Points(), batch_size=2, shuffle=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # counts its steps only
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    if load is not None:
        accelerator.load_state(load)
    accelerator.init_trackers("run")  # after the load: its restart line waits for the trackers
    log: list[dict[str, Any]] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        log.append(
            {
                "trained": accelerator.gather(batch["id"]).tolist(),  # padding included: it was trained on
                "real": accelerator.gather_for_metrics(batch["id"]).tolist(),
                "accumulation": accelerator.gradient_accumulation_steps,
                "sync": accelerator.sync_gradients,
            }
        )
        if micro_steps is not None and len(log) == micro_steps:
            break
    if save is not None:
        accelerator.save_state(save)
    accelerator.end_training()
    weights = _full_weights(accelerator, model)
    logging.getLogger("lockstep.checkpoint").removeHandler(handler)
    lines = [r for r in records if r.startswith("resumed on")]
    return {"log": log, "weights": weights, "lines": lines, "schedule": schedule.scheduler.last_epoch}


def _replay(log: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The logged micro-batches on one process, as DDP trained them (the mean over the global micro-batch,
    divided by the accumulation steps of the time; a step where the run synchronised)."""
    model, optimizer = _model_and_optimizer()
    data = Points()
    for micro in log:
        samples = [data[i] for i in micro["trained"]]
        x, y = torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples])
        (torch.nn.functional.mse_loss(model(x), y) / micro["accumulation"]).backward()
        if micro["sync"]:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


TOLERANCE = 1e-6  # measured 3.1e-7 (float32, 10 micro-steps): DDP averages rank means, the replay one mean


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_resized_weights_equal_a_single_process_replay_and_the_restart_lines(tmp_path, backend):
    first, second, logs = str(tmp_path / "a1"), str(tmp_path / "a2"), str(tmp_path / "logs")
    # 2 optimizer steps of 12 samples; kept at 12: 3 accumulation steps of 4; the script's 2 steps of 6
    one = run_distributed(_train, 3, backend, logs, None, first, 4, False)[0]
    if backend == "fsdp2":  # saved as 3 shards, read on 2, then on 3 again
        assert len(list(Path(first, "pytorch_model_fsdp_0").glob("*.distcp"))) == 3
    two = run_distributed(_train, 2, backend, logs, first, second, 3, True)[0]
    three = run_distributed(_train, 3, backend, logs, second, None, None, False)[0]
    log = one["log"] + two["log"] + three["log"]
    real = [i for micro in log for i in micro["real"]]
    assert sorted(real) == list(range(N))
    assert [m["accumulation"] for m in log] == [2] * 4 + [3] * 3 + [2] * 3
    assert [m["sync"] for m in log] == [False, True] * 2 + [False, False, True] + [False, True, True]
    repeats = (
        "; the epoch's last micro-step repeats {} samples from its start (even_batches), which are trained "
        "twice: DataLoaderConfiguration(even_batches=False), with accelerator.join_uneven_inputs under DDP, "
        "trains the rest of the epoch with each sample once"
    )
    assert two["lines"] == [
        f"resumed on 2 processes from a checkpoint saved on 3: {first} after 2 optimizer steps, epoch 0, 24 of 50 samples of "
        "the epoch consumed; global batch kept at 12 samples per optimizer step (gradient_accumulation_steps "
        "2 -> 3, Accelerator(elastic_keep_global_batch=True))"
        + repeats.format(2)  # 26 left, 4 per micro-step
    ]
    assert three["lines"] == [
        f"resumed on 3 processes from a checkpoint saved on 2: {second} after 3 optimizer steps, epoch 0, 36 of 50 samples of "
        "the epoch consumed; global batch follows the number of processes: 12 samples per optimizer step (6 per "
        "micro-step x 2 accumulation steps; it was 12); pass Accelerator(elastic_keep_global_batch=True) to "
        "keep 12" + repeats.format(4)
    ]
    # what the line says is what the run did: the resumed epoch's last micro-step repeated 4 samples
    assert sum(len(m["trained"]) - len(m["real"]) for m in three["log"]) == 4
    # The schedule follows the samples: 3 single-process steps of the script's (2 samples x 2 accumulation
    # steps) per optimizer step of 12 samples, while attempt two keeps 12 on 2 processes (2 would lag).
    assert [one["schedule"], two["schedule"], three["schedule"]] == [6, 9, 15]
    events = read_run(Path(logs, "run", "metrics.jsonl")).events  # what `lockstep report` lists
    assert events == [(4.0, two["lines"][0]), (9.0, three["lines"][0])]
    replayed = _replay(log)
    difference = max((a - b).abs().max().item() for a, b in zip(three["weights"], replayed, strict=True))
    print(f"largest difference from the single-process replay: {difference:.3g}")
    assert difference <= TOLERANCE
    moved = max((a - b).abs().max().item() for a, b in zip(replayed, _model_and_optimizer()[0].parameters()))
    assert moved > 0.05  # the run did train


def _train_uneven(load: str | None, save: str | None, micro_steps: int | None) -> dict[str, Any]:
    """One attempt with ``even_batches=False`` under ``join_uneven_inputs``: each rank logs its own micro-batches
    (their number differs at the epoch's end, where a rank without a batch joins)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.checkpoint").addHandler(handler)
    accelerator = Accelerator(
        gradient_accumulation_steps=2, dataloader_config=DataLoaderConfiguration(even_batches=False)
    )
    model, optimizer = _model_and_optimizer()
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(Points(), batch_size=2, shuffle=True)
    )
    if load is not None:
        accelerator.load_state(load)
    log: list[dict[str, Any]] = []
    with accelerator.join_uneven_inputs([model]):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
                optimizer.step()
                optimizer.zero_grad()
            log.append({"ids": batch["id"].tolist(), "sync": accelerator.sync_gradients})
            if micro_steps is not None and len(log) == micro_steps:
                break
    if save is not None:
        accelerator.save_state(save)
    logging.getLogger("lockstep.checkpoint").removeHandler(handler)
    lines = [r for r in records if r.startswith("resumed on")]
    return {"log": log, "weights": _full_weights(accelerator, model), "lines": lines}


def _replay_per_sample(attempts: list[list[dict[str, Any]]]) -> list[torch.Tensor]:
    """Each attempt's micro-steps on one process as DDP under join trains them: every rank's mean loss over
    the attempt's number of processes (a joined rank adds nothing), divided by the 2 accumulation steps, so
    every sample weighs as much as in a full micro-step."""
    model, optimizer = _model_and_optimizer()
    data = Points()
    for ranks in attempts:
        for step in range(max(len(rank["log"]) for rank in ranks)):
            parts = [rank["log"][step] for rank in ranks if step < len(rank["log"])]
            for part in parts:
                x = torch.stack([data[i]["x"] for i in part["ids"]])
                y = torch.stack([data[i]["y"] for i in part["ids"]])
                (torch.nn.functional.mse_loss(model(x), y) / len(ranks) / 2).backward()
            if parts[0]["sync"]:
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_uneven_batches_after_a_resize_train_each_sample_once_with_its_weight(tmp_path):
    """The way the restart line names for an exact resized epoch: ``even_batches=False`` under
    ``join_uneven_inputs``. 3 -> 2: 26 samples left in 13 batches of 2, 7 on rank 0 and 6 on rank 1; nothing
    is repeated, and the weights equal a one-process replay that weighs every sample alike."""
    saved = str(tmp_path / "a1")
    one = run_distributed(_train_uneven, 3, None, saved, 4, timeout=180)
    two = run_distributed(_train_uneven, 2, saved, None, None, timeout=180)
    ids = [i for ranks in (one, two) for rank in ranks for micro in rank["log"] for i in micro["ids"]]
    assert sorted(ids) == list(range(N))  # each sample once: no padding
    assert [len(rank["log"]) for rank in two] == [7, 6]
    assert len(two[0]["lines"]) == 1 and two[0]["lines"][0].endswith("to keep 12")  # says nothing repeats
    replayed = _replay_per_sample([one, two])
    difference = max((a - b).abs().max().item() for a, b in zip(two[0]["weights"], replayed, strict=True))
    print(f"even_batches=False, 3 -> 2: largest difference from the per-sample replay: {difference:.3g}")
    assert difference <= TOLERANCE


def test_the_samples_a_resized_epoch_repeats_are_what_its_plan_deals():
    for world, start, split, size in itertools.product((2, 3), range(13), (False, True), (2, 4)):
        if split and size % world:
            continue
        batches = IndexBatches(range(N), size, drop_last=False)
        remaining = sum(len(batch) for batch in list(batches)[start:])
        dealt = 0
        for rank in range(world):
            spec = ShardSpec(world_size=world, rank=rank, batch_size=size, split_batches=split)
            dealt += sum(len(batch) for batch in plan_epoch(batches, spec, start=start))
        total = size if split else size * world
        assert repeated_samples(remaining, total) == dealt - remaining, (world, start, split, size)


def test_keeping_the_global_batch_refuses_a_division_that_is_not_exact():
    resize = Resize(
        old_world=3, new_world=4, epoch=0, samples_consumed=12, old_total_batch_size=6, new_total_batch_size=8
    )
    with pytest.raises(
        ValueError,
        match=r"keeps the global batch of 12 samples per optimizer step \(6 per "
        r"micro-step on 3 processes x 2 accumulation steps\), but one micro-step on 4 processes "
        r"reads 8 samples.*Choices",
    ):
        kept_accumulation(resize, 2)
    assert kept_accumulation(Resize(3, 2, 0, 12, 6, 4), 2) == 3


def test_the_plan_from_a_global_start_deals_the_rest_of_the_epoch_as_a_fresh_one():
    batches = IndexBatches(range(N), 4, drop_last=False)  # 13 batches, the last of 2
    for world, start, split in itertools.product((1, 2, 3), range(14), (False, True)):
        size = 6 if split else 4
        batches = IndexBatches(range(N), size, drop_last=False)
        for rank in range(world):
            spec = ShardSpec(
                world_size=world, rank=rank, batch_size=size, split_batches=split, even_batches=False
            )
            plan = list(plan_epoch(batches, spec, start=start))
            assert plan == simulate_shard(list(batches)[start:], spec), (world, start, split, rank)


def test_a_state_from_before_global_positions_resumes_on_another_number_of_processes():
    old = {"epoch": 0, "batches_yielded": 2, "total_batch_size": 12, "num_processes": 3, "sampler_seed": -1}
    reads = []
    for rank in range(2):
        loader = prepare_data_loader(
            DataLoader(list(range(N)), batch_size=4), num_processes=2, process_index=rank
        )
        loader.load_state_dict(old)  # 2 steps of 3 x 4 samples: 24 consumed, 6 global batches
        assert len(loader) == 4 and loader.resized.samples_consumed == 24  # 7 batches left, 2 a step
        reads.append([batch.tolist() for batch in loader])
        assert len(loader) == 7  # the next epoch is whole
    assert reads[0][0] == [24, 25, 26, 27] and reads[1][0] == [28, 29, 30, 31]
    ids = sorted(i for read in reads for batch in read for i in batch)
    assert ids == list(range(6)) + list(range(24, 50))  # the last round completed from the epoch's start


def test_skip_first_batches_after_a_resized_load_continues_with_0_and_warns_otherwise():
    old = {"epoch": 0, "batches_yielded": 2, "total_batch_size": 12, "num_processes": 3, "sampler_seed": -1}

    def loader() -> DataLoader:
        resumed = prepare_data_loader(
            DataLoader(list(range(N)), batch_size=4), num_processes=2, process_index=0
        )
        resumed.load_state_dict(old)
        return resumed

    continued = skip_first_batches(loader(), 0)
    assert [batch.tolist() for batch in continued][:2] == [[24, 25, 26, 27], [32, 33, 34, 35]]
    with pytest.warns(
        UserWarning,
        match=r"skip_first_batches\(\.\.\., 1\) after load_state, which restored the "
        r"loader where a run on another number of processes stopped.*pass 0",
    ):
        first = next(iter(skip_first_batches(loader(), 1)))
    assert first.tolist() == [8, 9, 10, 11]  # batch 1 of rank 0 from the epoch's start, as asked
