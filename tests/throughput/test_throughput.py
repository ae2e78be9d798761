"""Throughput accounting: the step-time breakdown against wall clock, tokens, FLOPs, MFU, accumulation."""

from __future__ import annotations

import itertools
import json
import statistics
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from lockstep import Accelerator, ThroughputKwargs
from lockstep.throughput import StepTimer, compute_dtype_name, device_peak_flops, peak_flops_per_second
from lockstep.throughput.clock import CpuClock
from tests.helpers.multiprocess import run_distributed

PHASE_KEYS = ("time/data", "time/forward_backward", "time/optimizer", "time/checkpoint", "time/other")
BATCH = 4
FEATURES = 8


class SlowDataset(Dataset):
    """``length`` samples; reading one sleeps ``delay`` seconds (waiting for data)."""

    def __init__(self, length: int, delay: float) -> None:
        self.length, self.delay = length, delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.full((FEATURES,), float(index) / self.length), torch.tensor([1.0])


class SlowModel(nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.linear(x)


class SlowSGD(torch.optim.SGD):
    def __init__(self, params, delay: float) -> None:
        super().__init__(params, lr=0.01)
        self.delay = delay

    def step(self, closure=None):
        time.sleep(self.delay)
        return super().step(closure)


def _train(accelerator: Accelerator, *, steps: int, delays: dict[str, float], save_dir: Path | None = None):
    """Train ``steps`` steps with known sleeps in each phase; return (wall step times, step_stats, stalls)."""
    data = SlowDataset(steps * BATCH * accelerator.num_processes, delays["data"] / BATCH)
    model = SlowModel(delays["forward"])
    optimizer = SlowSGD(model.parameters(), delays["optimizer"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    marks, stats, stalls = [time.perf_counter()], [], {}
    for step, (x, y) in enumerate(loader, start=1):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        marks.append(time.perf_counter())
        stats.append(accelerator.step_stats)
        optimizer.zero_grad()
        time.sleep(delays["other"])
        if save_dir is not None and step % 3 == 1:
            accelerator.save_state(str(save_dir / f"step_{step}"))
            stalls[step + 1] = accelerator.last_save_report.stall_seconds  # paid by the next step
    walls = [after - before for before, after in itertools.pairwise(marks)]
    return walls, stats, stalls


def _assert_breakdown_matches_wall_clock(walls: list[float], stats: list[dict], delays: dict[str, float]):
    assert len(stats) == len(walls)
    for wall, figures in zip(walls, stats):
        parts = sum(figures[key] for key in PHASE_KEYS)
        assert parts == pytest.approx(figures["time/step"], rel=1e-9)
        assert abs(parts - wall) / wall < 0.05, (parts, wall, figures)
        assert all(figures[key] >= -1e-9 for key in PHASE_KEYS), figures
    # Each known sleep lands in its own phase (medians over steps 2.. resist a late wake-up on a busy machine).
    later = stats[1:]
    for key, delay in (
        ("time/data", delays["data"]),
        ("time/forward_backward", delays["forward"]),
        ("time/optimizer", delays["optimizer"]),
        ("time/other", delays["other"]),
    ):
        median = statistics.median(figures[key] for figures in later)
        assert delay <= median < delay + 0.025, (key, median, delay)


DELAYS = {"data": 0.04, "forward": 0.06, "optimizer": 0.02, "other": 0.03}


def test_breakdown_adds_up_to_the_wall_clock_step_on_one_process(tmp_path):
    every_step = ThroughputKwargs(log_every_n_steps=1)
    accelerator = Accelerator(kwargs_handlers=[every_step], log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    walls, stats, stalls = _train(accelerator, steps=7, delays=DELAYS, save_dir=tmp_path / "ckpt")
    accelerator.end_training()
    _assert_breakdown_matches_wall_clock(walls, stats, DELAYS)
    # save_state after step 1 and 4 stalls steps 2 and 5; nothing else is checkpoint time.
    for step, figures in enumerate(stats, start=1):
        if step in stalls:
            assert stalls[step] <= figures["time/checkpoint"] < stalls[step] + 0.01
        else:
            assert figures["time/checkpoint"] == 0.0
    for figures in stats:
        assert figures["samples_per_second"] == pytest.approx(BATCH / figures["time/step"])
        assert "time/communication" not in figures  # one process: nothing to communicate
        assert "tokens_per_second" not in figures  # the batches hold no token ids
        assert "flops_per_second" in figures and "mfu" not in figures  # CPU: FLOP/s, no MFU
    # Logged once per step, through the tracker, with the same figures.
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 8))
    for line, figures in zip(lines, stats):
        assert {key: line[key] for key in figures} == pytest.approx(figures)


def _ddp_worker(project_dir: str):
    every_step = ThroughputKwargs(log_every_n_steps=1)
    accelerator = Accelerator(kwargs_handlers=[every_step], log_with="jsonl", project_dir=project_dir)
    rank = accelerator.process_index
    accelerator.init_trackers("run")
    delays = dict(DELAYS, forward=DELAYS["forward"] + (0.06 if rank == 1 else 0.0))  # rank 1 is slower
    walls, stats, _ = _train(accelerator, steps=6, delays=delays)
    accelerator.end_training()
    return walls, stats, delays


@pytest.mark.distributed
def test_breakdown_adds_up_on_two_ddp_processes_and_shows_the_exposed_all_reduce_wait(tmp_path):
    results = run_distributed(_ddp_worker, 2, str(tmp_path), timeout=120)
    for walls, stats, _ in results:
        for wall, figures in zip(walls, stats):
            parts = sum(figures[key] for key in PHASE_KEYS)
            assert abs(parts - wall) / wall < 0.05, (parts, wall, figures)
            assert 0.0 <= figures["time/communication"] <= figures["time/forward_backward"]
            assert figures["samples_per_second"] == pytest.approx(2 * BATCH / figures["time/step"])
    # Rank 0 reaches the gradient all-reduce 60 ms before rank 1 each step, and waits for it there.
    waits = [statistics.median(f["time/communication"] for f in stats[1:]) for _, stats, _ in results]
    assert waits[0] >= 0.045, waits
    assert waits[1] < 0.025, waits
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 7))  # the main process logs, once per step
    assert [line["time/step"] for line in lines] == pytest.approx([f["time/step"] for f in results[0][1]])


