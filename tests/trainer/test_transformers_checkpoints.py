"""Issue 16 item 6 (and save_only_model, restore_callback_states_from_checkpoint): checkpoints a transformers
user recognises. Each checkpoint-<step> holds transformers' trainer_state.json and a from_pretrained-able
model beside lockstep's exact-resume state; resume_from_checkpoint accepts a folder in transformers.Trainer's
layout (built by hand here, and written by transformers.Trainer itself where accelerate can be imported)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lockstep import Trainer, TrainerCallback, TrainingArguments
from lockstep.checkpoint import load_model_files
from lockstep.errors import UnsafeCheckpointError
from lockstep.trainer import EarlyStoppingCallback
from tests.helpers.reference import accelerate_pythonpath
from tests.helpers.training import flat_params, make_dataset, make_model

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


def _args(tmp_path: Path, **options) -> TrainingArguments:
    settings = {
        "output_dir": str(tmp_path),
        "max_steps": 20,
        "per_device_train_batch_size": 4,
        "optim": "sgd",
        "learning_rate": 0.05,
        "lr_scheduler_type": "linear",
        "train_sampling_strategy": "sequential",
        "logging_steps": 2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "report_to": "none",
        **options,
    }
    return TrainingArguments(**settings)


def _train(trainer: Trainer, **kwargs) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(**kwargs)


def _tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=8,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def _sentences(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (count,), generator=generator)
    ids = torch.randint(4, 32, (count, 8), generator=generator) + labels[:, None] * 30
    return [{"input_ids": row.tolist(), "label": int(label)} for row, label in zip(ids, labels)]


def test_each_checkpoint_holds_transformers_trainer_state_and_a_from_pretrained_model(tmp_path):
    args = _args(
        tmp_path,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        learning_rate=0.01,
    )
    trainer = Trainer(
        _tiny_bert(),
        args,
        train_dataset=_sentences(16),
        eval_dataset=_sentences(8),
        callbacks=[EarlyStoppingCallback(3)],
    )
    _train(trainer)
    folder = tmp_path / "checkpoint-4"
    # transformers' own class reads the file, and every one of its fields is there.
    loaded = transformers.TrainerState.load_from_json(str(folder / "trainer_state.json"))
    saved = json.loads((folder / "trainer_state.json").read_text())
    assert set(saved) == {f.name for f in dataclasses.fields(transformers.TrainerState)}
    assert loaded.global_step == 4 and loaded.max_steps == 4 and loaded.epoch == 1.0
    assert loaded.log_history == trainer.state.log_history[: len(loaded.log_history)]
    assert [e["step"] for e in loaded.log_history if "eval_loss" in e] == [2, 4]
    assert loaded.best_metric == min(e["eval_loss"] for e in loaded.log_history if "eval_loss" in e)
    assert loaded.best_model_checkpoint == str(tmp_path / f"checkpoint-{loaded.best_global_step}")
    assert loaded.stateful_callbacks["EarlyStoppingCallback"]["args"]["early_stopping_patience"] == 3
    assert set(loaded.stateful_callbacks["TrainerControl"]["args"]) == {
        f.name for f in dataclasses.fields(transformers.TrainerControl)
    }
    # The model in save_pretrained layout: from_pretrained gives the weights the checkpoint holds.
    reloaded = transformers.BertForSequenceClassification.from_pretrained(str(folder))
    expected = load_model_files(folder)
    best = transformers.BertForSequenceClassification.from_pretrained(loaded.best_model_checkpoint)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in best.state_dict().items())
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert (folder / "config.json").is_file() and (folder / "manifest.json").is_file()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"trainer_state.json", "config.json"} <= set(manifest["files"])


def _to_transformers_folder(trainer: Trainer, folder: Path) -> None:
    """Write what transformers.Trainer writes into checkpoint-<step>, from a lockstep Trainer's objects."""
    folder.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in trainer.model.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(trainer.lr_scheduler.state_dict(), folder / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, folder / "rng_state.pth")
    state = transformers.TrainerState(
        global_step=trainer.state.global_step,
        max_steps=trainer.state.max_steps,
        epoch=trainer.state.epoch,
        log_history=trainer.state.log_history,
    )
    state.save_to_json(str(folder / "trainer_state.json"))


