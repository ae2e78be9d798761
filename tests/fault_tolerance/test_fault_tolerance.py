"""Live fault tolerance on torchft (``Accelerator(fault_tolerance=...)``): replica groups as separate processes
on loopback around a lighthouse started here, and the errors a bad setup gets before training.

Each replica group runs tests/helpers/ft_worker.py (a seeded ``nn.Linear`` trained with SGD); the reference
is written by hand: each step's gradients of the participating groups, averaged, then an SGD step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lockstep.backends import LiveRecovery
from lockstep.layers.fault_tolerance import FaultToleranceConfig
from tests.helpers import ft_worker
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ft_heal_worker import set_mean_gradients
from tests.helpers.ft_lighthouse import lighthouse_process
from tests.helpers.multiprocess import run_distributed

pytest.importorskip("torchft")
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _lighthouse(min_replicas: int, **timing: int) -> Iterator[str]:
    with lighthouse_process(min_replicas, **timing) as (_, address):
        yield address


def _in_a_forked_child(test: Callable[[], None]) -> Callable[[], None]:
    """Run a test that builds torchft's lighthouse or Manager in this process in a forked child instead.
    torchft's native threads outlive ``shutdown()``/``close()``; the pytest worker would keep them, and a
    later test that forks it (``run_distributed``) deadlocked in the child: the FSDP checkpoint tests that
    followed this file on one worker hung (reproduced: this file, then tests/backends/test_fsdp_checkpoint.py,
    in one process)."""

    @functools.wraps(test)
    def in_child() -> None:
        run_distributed(test, 1, timeout=120)

    return in_child


@contextlib.contextmanager
def _groups(
    groups: int, lighthouse: str, steps: int, folder: Path, pause: float = 0.0
) -> Iterator[list[subprocess.Popen]]:
    """Start one process per replica group; every one is killed on the way out, even on failure."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.helpers.ft_worker"]
    processes: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        try:
            for g in range(groups):
                log = files.enter_context(open(folder / f"group{g}.err", "w"))
                arguments = [
                    str(g),
                    str(groups),
                    lighthouse,
                    str(steps),
                    str(folder / f"group{g}.pt"),
                    str(pause),
                ]
                processes.append(
                    subprocess.Popen(
                        [*command, *arguments], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
                    )
                )
            yield processes
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()


def _finish(processes: list[subprocess.Popen], folder: Path, timeout: float = 90) -> list[dict]:
    deadline = time.monotonic() + scaled(timeout)
    results = []
    for group, process in enumerate(processes):
        if process.returncode == -signal.SIGKILL:
            continue
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert code == 0, (
            f"group {group} exited {code}:\n{(folder / f'group{group}.err').read_text()[-3000:]}"
        )
        results.append(torch.load(folder / f"group{group}.pt"))
    return results


def _replay(
    participants_per_step: list[tuple[int, ...]], steps: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """The weights after SGD on each step's gradients averaged over its participating groups, then clipped
    (``steps``:
    the loop index of each committed step, whose batches those groups read; default 0, 1, ...)."""
    model = ft_worker.model()
    for index, groups in enumerate(participants_per_step):
        step = index if steps is None else steps[index]
        grads = []
        for group in groups:
            model.zero_grad()
            ft_worker.loss_of(model, ft_worker.batch(group, step)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        set_mean_gradients(model, grads)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), ft_worker.MAX_NORM)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= ft_worker.LR * parameter.grad
    return model.state_dict()


def test_two_groups_average_gradients_bitwise(tmp_path: Path) -> None:
    steps = 3
    with _lighthouse(min_replicas=2) as address, _groups(2, address, steps, tmp_path) as processes:
        results = _finish(processes, tmp_path)
    assert results[0]["pid"] != results[1]["pid"]
    for result in results:
        assert result["log"] == [(True, 2)] * steps
    expected = _replay([(0, 1)] * steps)
    alone = _replay([(0,)] * steps)
    for name, value in expected.items():
        assert torch.equal(results[0]["weights"][name], value), name
        assert torch.equal(results[1]["weights"][name], value), name
        assert not torch.equal(alone[name], value)  # the averaging is visible in the weights


