"""A pipelined model built on the meta device: each rank materialises and fills its own stages only.

Real gloo groups, 2 processes, ``pp_size=2`` (1F1B, 2 micro-batches), the 4-block ``TinyTransformer``. The
weights come from a safetensors file written by one process; the run is compared with one process training
from the same file with AdamW (tolerance 1e-5, as the other pipeline tests).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lockstep import Accelerator, ParallelismConfig, init_empty_weights
from lockstep.config.pipeline import TorchPipelineParallelConfig
from lockstep.utils import _loading, load_checkpoint_in_model
from tests.helpers.fsdp_models import (
    FEATURES,
    WIDTH,
    TinyTransformer,
    data_loader,
    make_data,
    make_transformer,
)
from tests.helpers.multiprocess import run_distributed

LENGTH, BATCH, DEPTH, TOLERANCE = 32, 8, 4, 1e-5
_SAFE_OPEN = _loading.safe_open


class _ShiftedTransformer(TinyTransformer):
    """With a real, non-scalar, non-persistent buffer (as rotary frequencies): ``init_empty_weights`` keeps
    it real while the parameters are meta, and the tracer must not meet the two devices together."""

    def __init__(self) -> None:
        super().__init__(depth=DEPTH)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, WIDTH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.shift
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.scale


def _accelerator(**sizes: int) -> Accelerator:
    handler = TorchPipelineParallelConfig(
        schedule="1f1b",
        num_microbatches=2,
        example_args=(torch.zeros(BATCH, FEATURES),),
        loss_fn=nn.functional.mse_loss,
    )
    layout = ParallelismConfig(**{"pp_size": 2, **sizes}, pp_handler=handler)
    return Accelerator(parallelism_config=layout)


class _RecordingSafeOpen:
    """``safetensors.safe_open``, noting the name of every tensor read from disk."""

    read: list[str] = []

    def __init__(self, *args, **kwargs) -> None:
        self._handle = _SAFE_OPEN(*args, **kwargs)

    def __enter__(self) -> _RecordingSafeOpen:
        self._open = self._handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._open.keys())

    def metadata(self):
        return self._open.metadata()

    def get_tensor(self, key: str) -> torch.Tensor:
        self.read.append(key)
        return self._open.get_tensor(key)


def _train_from_file(path: str, optimizer_before_prepare: bool, checkpoint: str) -> dict:
    accelerator = _accelerator()
    with init_empty_weights():
        meta_model = _ShiftedTransformer()
    loader = data_loader(LENGTH, BATCH)
    if optimizer_before_prepare:  # built on the meta parameters: re-bound to the materialised ones
        optimizer = torch.optim.AdamW(meta_model.parameters(), lr=1e-2)
        model, optimizer, loader = accelerator.prepare(meta_model, optimizer, loader)
    else:
        model, loader = accelerator.prepare(meta_model, loader)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    pending = model.uninitialised_weights
    real = sum(p.numel() for p in model.parameters() if not p.is_meta)
    _RecordingSafeOpen.read = []
    with mock.patch.object(_loading, "safe_open", _RecordingSafeOpen):
        load_checkpoint_in_model(model, path, strict=True)
    losses = []
    for x, y in loader:
        loss = accelerator.pipeline_step(model, x, target=y)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    accelerator.save_state(checkpoint)
    return {
        "pending": pending,
        "after_load": model.uninitialised_weights,
        "read": sorted(_RecordingSafeOpen.read),
        "local_keys": sorted(model.state_dict()),
        "real_numel": real,
        "meta_model_untouched": all(p.is_meta for p in meta_model.parameters()),
        "optimizer_numel": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "losses": losses,
        "full": accelerator.get_state_dict(model),
    }


def _reference(
    path: Path, extra_batch: bool = False, batch: int = BATCH
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process from the weights file; with ``extra_batch``, the loss of the first batch once more."""
    model = _ShiftedTransformer()
    load_checkpoint_in_model(model, path, strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    batches = list(data_loader(LENGTH, batch))
    for x, y in batches + batches[:1] if extra_batch else batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def _weights_file(folder: Path) -> Path:
    path = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in make_transformer(depth=DEPTH).state_dict().items()}, path)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer_before_prepare", [True, False])