def test_resume_from_a_transformers_layout_continues_to_the_weights_of_an_uninterrupted_run(tmp_path):
    data = make_dataset(64)
    whole = Trainer(make_model(), _args(tmp_path / "whole"), train_dataset=data, compute_loss_func=mse)
    _train(whole)
    # 6 of 20 steps (16 per epoch: the resumed run crosses into the second epoch).
    first = Trainer(
        make_model(), _args(tmp_path / "first", max_steps=20), train_dataset=data, compute_loss_func=mse
    )
    first.add_callback(_StopAt(6))
    _train(first)
    folder = tmp_path / "hf" / "checkpoint-6"
    _to_transformers_folder(first, folder)
    resumed = Trainer(
        make_model(seed=5), _args(tmp_path / "resumed"), train_dataset=data, compute_loss_func=mse
    )
    _train(resumed, resume_from_checkpoint=str(folder))
    assert resumed.state.global_step == 20
    assert torch.equal(flat_params(resumed.model), flat_params(whole.model))
    assert resumed.state.log_history[0] == first.state.log_history[0]  # the history continues
    losses = [e["loss"] for e in resumed.state.log_history if "loss" in e]
    assert losses == pytest.approx([e["loss"] for e in whole.state.log_history if "loss" in e], rel=1e-5)


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_in_a_transformers_checkpoint_is_refused_unrun(tmp_path):
    data = make_dataset(32)
    first = Trainer(
        make_model(), _args(tmp_path / "a", max_steps=2), train_dataset=data, compute_loss_func=mse
    )
    _train(first)
    folder = tmp_path / "hf" / "checkpoint-2"
    _to_transformers_folder(first, folder)
    with open(folder / "optimizer.pt", "wb") as handle:
        pickle.dump({"state": _Payload()}, handle)
    resumed = Trainer(
        make_model(), _args(tmp_path / "b", max_steps=4), train_dataset=data, compute_loss_func=mse
    )
    with pytest.raises(UnsafeCheckpointError, match="optimizer.pt holds Python objects"):
        _train(resumed, resume_from_checkpoint=str(folder))


def test_a_transformers_checkpoint_without_optimizer_says_it_cannot_resume(tmp_path):
    data = make_dataset(32)
    first = Trainer(
        make_model(), _args(tmp_path / "a", max_steps=2), train_dataset=data, compute_loss_func=mse
    )
    _train(first)
    folder = tmp_path / "hf" / "checkpoint-2"
    _to_transformers_folder(first, folder)
    (folder / "optimizer.pt").unlink()
    resumed = Trainer(
        make_model(), _args(tmp_path / "b", max_steps=4), train_dataset=data, compute_loss_func=mse
    )
    with pytest.raises(FileNotFoundError, match="has no optimizer.pt: .*save_only_model=True cannot resume"):
        _train(resumed, resume_from_checkpoint=str(folder))