def _wait_for_step(progress: Path, step: int, timeout: float = 60) -> None:
    """Until ``progress`` holds ``step``: ``timeout`` seconds on an idle machine, scaled by the load."""
    wait_for(
        lambda: progress.is_file() and str(step) in progress.read_text().split(),
        timeout,
        f"{progress} reaching step {step}",
    )


def test_a_killed_group_leaves_the_others_stepping(tmp_path: Path) -> None:
    """SIGKILL group 2 after a seeded step: groups 0 and 1 keep their processes and finish every step, the
    steps after the loss are averaged over the two of them, and their weights replay the logged quorums."""
    steps, kill_after = 8, random.Random(25).choice([1, 2])
    # Wait for every heartbeating group (no quorum of 2 while the third is still starting); a dead one stops
    # heartbeating and is dropped after 1 s.
    timing = {"heartbeat_timeout_ms": 1000, "join_timeout_ms": 10_000}
    with (
        _lighthouse(min_replicas=2, **timing) as address,
        _groups(3, address, steps, tmp_path, 0.2) as processes,
    ):
        _wait_for_step(tmp_path / "group2.pt.steps", kill_after)
        processes[2].send_signal(signal.SIGKILL)
        assert processes[2].wait(timeout=scaled(10)) == -signal.SIGKILL
        results = _finish(processes, tmp_path)
    assert [r["pid"] for r in results] == [processes[0].pid, processes[1].pid]  # no restart
    log = results[0]["log"]
    assert results[1]["log"] == log and len(log) == steps
    assert log[: kill_after + 1] == [(True, 3)] * (kill_after + 1)
    assert log[-1] == (True, 2)  # the last steps commit without group 2
    assert all(participants in (2, 3) for _, participants in log)
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name  # one step, one quorum, one update
    quorums = [(0, 1, 2) if n == 3 else (0, 1) for committed, n in log if committed]
    committed_steps = [step for step, (committed, _) in enumerate(log) if committed]
    expected = _replay(quorums, committed_steps)
    for name, value in expected.items():
        # three-way sums in gloo's ring order differ from the replay's order by rounding only
        torch.testing.assert_close(results[0]["weights"][name], value, rtol=0, atol=1e-6)


# -- bad input, before training ----------------------------------------------------------------------


def _config(**overrides: object) -> FaultToleranceConfig:
    values: dict = {"replica_group": 0, "num_replica_groups": 2, "lighthouse": "http://127.0.0.1:9"}
    return FaultToleranceConfig(**{**values, **overrides})


def test_torchft_missing_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep import Accelerator

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"torchft, which is not installed: pip install 'lockstep\[ft\]'"):
        Accelerator(cpu=True, fault_tolerance=_config())


@_in_a_forked_child
def test_unreachable_lighthouse_fails_in_bounded_time() -> None:
    from lockstep import Accelerator

    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"could not join the torchft lighthouse at http://127\.0\.0\.1:9 within 1 s"
    ):
        Accelerator(cpu=True, fault_tolerance=_config(timeout=1, hostname="127.0.0.1"))
    assert time.monotonic() - start < 10


@_in_a_forked_child
def test_a_step_commits_in_process_under_warnings_as_errors() -> None:
    """torchft 0.2.0 logs through the deprecated ``Logger.warn`` inside each quorum; with warnings as errors
    (this suite's setting) that must not become a torchft error that silently discards every step."""
    from torchft.coordination import LighthouseServer

    from lockstep import Accelerator

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        config = _config(num_replica_groups=1, lighthouse=server.address(), timeout=5, hostname="127.0.0.1")
        accelerator = Accelerator(cpu=True, fault_tolerance=config)
        try:
            net = torch.nn.Linear(4, 2)
            net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            before = net.weight.detach().clone()
            accelerator.backward(net(torch.ones(2, 4)).sum())
            optimizer.step()
            assert not optimizer.step_was_skipped, accelerator.capability(LiveRecovery).manager.errored()
            assert accelerator.capability(LiveRecovery).committed_steps == 1
            assert not torch.equal(net.weight, before)
        finally:
            accelerator.capability(LiveRecovery).close()
    finally:
        server.shutdown()


