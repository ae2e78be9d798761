"""The record a checkpoint without its frozen base carries, and the refusals of ``load_state`` it drives
(:mod:`lockstep.checkpoint.frozen_base`), on plain modules: which modules leave their base out (peft models only)
is covered with peft in ``tests/backends/test_lora.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lockstep.checkpoint import frozen_base


def _model(hidden: int = 4, dtype: torch.dtype = torch.float32, extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, hidden, dtype=dtype), nn.Linear(hidden, 2)]
    if extra:
        layers.append(nn.LayerNorm(2))
    model = nn.Sequential(*layers)
    for module in (model[0], *(model[2:] if extra else [])):
        module.requires_grad_(False)
    return model


def _saved(folder: Path, model: nn.Module) -> Path:
    entry = {"saved": frozen_base.kept_keys(model), "frozen": frozen_base.fingerprint(model)}
    (folder / frozen_base.RECORD_FILE).write_text(json.dumps(frozen_base.record_json({0: entry})))
    return folder


def test_the_record_holds_the_trainable_keys_and_the_base_fingerprint(tmp_path):
    model = _model()
    folder = _saved(tmp_path, model)
    record = frozen_base.read_record(folder)
    assert record[0]["saved"] == ["1.bias", "1.weight"] and frozen_base.saved_without_frozen(folder, 0)
    weight = model[0].weight.detach().double()
    sums = [float(weight.abs().sum()), float((weight**2).sum())]
    saved = record[0]["frozen"]["0.weight"]
    assert saved[:2] == [[4, 4], "float32"] and saved[2:] == pytest.approx(sums, rel=1e-12)
    assert not frozen_base.saved_without_frozen(folder, 1)
    frozen_base.check(folder, [(0, _model())])  # the same base: accepted


def test_another_base_is_refused_naming_the_first_difference(tmp_path):
    folder = _saved(tmp_path, _model())
    start = (
        f"load_state({str(folder)!r}): model 0 was saved without its frozen base, and the base of the model "
    )
    with pytest.raises(
        ValueError, match=r"0\.bias was float32 \[4\], is float64 \[4\]\. The checkpoint holds only"
    ) as error:
        frozen_base.check(folder, [(0, _model(dtype=torch.float64))])
    assert str(error.value).startswith(start)
    with pytest.raises(ValueError, match=r"0\.bias was float32 \[4\], is float32 \[3\]"):
        frozen_base.check(folder, [(0, _model(hidden=3))])
    moved = _model()
    with torch.no_grad():
        moved[0].weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match=r"the sum of the absolute values of 0\.weight was "):
        frozen_base.check(folder, [(0, moved)])


def test_other_trainable_keys_are_refused_before_the_base_is_compared(tmp_path):
    folder = _saved(tmp_path, _model())
    message = (
        r"model 0 was saved without its frozen base \(frozen_base\.json: 2 keys, the adapter\), but those are not "
        r"the trainable keys of the model prepared now \(4\)\. Trainable here, not in the checkpoint \(2\): "
        r"\['2\.bias', '2\.weight'\]"
    )
    grown = _model(extra=True)
    grown[2].requires_grad_(True)
    with pytest.raises(ValueError, match=message):
        frozen_base.check(folder, [(0, grown)])
    with pytest.raises(ValueError, match=r"4 frozen parameters saved, 2 here"):
        frozen_base.check(_saved(tmp_path, _model(extra=True)), [(0, _model())])