def test_save_only_model_writes_weights_and_state_only_and_still_loads_the_best(tmp_path):
    scores = iter([0.5, 0.9, 0.1, 0.2])
    seen: dict[int, torch.Tensor] = {}

    class Snap(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            seen[state.global_step] = flat_params(kwargs["model"]).clone()

    args = _args(
        tmp_path,
        max_steps=8,
        save_only_model=True,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    trainer = Trainer(
        make_model(),
        args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(8, seed=1),
        compute_loss_func=mse,
        compute_metrics=lambda p: {"score": next(scores)},
        callbacks=[Snap()],
    )
    _train(trainer)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == ["checkpoint-4", "checkpoint-8"]  # the best (step 4) survived rotation
    files = {p.name for p in (tmp_path / "checkpoint-4").iterdir()}
    assert {"model.safetensors", "trainer_state.json", "manifest.json"} <= files
    assert not files & {"optimizer.bin", "scheduler.bin", "random_states_0.pkl", "accelerator_state.json"}
    assert torch.equal(flat_params(trainer.model), seen[4])
    again = Trainer(
        make_model(), _args(tmp_path / "x"), train_dataset=make_dataset(64), compute_loss_func=mse
    )
    with pytest.raises(
        ValueError, match=r"was saved with save_only_model=True: it holds the model weights only"
    ):
        _train(again, resume_from_checkpoint=str(tmp_path / "checkpoint-8"))


def test_save_only_model_with_fsdp_and_load_best_is_refused():
    with pytest.raises(ValueError, match=r"save_only_model=True, load_best_model_at_end=True\) with fsdp"):
        TrainingArguments(
            save_only_model=True, load_best_model_at_end=True, eval_strategy="steps", fsdp="full_shard"
        )


def test_restore_callback_states_rebuilds_early_stopping_from_the_checkpoint(tmp_path):
    def run(resume: bool, restore: bool) -> tuple[EarlyStoppingCallback, int]:
        scores = iter([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])  # never better after the first (greater is better)
        stopper = EarlyStoppingCallback(early_stopping_patience=4)
        args = _args(
            tmp_path,
            max_steps=12,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            restore_callback_states_from_checkpoint=restore,
        )
        trainer = Trainer(
            make_model(),
            args,
            train_dataset=make_dataset(64),
            eval_dataset=make_dataset(8, seed=1),
            compute_loss_func=mse,
            compute_metrics=lambda p: {"score": next(scores)},
            callbacks=[stopper] if not resume else [EarlyStoppingCallback(early_stopping_patience=4)],
        )
        if resume:
            for _ in range(2):
                next(scores)
            _train(trainer, resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
        else:
            trainer.add_callback(_StopAt(4))
            _train(trainer)
        stopper = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
        return stopper, trainer.state.global_step

    run(resume=False, restore=False)  # steps 2 and 4: the counter is 1
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 1
    }
    restored, stopped_at = run(resume=True, restore=True)
    assert restored.early_stopping_patience_counter == 4
    assert stopped_at == 10  # counter 1 restored: steps 6, 8, 10 bring it to 4
    _, without = run(resume=True, restore=False)
    assert without == 12  # a fresh counter: steps 6..12 bring it to 4 only at 12


_TRANSFORMERS_RUN = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import transformers
    sys.path.insert(0, {repo!r})
    from tests.helpers.training import make_dataset, make_model

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model()
        def forward(self, x, labels=None):
            out = self.inner(x)
            return {{"loss": nn.functional.mse_loss(out, labels), "logits": out}}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.data = make_dataset(64)
        def __len__(self):
            return 64
        def __getitem__(self, i):
            x, y = self.data[i]
            return {{"x": x, "labels": y}}

    args = transformers.TrainingArguments(
        output_dir={out!r}, max_steps=20, per_device_train_batch_size=4, optim="sgd", learning_rate=0.05,
        lr_scheduler_type="linear", train_sampling_strategy="sequential", logging_steps=2, save_steps=6,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=42,
    )
    trainer = transformers.Trainer(model=Wrapped(), args=args, train_dataset=Rows())
    trainer.train()
    torch.save(torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]), {out!r} + "/final.pt")
    """
)


@pytest.mark.slow
def test_resume_from_a_checkpoint_written_by_transformers_trainer(tmp_path):
    reference = accelerate_pythonpath()  # transformers.Trainer needs accelerate
    out = tmp_path / "hf"
    script = _TRANSFORMERS_RUN.format(repo=str(REPO), out=str(out))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([reference, *sys.path[:1]]),
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(out / "final.pt")

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model(seed=3)

        def forward(self, x, labels=None):
            out = self.inner(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = make_dataset(64)

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            x, y = self.data[i]
            return {"x": x, "labels": y}

    resumed = Trainer(Wrapped(), _args(tmp_path / "ls", seed=42, use_cpu=True), train_dataset=Rows())
    _train(resumed, resume_from_checkpoint=str(out / "checkpoint-6"))
    ours = torch.cat([p.detach().reshape(-1) for p in resumed.model.parameters()])
    print(f"max |lockstep resumed - transformers| = {float((ours - theirs).abs().max()):.3g}")
    assert resumed.state.global_step == 20
    assert torch.allclose(ours, theirs, atol=1e-6)
    hf_log = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert resumed.state.log_history[: len(hf_log)] == hf_log