@_in_a_forked_child
def test_a_lost_lighthouse_stops_the_group_with_its_address_in_bounded_time() -> None:
    """The lighthouse is killed while a group trains: the next step raises lockstep's error naming the
    lighthouse within the configured timeout (2 s here; under 10 s with start-up), never a hang."""
    from lockstep import Accelerator

    with lighthouse_process(min_replicas=1) as (lighthouse, address):
        config = _config(num_replica_groups=1, lighthouse=address, timeout=2, hostname="127.0.0.1")
        accelerator = Accelerator(cpu=True, fault_tolerance=config)
        try:
            net = torch.nn.Linear(4, 2)
            net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            accelerator.backward(net(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            assert accelerator.capability(LiveRecovery).committed_steps == 1
            lighthouse.kill()
            lighthouse.wait()
            start = time.monotonic()
            with pytest.raises(
                RuntimeError,
                match=rf"Replica group 0 got no quorum from the torchft lighthouse at {re.escape(address)} "
                r"within 2 s .*the lighthouse is down or unreachable",
            ):
                accelerator.backward(net(torch.ones(2, 4)).sum())
            assert time.monotonic() - start < 10
        finally:
            accelerator.capability(LiveRecovery).close()


@_in_a_forked_child
def test_a_step_that_does_not_commit_leaves_weights_schedule_and_samples() -> None:
    """A step torchft does not commit (an error reported in it) is skipped as an fp16 overflow is: the
    weights stay, ``optimizer_step_was_skipped`` is True and the prepared scheduler does not advance; the
    prepared loader deals the step's samples again."""
    from torchft.coordination import LighthouseServer

    from lockstep import Accelerator

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        config = _config(num_replica_groups=1, lighthouse=server.address(), timeout=5, hostname="127.0.0.1")
        accelerator = Accelerator(cpu=True, fault_tolerance=config)
        try:
            net = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            loader = torch.utils.data.DataLoader(torch.arange(8.0).view(4, 2), batch_size=1)
            net, optimizer, scheduler, loader = accelerator.prepare(net, optimizer, scheduler, loader)
            batches = iter(loader)
            before = net.weight.detach().clone()
            first = next(batches)
            accelerator.backward(net(torch.ones(2, 4)).sum())
            accelerator.capability(LiveRecovery).manager.report_error(RuntimeError("injected"))
            optimizer.step()
            scheduler.step()
            assert (
                accelerator.optimizer_step_was_skipped
                and accelerator.capability(LiveRecovery).committed_steps == 0
            )
            assert torch.equal(net.weight, before) and scheduler.get_last_lr() == [0.1]
            optimizer.zero_grad()
            assert torch.equal(next(batches), first)  # not consumed: read again
            accelerator.backward(net(torch.ones(2, 4)).sum())
            optimizer.step()
            scheduler.step()
            assert (
                not accelerator.optimizer_step_was_skipped
                and accelerator.capability(LiveRecovery).committed_steps == 1
            )
            assert scheduler.get_last_lr() == [0.05]
            assert next(batches).tolist() == [[2.0, 3.0]] and loader.state_dict()["global_batches"] == 1
        finally:
            accelerator.capability(LiveRecovery).close()
    finally:
        server.shutdown()


@_in_a_forked_child
def test_an_evaluation_pass_joins_no_quorum_gathers_the_whole_set_and_refuses_training() -> None:
    """With the model in eval mode a prepared loader is read whole inside the group, without the step's
    quorum, and gather_for_metrics returns every sample once; a backward inside that pass is refused by name;
    back in training mode, training continues at the loader's position."""
    from torchft.coordination import LighthouseServer

    from lockstep import Accelerator

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        config = _config(num_replica_groups=1, lighthouse=server.address(), timeout=5, hostname="127.0.0.1")
        accelerator = Accelerator(cpu=True, fault_tolerance=config)
        layer = accelerator.capability(LiveRecovery)
        try:
            net = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            samples = torch.arange(10.0).view(5, 2)
            train = torch.utils.data.DataLoader(samples[:4], batch_size=1)
            evaluation = torch.utils.data.DataLoader(samples, batch_size=2)
            net, optimizer, train, evaluation = accelerator.prepare(net, optimizer, train, evaluation)
            batches = iter(train)
            accelerator.backward(net(next(batches)).sum())
            optimizer.step()
            optimizer.zero_grad()
            step = layer.manager.current_step()
            net.eval()
            with torch.no_grad():
                outputs = torch.cat([accelerator.gather_for_metrics(net(batch)) for batch in evaluation])
                assert torch.equal(outputs, net(samples))
            assert layer.manager.current_step() == step and not layer._quorum_started
            with pytest.raises(RuntimeError, match="read as an evaluation pass.*Call model.train"):
                for batch in evaluation:
                    accelerator.backward(net(batch).sum())
            net.train()
            assert next(batches).tolist() == [[2.0, 3.0]]
            accelerator.backward(net(torch.ones(1, 2)).sum())
            optimizer.step()
            assert layer.committed_steps == 2
        finally:
            layer.close()
    finally:
        server.shutdown()


@_in_a_forked_child
def test_the_trainers_evaluation_is_an_evaluation_pass_over_the_whole_set() -> None:
    """The Trainer under fault tolerance evaluates in eval mode: every evaluation sample is predicted once,
    no quorum is joined for it, and training continues afterwards (evaluation every 2 of 4 steps)."""
    import tempfile

    from torchft.coordination import LighthouseServer

    from lockstep import Trainer, TrainingArguments
    from tests.helpers.training import make_dataset, make_model

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    section = {
        "replica_group": 0,
        "num_replica_groups": 1,
        "lighthouse": server.address(),
        "quorum_timeout": 5,
    }
    seen: list[int] = []

    def predicted(prediction: object) -> dict[str, float]:
        seen.append(len(prediction.predictions))  # type: ignore[attr-defined]
        return {"count": float(len(prediction.predictions))}  # type: ignore[attr-defined]

    try:
        with tempfile.TemporaryDirectory() as folder:
            args = TrainingArguments(
                output_dir=folder,
                per_device_train_batch_size=4,
                per_device_eval_batch_size=4,
                max_steps=4,
                eval_strategy="steps",
                eval_steps=2,
                save_strategy="no",
                disable_tqdm=True,
                report_to="none",
                fault_tolerance=section,
            )
            trainer = Trainer(
                make_model(seed=0),
                args,
                train_dataset=make_dataset(64),
                eval_dataset=make_dataset(11, seed=1),
                compute_loss_func=lambda outputs, labels, **_: torch.nn.functional.mse_loss(outputs, labels),
                compute_metrics=predicted,
            )
            trainer.train()
            layer = trainer.accelerator.capability(LiveRecovery)
            step = layer.manager.current_step()
            metrics = trainer.evaluate()
            assert layer.manager.current_step() == step and not layer._quorum_started
            assert seen == [11, 11, 11] and metrics["eval_count"] == 11.0
            assert layer.committed_steps == 4
            layer.close()
    finally:
        server.shutdown()


def test_min_replicas_above_the_groups() -> None:
    with pytest.raises(
        ValueError, match=r"min_replicas=3, num_replica_groups=2\) is invalid.*Pass min_replicas <= 2"
    ):
        _config(min_replicas=3)
    with pytest.raises(ValueError, match=r"replica_group=2, num_replica_groups=2\) is invalid"):
        _config(replica_group=2)


def test_no_lighthouse_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="found no lighthouse: TORCHFT_LIGHTHOUSE is not set"):
        _config(lighthouse=None).lighthouse_address()


def test_unsupported_layouts_are_refused() -> None:
    from lockstep import Accelerator, ParallelismConfig
    from lockstep.layers.fault_tolerance.layer import fault_tolerance_hooks

    # DeepSpeed's engine needs its package and a GPU to build: the layer's refusal, asked of a stand-in run.
    deepspeed_run = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugins={"default": object()}), parallelism_config=None
    )
    with pytest.raises(ValueError, match=r"fault_tolerance=\.\.\.\) with DeepSpeed .* is not supported yet"):
        fault_tolerance_hooks(_config(), deepspeed_run)
    with pytest.raises(ValueError, match=r"with a ParallelismConfig \(pipeline.* is not supported yet"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(), fault_tolerance=_config())
    with pytest.raises(
        TypeError,
        match=r"Accelerator\(fault_tolerance=\{\}\) takes a FaultToleranceConfig \(the fault_tolerance",
    ):
        Accelerator(cpu=True, fault_tolerance={})
    with pytest.raises(
        TypeError, match=r"is a FaultToleranceConfig, .* pass it as Accelerator\(fault_tolerance=\.\.\.\)"
    ):
        Accelerator(cpu=True, kwargs_handlers=[_config()])
