"""``lockstep.Trainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(ep_size=2))`` on 2 gloo
processes equals the same Trainer on 1 process on the same global batch: a user's ordinary Trainer script (the
tiny Qwen3-MoE of :mod:`tests.expert_parallel.test_parity`, router aux loss on, AdamW, accumulation 2, clipping
1.0). Losses, gradient norms and parameters within 1e-5; its checkpoints (``save_strategy="steps"``) resume
exactly on ep=2 (the dict form of the argument), and ``save_model`` writes the one-process model.

The Trainer multiplies each rank's loss by the number of replicas (``num_items_in_batch`` summed over the
processes); without the layer's :class:`~lockstep.backends.GlobalLossTerm` the global aux loss
counted twice (measured: losses 0.40 and parameters 4.0e-3 away from one process).
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest
import torch

from tests.expert_parallel.test_parity import GLOBAL_BATCH, _build, _micro_batch
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
TOLERANCE = 1e-5
STEPS = 5
ACCUMULATION = 2
SAVE_STEPS = 2


def _dataset() -> list[dict[str, list[int]]]:
    """``STEPS * ACCUMULATION`` global batches of the parity test, one example per sequence."""
    rows = torch.cat([_micro_batch(i) for i in range(STEPS * ACCUMULATION)])
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in rows]


def _train(output_dir: str, parallelism_config: Any, resume: str | None = None) -> dict[str, Any]:
    """The user's script: build, train (resuming from ``resume`` if given), ``save_model``; what it logged."""
    from lockstep import Trainer, TrainingArguments

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=parallelism_config,
        per_device_train_batch_size=GLOBAL_BATCH // processes,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=1e-3,
        adam_epsilon=1e-6,  # see test_parity.ADAM_EPS
        max_grad_norm=1.0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="steps" if processes > 1 else "no",
        save_steps=SAVE_STEPS,
        report_to="none",
    )
    model = _build("qwen3_moe")
    if resume is not None:  # a resume that did not load the checkpoint cannot pass
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)
    trainer = Trainer(model, args, train_dataset=_dataset())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(output_dir, "final"))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "state": {name: t.detach().clone() for name, t in unwrapped.state_dict().items()},
        "first": {n: m.first_expert for n, m in unwrapped.named_modules() if hasattr(m, "first_expert")},
        "ep_size": trainer.accelerator.parallelism_config.ep_size if processes > 1 else 1,
        "global_step": trainer.state.global_step,
    }


def _shard(full: torch.Tensor, name: str, rank: dict[str, Any]) -> torch.Tensor:
    """The rows of the one-process tensor ``name`` that ``rank`` holds (all of it for a dense one)."""
    if ".experts." not in name:
        return full
    first = rank["first"][name.rsplit(".experts.", 1)[0] + ".experts"]
    return full[first : first + rank["state"][name].shape[0]]


