"""Replica groups of one ``lockstep launch --fault-tolerance --replica-group all`` keep one history whatever
order and delay they start in, and a group killed and restarted by its launch heals and trains on with the
others; with the ordinary loop ``for epoch in range(n)``, with and without ``set_epoch``, and with the
Trainer's ``trainer.train()``. No gate: the groups start as a user's would.

Each process logs every step's draw (tests/scripts/ft_user_loop.py, tests/scripts/ft_trainer_loop.py); the
checks: for each committed step, every group that logged it agrees on (epoch, position, participants) and
read its own rank's batch; every sample of every epoch is read once by the committed steps; all groups end
bitwise equal, within 1e-6 of a hand-written replay of the committed steps (SGD on the average of the
participants' batch gradients).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import SCRIPTS, cli_env, lockstep
from tests.scripts import ft_trainer_loop as trainer_loop
from tests.scripts import ft_user_loop as user_loop

pytest.importorskip("torchft")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
GROUPS = 3
EPOCHS = 300
"""Epochs of the runs that kill a group: about 2,400 steps, so that its restart (about 5 s on this machine,
more under load) finds the others still training."""


def _launch(out: Path, script: str, groups: int, *flags: str, **env: str) -> str:
    every = ["--cpu", "--fault-tolerance", "--replica-group", "all", "--num-replica-groups", str(groups)]
    done = lockstep(
        "launch",
        *every,
        *("--max-restarts", "1", "--lighthouse-port", "0", *flags),
        str(SCRIPTS / script),
        timeout=420,
        env=cli_env(FT_OUT=str(out), **env),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def _lines(out: Path) -> list[dict]:
    return [
        json.loads(line) for path in sorted(out.glob("*.jsonl")) for line in path.read_text().splitlines()
    ]


def _one_history(lines: list[dict], *, samples: int, batch: int, step_key: str) -> dict[int, list[dict]]:
    """The committed steps' lines by step, checked to tell one history; each step's draws by rank."""
    steps: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for line in lines:
        if not line.get("committed", True):
            continue
        place = (line["epoch"], line["consumed"], line["participants"])
        drawn = steps[line[step_key]]
        assert all((o["epoch"], o["consumed"], o["participants"]) == place for o in drawn.values()), (
            f"step {line[step_key]}: two histories: {line} and {list(drawn.values())}"
        )
        assert drawn.setdefault(line["rank"], line)["ids"] == line["ids"], line
        assert line["batch"] == line["consumed"] + line["rank"] and line["padded"] == (
            line["batch"] >= samples // batch
        )
    read = collections.Counter(
        (line["epoch"], i)
        for drawn in steps.values()
        for line in drawn.values()
        if not line["padded"]
        for i in line["ids"]
    )
    epochs = {epoch for epoch, _ in read}
    assert epochs == set(range(len(epochs)))
    for epoch in epochs:  # every sample once per epoch
        assert sorted(i for e, i in read.elements() if e == epoch) == list(range(samples)), epoch
    for step, drawn in steps.items():  # every participant of a committed step logged its draw
        assert len(drawn) == next(iter(drawn.values()))["participants"], step
    return {step: [drawn[rank] for rank in sorted(drawn)] for step, drawn in steps.items()}


def _replay(steps: dict[int, list[dict]], build, loss_of, lr: float) -> dict[str, torch.Tensor]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in sorted(steps):
        assert step == 0 or step - 1 in steps, f"no committed step {step - 1} before step {step}"
        grads = []
        for line in steps[step]:
            model.zero_grad()
            loss_of(model, torch.tensor(line["ids"])).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for index, parameter in enumerate(model.parameters()):
            parameter.grad = sum(g[index] for g in grads) / len(grads)
        optimizer.step()
    return model.state_dict()


USER_LOOP_ATOL = 1e-4
"""How far the user loop's weights may end from the replay: its MLP carries rounding on over some 2,400
steps (summing each step's gradients in another order ends 2e-6 away), while a step left out of the last
five moves the weights by about 1.5e-2."""


def _check_weights(out: Path, groups: int, replayed: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    missing = [g for g in range(groups) if not (out / f"g{g}.pt").is_file()]
    assert not missing, f"groups {missing} ended without training to the end"
    weights = [torch.load(out / f"g{g}.pt") for g in range(groups)]
    for key, value in weights[0].items():
        assert all(torch.equal(w[key], value) for w in weights[1:]), key  # all groups bitwise equal
        assert torch.allclose(value, replayed[key], rtol=0, atol=atol), (
            key,
            (value - replayed[key]).abs().max(),
        )


@pytest.mark.parametrize(
    ("delay", "min_replicas", "set_epoch", "kill"),
    [(0, 1, False, 1), (2, 2, True, 2), (5, 1, True, -1)],
    ids=["together-min1-kill1", "2s-apart-min2-set_epoch-kill2", "5s-apart-min1-set_epoch"],
)
def test_groups_started_apart_and_a_group_restarted_keep_one_history(
    tmp_path: Path, delay: int, min_replicas: int, set_epoch: bool, kill: int
) -> None:
    env = {"FT_DELAY": str(delay), "FT_KILL_GROUP": str(kill), "FT_EPOCHS": str(EPOCHS if kill >= 0 else 20)}
    env.update({"FT_SET_EPOCH": "1"} if set_epoch else {})
    stderr = _launch(tmp_path, "ft_user_loop.py", GROUPS, "--min-replicas", str(min_replicas), **env)
    lines = _lines(tmp_path)
    steps = _one_history(lines, samples=user_loop.SAMPLES, batch=user_loop.BATCH, step_key="step")
    epochs = int(env["FT_EPOCHS"])
    assert max(line["epoch"] for line in lines) == epochs - 1  # no group trained past the end
    replayed = _replay(steps, user_loop.build, user_loop.loss_of, lr=0.1)
    _check_weights(tmp_path, GROUPS, replayed, atol=USER_LOOP_ATOL)
    assert steps[0][0]["participants"] == GROUPS  # the first step waited for every group
    if kill >= 0:
        assert "a worker failed; restarting all workers" in stderr
        assert f"replica group {kill} healed from replica group" in stderr
        relaunched = [line for line in lines if line["group"] == kill and line["step"] > 5]
        assert relaunched and relaunched[0]["loop_epoch"] <= relaunched[0]["epoch"]
        assert relaunched[-1]["epoch"] == epochs - 1  # it ended with the others


def _trainer_loss(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return net(trainer_loop.inputs_of(ids)).pow(2).mean()


def test_a_trainer_group_killed_mid_epoch_heals_and_ends_with_the_others(tmp_path: Path) -> None:
    """``trainer.train()`` on 2 groups of one process, ``--min-replicas 2`` (group 0 waits for group 1's
    return), 3 epochs; group 1 SIGKILLed at its 6th batch: its restart heals inside ``train()`` (the Trainer
    registers its state after ``prepare``, where the group joins) and both groups end bitwise equal."""
    stderr = _launch(tmp_path, "ft_trainer_loop.py", 2, "--min-replicas", "2")
    assert "replica group 1 healed from replica group 0" in stderr
    lines = _lines(tmp_path)
    steps = _one_history(
        lines, samples=trainer_loop.SAMPLES, batch=trainer_loop.BATCH, step_key="global_step"
    )
    assert sorted(steps) == list(range(1, len(steps) + 1))  # global_step counts each committed step once
    assert max(line["epoch"] for line in lines) == trainer_loop.EPOCHS - 1
    first_life = next(line["pid"] for line in lines if line["group"] == 1)
    relaunched = [line for line in lines if line["group"] == 1 and line["pid"] != first_life]
    assert relaunched and relaunched[0]["global_step"] > 6  # it took its peer's TrainerState
    replayed = _replay(
        {step - 1: drawn for step, drawn in steps.items()},
        lambda: trainer_loop.Model().net,
        _trainer_loss,
        lr=0.1,
    )
    _check_weights(tmp_path, 2, replayed)