class TokenBatches(Dataset):
    """Token batches with right padding: sample i has 3 + i % 5 real tokens out of 8."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        real = 3 + index % 5
        mask = torch.zeros(8, dtype=torch.long)
        mask[:real] = 1
        return {"input_ids": torch.arange(8) * mask, "attention_mask": mask}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (self.head(self.embed(input_ids)) * attention_mask.unsqueeze(-1)).mean()


@pytest.mark.parametrize("accumulation", [1, 3])
def test_tokens_are_counted_exactly_from_attention_masks(accumulation):
    accelerator = Accelerator(step_timing=True, gradient_accumulation_steps=accumulation)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(TokenBatches(), batch_size=2))
    tokens, samples = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            figures = accelerator.step_stats
            tokens.append(figures["tokens_per_second"] * figures["time/step"])
            samples.append(figures["samples_per_second"] * figures["time/step"])
    per_sample = [3 + i % 5 for i in range(12)]
    per_step = 2 * accumulation
    expected = [sum(per_sample[i : i + per_step]) for i in range(0, 12, per_step)]
    assert tokens == pytest.approx(expected, abs=1e-6)  # 7, 11, 10, ... real tokens, not 8 per sample
    assert samples == pytest.approx([per_step] * (12 // per_step), abs=1e-6)


class ScaledLinear(nn.Module):
    """A learned input scale, then a Linear: its input needs a gradient, so backward costs 2x forward."""

    def __init__(self, features_in: int, features_out: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features_in))
        self.linear = nn.Linear(features_in, features_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.scale)


def _flop_counter_figure(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as forward:
        loss = model(x).sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops() + backward.get_total_flops()


@pytest.mark.parametrize(("make_model", "factor"), [(ScaledLinear, 3), (nn.Linear, 2)])
def test_flops_are_counted_once_and_match_flop_counter_mode(make_model, factor):
    features_in, features_out, batch = 16, 32, 6
    torch.manual_seed(0)
    reference = make_model(features_in, features_out)
    expected = _flop_counter_figure(reference, torch.randn(batch, features_in))
    assert expected == factor * 2 * batch * features_in * features_out  # 2*B*in*out forward

    accelerator = Accelerator(step_timing=True)
    model = make_model(features_in, features_out)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(15, features_in))  # batches of 6, 6 and 3
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=batch))
    flops, hooks = [], []
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        figures = accelerator.step_stats
        flops.append(figures["flops_per_second"] * figures["time/step"])
        hooks.append(len(model._forward_pre_hooks) + len(model._forward_hooks))
    assert flops[0] == pytest.approx(expected)
    assert flops[1] == pytest.approx(expected)  # the same batch size: the counted figure, not a recount
    assert flops[2] == pytest.approx(expected / 2)  # the short last batch: scaled by its size
    assert hooks == [0, 0, 0]  # counting hooks are gone after the first step


def test_with_accumulation_a_step_spans_its_micro_batches():
    delays = {"data": 0.01, "forward": 0.02, "optimizer": 0.01, "other": 0.0}
    accelerator = Accelerator(step_timing=True, gradient_accumulation_steps=3)
    data = SlowDataset(9 * BATCH, delays["data"] / BATCH)
    model = ScaledLinear(FEATURES, 1)
    optimizer = SlowSGD(model.parameters(), delays["optimizer"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    stats, marks = [], [time.perf_counter()]
    for x, y in loader:
        with accelerator.accumulate(model):
            time.sleep(delays["forward"])
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            marks.append(time.perf_counter())
            stats.append(accelerator.step_stats)
    assert len(stats) == 3  # 9 micro-batches, 3 optimizer steps
    micro_flops = 3 * 2 * BATCH * FEATURES * 1
    for figures, (before, after) in zip(stats, itertools.pairwise(marks)):
        wall = after - before
        assert abs(sum(figures[key] for key in PHASE_KEYS) - wall) / wall < 0.05
        assert figures["samples_per_second"] * figures["time/step"] == pytest.approx(3 * BATCH)
        # The loader reads one batch ahead: 4 batches are read in the first step, 2 in the last.
        assert figures["time/data"] >= 2 * delays["data"]
        assert figures["time/forward_backward"] >= 3 * delays["forward"]
        assert delays["optimizer"] <= figures["time/optimizer"] < 3 * delays["optimizer"]  # stepped once
        assert figures["flops_per_second"] * figures["time/step"] == pytest.approx(3 * micro_flops)
    assert sum(figures["time/data"] for figures in stats) >= 9 * delays["data"]


@pytest.mark.parametrize("every", [3, None])  # None: the default, every 10 steps
def test_every_n_steps_the_figures_of_those_steps_are_logged(tmp_path, every):
    handlers = [ThroughputKwargs(log_every_n_steps=every)] if every else []
    accelerator = Accelerator(
        step_timing=True, kwargs_handlers=handlers, log_with="jsonl", project_dir=str(tmp_path)
    )
    accelerator.init_trackers("run")
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(21 * BATCH - 2, FEATURES))  # the last batch is short
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    stats = []
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        stats.append(accelerator.step_stats)
    accelerator.end_training()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    every = every or 10
    assert [line["step"] for line in lines] == list(range(every, 22, every))
    for line in lines:
        window = stats[line["step"] - every : line["step"]]
        seconds = sum(f["time/step"] for f in window)
        for key in (*PHASE_KEYS, "time/step"):  # seconds per step, averaged over the window
            assert line[key] == pytest.approx(sum(f[key] for f in window) / every)
        samples = sum(f["samples_per_second"] * f["time/step"] for f in window)
        assert line["samples_per_second"] == pytest.approx(samples / seconds)
        assert samples == pytest.approx(every * BATCH - (2 if line["step"] == 21 else 0))


def test_a_loader_from_skip_first_batches_is_timed_too():
    accelerator = Accelerator(step_timing=True)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = SlowDataset(5 * BATCH, 0.005)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    stats = []
    for x, y in accelerator.skip_first_batches(loader, 2):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        stats.append(accelerator.step_stats)
    assert [f["samples_per_second"] * f["time/step"] for f in stats] == pytest.approx([BATCH] * 3)
    assert sum(f["time/data"] for f in stats) >= 3 * BATCH * 0.005  # the 3 batches left were read


def test_an_evaluation_in_the_middle_adds_reading_time_but_no_samples():
    accelerator = Accelerator(step_timing=True)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(SlowDataset(4 * BATCH, 0.0), batch_size=BATCH)
    evaluation = DataLoader(SlowDataset(3 * BATCH, 0.01 / BATCH), batch_size=BATCH)  # 10 ms per batch
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    stats = []
    for step, (x, y) in enumerate(train, start=1):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        stats.append(accelerator.step_stats)
        if step == 2:
            with torch.no_grad():
                for ex, _ in evaluation:
                    model(ex)
    assert [f["samples_per_second"] * f["time/step"] for f in stats] == pytest.approx([BATCH] * 4)
    assert stats[2]["time/data"] >= 0.03 > stats[1]["time/data"]  # step 3 paid for reading 3 eval batches


def test_a_failing_read_leaves_the_accounting_consistent():
    class Flaky(SlowDataset):
        def __getitem__(self, index: int):
            if index == BATCH * 2 and not self.failed:
                self.failed = True
                raise OSError("disk hiccup")
            return super().__getitem__(index)

    data = Flaky(4 * BATCH, 0.0)
    data.failed = False
    accelerator = Accelerator(step_timing=True)
    model = nn.Linear(FEATURES, 1)
    optimizer = SlowSGD(model.parameters(), 0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    stats = []
    for _ in range(2):  # the first epoch fails at batch 2 (read one ahead, while batch 1 is handed over)
        try:
            for x, y in loader:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                stats.append(accelerator.step_stats)
        except OSError:
            pass
    assert len(stats) == 4 + 1  # one step before the failure, then a whole epoch
    for figures in stats:
        assert sum(figures[key] for key in PHASE_KEYS) == pytest.approx(figures["time/step"], rel=1e-9)
        assert figures["time/optimizer"] >= 0.01
        assert figures["time/forward_backward"] > 0.0  # no read left "open" to swallow the training time


def test_with_two_optimizers_a_step_ends_when_both_stepped():
    accelerator = Accelerator(step_timing=True)
    generator, critic = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, 1)
    data = DataLoader(SlowDataset(4 * BATCH, 0.0), batch_size=BATCH)
    generator, critic, g_opt, c_opt, loader = accelerator.prepare(
        generator,
        critic,
        SlowSGD(generator.parameters(), 0.01),
        SlowSGD(critic.parameters(), 0.02),
        data,
    )
    steps = []
    for x, _ in loader:
        accelerator.backward(critic(generator(x).detach()).mean())
        c_opt.step()
        steps.append(accelerator.step_stats.get("time/step"))  # the step is not over yet
        accelerator.backward(-critic(generator(x)).mean())
        g_opt.step()
        figures = accelerator.step_stats
        assert figures["time/optimizer"] >= 0.03  # both optimizers' steps belong to this step
        assert figures["samples_per_second"] * figures["time/step"] == pytest.approx(BATCH)
        steps.append(figures["time/step"])
    assert steps[0] is None and steps[2::2] == steps[1:-1:2]  # nothing ended after the first optimizer


def test_step_timing_is_off_by_default_and_says_how_to_switch_it_on():
    accelerator = Accelerator()
    _, optimizer, loader = accelerator.prepare(
        nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), DataLoader(range(4))
    )
    assert list(accelerator._step_hooks) == []  # the timer is not among the step hooks
    assert optimizer._step_hooks is accelerator._step_hooks and loader._step_hooks is accelerator._step_hooks
    with pytest.raises(
        RuntimeError, match=r"step timing on, and it is off .*Accelerator\(step_timing=True\)"
    ):
        accelerator.step_stats  # noqa: B018


def test_step_stats_is_empty_before_the_first_step_ends():
    assert Accelerator(step_timing=True).step_stats == {}


def test_bad_settings_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"step_timing=False\) conflicts with the ThroughputKwargs"):
        Accelerator(step_timing=False, kwargs_handlers=[ThroughputKwargs()])
    with pytest.raises(TypeError, match=r"Accelerator\(step_timing='yes'\) is invalid: pass True or False"):
        Accelerator(step_timing="yes")
    with pytest.raises(ValueError, match=r"log_every_n_steps=-1\) is invalid: it must be >= 0"):
        ThroughputKwargs(log_every_n_steps=-1)
    with pytest.raises(ValueError, match=r"peak_flops=0\) is invalid"):
        ThroughputKwargs(peak_flops=0)


def test_mfu_uses_a_given_peak_on_any_device():
    accelerator = Accelerator(kwargs_handlers=[ThroughputKwargs(peak_flops=1e9)])
    model = nn.Linear(FEATURES, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):  # no prepared loader: the FLOPs are still counted, unscaled
        accelerator.backward(model(torch.randn(BATCH, FEATURES)).sum())
        optimizer.step()
    figures = accelerator.step_stats
    assert figures["mfu"] == pytest.approx(figures["flops_per_second"] / 1e9)
    assert figures["flops_per_second"] * figures["time/step"] == pytest.approx(2 * 2 * BATCH * FEATURES * 4)
    assert "samples_per_second" not in figures  # no batches went through a prepared loader


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "fp16", 835.5e12),
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA GH200 480GB", "bf16", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
        ("NVIDIA A10G", "bf16", 125e12),
        ("NVIDIA A10", "fp16", 125e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-PCIE-32GB", "fp16", 112e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
        ("Tesla T4", "fp16", 65e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", None),  # a slice: unknown share of the peak
        ("NVIDIA GeForce GTX 1080", "fp32", None),  # not in the table
    ],
)
def test_peak_flops_table(name, dtype, peak):
    assert peak_flops_per_second(name, dtype) == peak


def test_peak_flops_of_a_device_only_on_known_gpus():
    def fake_name(device):
        return "NVIDIA H100 80GB HBM3"

    assert device_peak_flops(torch.device("cuda", 0), "bf16", device_name=fake_name) == 989.4e12
    assert device_peak_flops(torch.device("cpu"), "bf16", device_name=fake_name) is None
    assert device_peak_flops(torch.device("cuda", 0), "fp32", device_name=lambda d: "Mystery GPU") is None
    with pytest.raises(ValueError, match=r"compute_dtype='int3'\) is invalid: use one of"):
        peak_flops_per_second("NVIDIA H100", "int3")


def test_compute_dtype_follows_mixed_precision_then_parameters():
    assert compute_dtype_name("bf16", torch.float32) == "bf16"
    assert compute_dtype_name("fp16", torch.float32) == "fp16"
    assert compute_dtype_name("no", torch.bfloat16) == "bf16"
    assert compute_dtype_name("no", torch.float32) == "fp32"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert compute_dtype_name("no", torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_clock_follows_the_device():
    from lockstep.throughput.clock import CpuClock, CudaClock, SynchronizingClock, clock_for

    assert type(clock_for(torch.device("cpu"))) is CpuClock
    assert type(clock_for(torch.device("cuda", 0))) is CudaClock  # CUDA events: device time
    mps = clock_for(torch.device("mps"))
    assert type(mps) is SynchronizingClock and mps.synchronize is torch.mps.synchronize


class EventLikeClock(CpuClock):
    """Marks that are objects read only through ``elapsed`` once waited for, like CUDA events."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def mark(self):
        return types.SimpleNamespace(seconds=time.perf_counter())

    def elapsed(self, start, end) -> float:
        assert self.waited and self.waited[-1].seconds >= end.seconds, "read before the step's last mark"
        return end.seconds - start.seconds

    def wait(self, mark) -> None:
        self.waited.append(mark)


def test_device_clock_marks_are_read_once_per_step_after_waiting_for_its_end():
    clock = EventLikeClock()
    timer = StepTimer(
        ThroughputKwargs(count_flops=False),
        device=torch.device("cpu"),
        num_processes=1,
        models=list,
        optimizers=lambda: ["the optimizer"],
        mixed_precision=lambda: "no",
        log=lambda values, step: None,
        logging_active=lambda: False,
        clock=clock,
    )
    batches = [(torch.zeros(BATCH, FEATURES),)] * 3
    for _ in timer.batches(batches):
        time.sleep(0.01)
        with timer.around_backward():
            time.sleep(0.01)
        with timer.around_optimizer_step("the optimizer"):
            time.sleep(0.005)
        figures = timer.stats
        assert sum(figures[key] for key in PHASE_KEYS) == pytest.approx(figures["time/step"])
        assert figures["time/forward_backward"] >= 0.02 and figures["time/optimizer"] >= 0.005
    assert len(clock.waited) == 3  # one wait per step, none inside it
