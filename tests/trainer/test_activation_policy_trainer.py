"""The Trainer's ``activation_checkpointing_policy`` (lockstep's field): a tiny BERT, one process, trains to
the same weights as without checkpointing, with its layers wrapped by the policy."""

from __future__ import annotations

import pytest
import torch

from lockstep import Trainer, TrainingArguments
from tests.helpers.multiprocess import reset_lockstep_state

transformers = pytest.importorskip("transformers")


def _tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=8,
        num_labels=2,
    )  # dropout 0.1: recomputation must replay the same masks
    return transformers.BertForSequenceClassification(config)


def _train(tmp_path, **options) -> tuple[dict, list[str]]:
    reset_lockstep_state()
    generator = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": torch.randint(0, 64, (8,), generator=generator).tolist(), "label": i % 2}
        for i in range(16)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        **options,
    )
    trainer = Trainer(_tiny_bert(), args, train_dataset=data)
    trainer.train()
    wrappers = [type(m).__name__ for m in trainer.model.modules() if type(m).__name__.endswith("Wrapper")]
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}, wrappers


def test_a_policy_wraps_the_layers_and_changes_no_weight(tmp_path):
    plain, none = _train(tmp_path / "plain")
    selective, wrapped = _train(tmp_path / "op", activation_checkpointing_policy="op")
    assert none == [] and wrapped == ["CheckpointWrapper"] * 2  # the two BertLayers
    assert selective.keys() == plain.keys()  # the wrappers leave the state dict's names alone
    for name, value in plain.items():
        assert torch.equal(selective[name], value), name


def test_the_policy_and_the_switch_must_agree():
    with pytest.raises(
        ValueError, match=r"activation_checkpointing_policy='op'\) contradicts activation_checkpointing"
    ):
        TrainingArguments(output_dir="x", activation_checkpointing_policy="op", gradient_checkpointing=False)
    with pytest.raises(
        ValueError, match=r"TrainingArguments\(activation_checkpointing_policy\)='every_x' is not"
    ):
        TrainingArguments(output_dir="x", activation_checkpointing_policy="every_x")
    args = TrainingArguments(output_dir="x", activation_checkpointing_policy="every_2")
    assert args.gradient_checkpointing is args.activation_checkpointing is True