def _worst(reference: dict[str, torch.Tensor], rank: dict[str, Any]) -> float:
    assert rank["state"].keys() == reference.keys()
    return max((rank["state"][n] - _shard(t, n, rank)).abs().max().item() for n, t in reference.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 1-process Trainer and the ep=2 Trainer (``ParallelismConfig`` object, checkpoints every 2 steps)."""
    from lockstep import ParallelismConfig

    folder = tmp_path_factory.mktemp("trainer")
    (one,) = run_distributed(_train, 1, str(folder / "one"), None, timeout=300, env=QUIET)
    config = ParallelismConfig(ep_size=2)
    ranks = run_distributed(_train, 2, str(folder / "ep"), config, timeout=300, env=QUIET)
    return {"one": one, "ranks": ranks, "folder": folder}


def test_the_trainer_with_ep2_equals_one_process(runs: dict[str, Any]) -> None:
    one, ranks = runs["one"], runs["ranks"]
    assert len(one["losses"]) == len(one["grad_norms"]) == STEPS
    assert max(one["grad_norms"]) > 1.0  # the clip acts
    assert one["losses"][-1] < one["losses"][0] - 0.1  # it trained
    for rank in ranks:
        assert rank["ep_size"] == 2 and rank["first"]["model.layers.0.mlp.experts"] in (0, 4)
        assert rank["losses"] == pytest.approx(one["losses"], abs=TOLERANCE)
        assert rank["grad_norms"] == pytest.approx(one["grad_norms"], abs=TOLERANCE)
        worst = _worst(one["state"], rank)
        loss = max(abs(a - b) for a, b in zip(rank["losses"], one["losses"], strict=True))
        norm = max(abs(a - b) for a, b in zip(rank["grad_norms"], one["grad_norms"], strict=True))
        print(f"Trainer ep=2 vs 1 process: losses {loss:.3g}, grad norms {norm:.3g}, parameters {worst:.3g}")
        assert worst < TOLERANCE


def test_save_model_writes_the_one_process_model(runs: dict[str, Any]) -> None:
    from transformers import Qwen3MoeForCausalLM

    final = Qwen3MoeForCausalLM.from_pretrained(str(runs["folder"] / "ep" / "final")).state_dict()
    one = runs["one"]["state"]
    assert {n: t.shape for n, t in final.items()} == {n: t.shape for n, t in one.items()}
    worst = max((final[n] - t).abs().max().item() for n, t in one.items())
    assert worst < TOLERANCE


def test_a_checkpoint_of_ep2_resumes_exactly_on_ep2(runs: dict[str, Any]) -> None:
    ep = runs["folder"] / "ep"
    assert sorted(p for p in os.listdir(ep) if p.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    resume = str(ep / f"checkpoint-{SAVE_STEPS}")
    from safetensors.torch import load_file

    saved = load_file(os.path.join(resume, "model.safetensors"))  # the one-process layout: all 8 experts
    assert saved["model.layers.0.mlp.experts.down_proj"].shape[0] == 8
    output = str(runs["folder"] / "resumed")
    resumed = run_distributed(_train, 2, output, {"ep_size": 2}, resume, timeout=300, env=QUIET)
    for before, after in zip(runs["ranks"], resumed, strict=True):
        assert after["ep_size"] == 2 and after["first"] == before["first"]
        assert after["global_step"] == STEPS
        # the history of steps 1-2 comes from the checkpoint; steps 3-5, trained from its weights (not the
        # shifted ones this run was built with), are logged bitwise as the uninterrupted run logged them
        assert len(after["losses"]) == STEPS and after["losses"] == before["losses"]
        assert all(torch.equal(after["state"][n], t) for n, t in before["state"].items())


def test_the_trainer_with_ep2_on_four_processes_equals_one_process(runs: dict[str, Any]) -> None:
    """ep=2 on 4 processes: 2 replicas of each expert shard; the Trainer multiplies each rank's loss by 4 (the
    processes), and the global aux loss (over all 4 ranks' tokens) still counts once."""
    from lockstep import ParallelismConfig

    folder = runs["folder"] / "ep2x2"
    ranks = run_distributed(_train, 4, str(folder), ParallelismConfig(ep_size=2), timeout=300, env=QUIET)
    one = runs["one"]
    assert [r["first"]["model.layers.0.mlp.experts"] for r in ranks] == [0, 4, 0, 4]
    loss = max(abs(a - b) for r in ranks for a, b in zip(r["losses"], one["losses"], strict=True))
    norm = max(abs(a - b) for r in ranks for a, b in zip(r["grad_norms"], one["grad_norms"], strict=True))
    worst = max(_worst(one["state"], rank) for rank in ranks)
    print(
        f"Trainer ep=2 x 2 replicas vs 1 process: losses {loss:.3g}, grad norms {norm:.3g}, parameters {worst:.3g}"
    )
    assert len(ranks[0]["losses"]) == STEPS
    assert loss < TOLERANCE and norm < TOLERANCE and worst < TOLERANCE
    from transformers import Qwen3MoeForCausalLM

    final = Qwen3MoeForCausalLM.from_pretrained(str(folder / "final")).state_dict()
    assert max((final[n] - t).abs().max().item() for n, t in one["state"].items()) < TOLERANCE


def test_the_json_form_of_the_argument_turns_expert_parallelism_on() -> None:
    from lockstep import ParallelismConfig, TrainingArguments

    args = TrainingArguments(output_dir="unused", parallelism_config='{"ep_size": 2}')
    assert isinstance(args.parallelism_config, ParallelismConfig)
    assert args.parallelism_config.ep_size == 2


def test_a_bad_parallelism_config_or_loss_factor_is_refused_by_name() -> None:
    from lockstep import TrainingArguments
    from lockstep.layers.expert_parallel import LossMultiplier

    with pytest.raises(ValueError, match=r"parallelism_config=\{'ep': 2\}\) is invalid: .*, ep_size\)"):
        TrainingArguments(output_dir="unused", parallelism_config={"ep": 2})
    with pytest.raises(
        ValueError, match=r"LossMultiplier.multiplied_by\(0\) is invalid: the factor must be > 0"
    ):
        with LossMultiplier().multiplied_by(0):
            pass