def test_meta_model_filled_per_stage_from_safetensors_matches_one_process(tmp_path, optimizer_before_prepare):
    path = _weights_file(tmp_path)
    checkpoint = str(tmp_path / "checkpoint")
    results = run_distributed(
        _train_from_file, 2, str(path), optimizer_before_prepare, checkpoint, timeout=120
    )
    expected, losses = _reference(path)
    total = sum(v.numel() for v in expected.values())
    for result in results:
        # every tensor of the stage was materialised empty, then filled; only its own tensors were read
        assert sorted(result["pending"]) == result["local_keys"] and result["after_load"] == []
        assert result["read"] == result["local_keys"]
        # no rank held the whole model: the meta model stayed on meta, each rank gave memory to about half
        assert result["meta_model_untouched"]
        assert 0.35 * total < result["real_numel"] < 0.65 * total
        assert result["optimizer_numel"] == result["real_numel"]
    assert not set(results[0]["local_keys"]) & set(results[1]["local_keys"])
    assert sum(r["real_numel"] for r in results) == total
    assert all(loss is None for loss in results[0]["losses"])
    assert results[1]["losses"] == pytest.approx(losses, abs=TOLERANCE)
    full = results[0]["full"]
    assert list(full) == list(expected)
    diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    print(f"meta model, optimizer before prepare={optimizer_before_prepare}: max parameter diff {diff:.2e}")
    assert diff <= TOLERANCE
    if optimizer_before_prepare:  # the checkpoint of the run fills another meta model, and training goes on
        resumed = run_distributed(_resume, 2, checkpoint, timeout=120)
        assert [r["pending"] for r in resumed] == [[], []]
        assert all(torch.equal(resumed[0]["full"][k], full[k]) for k in full)
        assert resumed[1]["loss"] == pytest.approx(_reference(path, extra_batch=True)[1][-1], abs=TOLERANCE)


def _resume(checkpoint: str) -> dict:
    accelerator = _accelerator()
    with init_empty_weights():
        model = _ShiftedTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(checkpoint)
    full = accelerator.get_state_dict(model)
    x, y = next(iter(data_loader(LENGTH, BATCH)))
    loss = accelerator.pipeline_step(model, x, target=y)
    return {
        "pending": model.uninitialised_weights,
        "full": full,
        "loss": None if loss is None else float(loss),
    }


def _refusals(path: str) -> dict:
    accelerator = _accelerator()
    with torch.device("meta"):  # buffers too: the non-persistent `scale` is in no weights file
        model = TinyTransformer(depth=DEPTH)
    model = accelerator.prepare(model)
    x, y = make_data(BATCH)[:BATCH]
    messages = []
    for attempt in ("step", "evaluate", "step after load"):
        if attempt == "step after load":
            load_checkpoint_in_model(model, path, strict=True)
        try:
            if attempt == "evaluate":
                with torch.no_grad():
                    model(x)
            else:
                accelerator.pipeline_step(model, x, target=y)
        except RuntimeError as error:
            messages.append(str(error))

    def fill_scale(module: nn.Module) -> None:
        if "scale" in module._buffers:
            module.scale.fill_(0.5)

    model.init_weights(fill_scale)
    loss = accelerator.pipeline_step(model, x, target=y)
    return {"messages": messages, "loss": None if loss is None else float(loss), **_misuse(accelerator, path)}


def _misuse(accelerator: Accelerator, path: str) -> dict[str, str]:
    """The messages of loading a wrong file, of a device map, and of init_weights on real weights."""
    with init_empty_weights():
        model = accelerator.prepare(TinyTransformer(depth=DEPTH))
    errors = {}
    calls = {
        "wrong_file": lambda: load_checkpoint_in_model(model, path.replace("model.", "wrong."), strict=True),
        "device_map": lambda: load_checkpoint_in_model(model, path, device_map={"": "cpu"}),
        "real_init": lambda: accelerator.prepare(make_transformer(depth=DEPTH)).init_weights(),
    }
    for name, call in calls.items():
        try:
            call()
        except (ValueError, RuntimeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


@pytest.mark.distributed
def test_meta_tensors_left_empty_refuse_every_step_on_every_rank(tmp_path):
    path = _weights_file(tmp_path)
    wrong = dict(make_transformer(depth=DEPTH).state_dict())
    wrong["extra.weight"] = wrong.pop("head.weight")
    save_file(wrong, tmp_path / "wrong.safetensors")
    results = run_distributed(_refusals, 2, str(path), timeout=120)
    for result in results:  # the same error on both ranks (a collective check), so neither waits on the other
        step, evaluate, after_load = result["messages"]
        assert step.startswith("pipeline_step(): the model was built on the meta device")
        assert "rank 0: embed.weight, embed.bias, layers.0.norm.weight" in step and "rank 1: " in step
        assert (
            "load_checkpoint_in_model(model, 'model.safetensors')" in step and "model.init_weights()" in step
        )
        assert evaluate.startswith("Evaluation (model(inputs)): the model was built on the meta device")
        # the weights file filled every saved tensor; the non-persistent buffer of the last stage is left
        assert "(rank 1: scale)" in after_load and "rank 0" not in after_load
    for rank, result in enumerate(results):  # each rank checks the keys of its own stages
        missing = "['head.weight']" if rank == 1 else "[]"
        assert f"Missing from the checkpoint ({int(rank == 1)}): {missing}" in result["wrong_file"]
        assert "Unknown to the model (1): ['extra.weight']" in result["wrong_file"]
        assert result["wrong_file"].startswith("ValueError: load_checkpoint_in_model(")
        assert "got device_map={'': 'cpu'}" in result["device_map"] and "Pass neither" in result["device_map"]
        assert result["real_init"].startswith("RuntimeError: init_weights() initialises a pipelined model")
    model = make_transformer(depth=DEPTH)
    x, y = make_data(BATCH)[:BATCH]
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(model(x), y))
    assert results[0]["loss"] is None and results[1]["loss"] == pytest.approx(expected, abs=TOLERANCE)


def _initialised(seed: int) -> dict:
    accelerator = _accelerator()
    with init_empty_weights():
        model = TinyTransformer(depth=DEPTH)
    model = accelerator.prepare(model)
    before = torch.get_rng_state()
    model.init_weights(seed=seed)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights(seed=seed)
    x, y = make_data(BATCH)[:BATCH]
    loss = accelerator.pipeline_step(model, x, target=y)
    return {
        "weights": first,
        "repeatable": all(torch.equal(first[k], v) for k, v in model.state_dict().items()),
        "rng_kept": torch.equal(before, torch.get_rng_state()),
        "stages": model.stage_indices,
        "loss": None if loss is None else float(loss),
    }


def _expected_init(seed: int) -> dict[str, torch.Tensor]:
    """What ``init_weights(seed=seed)`` gives: each stage's modules reset under ``seed + stage index``."""
    model = TinyTransformer(depth=DEPTH)  # the cut "auto" makes: embed + 2 blocks | 2 blocks + head
    stages = [
        [model.embed, model.layers[0], model.layers[1]],
        [model.layers[2], model.layers[3], model.head],
    ]
    for index, blocks in enumerate(stages):
        torch.manual_seed(seed + index)
        for module in (m for block in blocks for m in block.modules()):
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model.state_dict()


@pytest.mark.distributed
def test_init_weights_runs_reset_parameters_per_stage_with_a_seed_per_stage():
    results = run_distributed(_initialised, 2, 7, timeout=120)
    expected = _expected_init(7)
    for index, result in enumerate(results):
        assert result["stages"] == [index] and result["repeatable"] and result["rng_kept"]
        for key, value in result["weights"].items():
            assert torch.equal(value, expected[key]), key
    assert results[0]["loss"] is None and results[1]["loss"] > 0


def _train_sharded(path: str) -> dict:
    accelerator = _accelerator(dp_shard_size=2)
    with init_empty_weights():
        model = _ShiftedTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data_loader(LENGTH, BATCH))
    model.init_weights(seed=7)  # each module initialises its whole tensors; each rank keeps its shard
    initialised = accelerator.get_state_dict(model)
    load_checkpoint_in_model(model, path, strict=True)
    losses = []
    for x, y in loader:
        loss = accelerator.pipeline_step(model, x, target=y)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    local = sum(p.to_local().numel() for p in model.parameters())
    full = accelerator.get_state_dict(model)
    return {"losses": losses, "full": full, "local_numel": local, "initialised": initialised}


@pytest.mark.distributed
@pytest.mark.slow
def test_meta_model_by_fully_sharded_data_parallel_on_four_processes_matches_one_process(tmp_path):
    # pp=2 x dp_shard=2: each stage materialised on its two ranks, sharded, then filled shard by shard
    path = _weights_file(tmp_path)
    results = run_distributed(_train_sharded, 4, str(path), timeout=240)
    initialised, expected_init = results[0]["initialised"], _expected_init(7)
    assert all(torch.equal(initialised[k], expected_init[k]) for k in expected_init)  # as without dp_shard
    expected, losses = _reference(path, batch=2 * BATCH)
    total = sum(v.numel() for v in expected.values())
    assert all(0.15 * total < r["local_numel"] < 0.35 * total for r in results)
    reported = [(a + b) / 2 for a, b in zip(results[2]["losses"], results[3]["losses"], strict=True)]
    assert reported == pytest.approx(losses, abs=TOLERANCE)
    full = results[0]["full"]
    diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    print(f"meta model, pp x dp_shard: max parameter diff {diff:.2e}")
    assert diff <= TOLERANCE
