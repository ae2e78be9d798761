"""LoRA adapters (peft) through the Accelerator: one process, DDP and FSDP2 train alike with only the adapters
trainable, adapters save as peft saves them (gathered from every process) and resume exactly from checkpoints
that leave the frozen base out, bad uses fail; lockstep.Trainer with a peft model matches transformers.Trainer.

peft imports the accelerate package, which lockstep's environment does not hold: the workers take both from
the reference environment (``tests/helpers/reference.py``: skipped without it, failed under CI).

Two groups of workers run everything, once per module: two processes that train under DDP and then under FSDP2
in the same process group (then each loads the other's adapter-only checkpoint and saves it asynchronously),
then one process (which also loads FSDP2's); the tests read what they found. Each saved adapter folder is
read back by ``PeftModel.from_pretrained`` onto a freshly built base model. The one-process worker also runs
lockstep.Trainer on ``tests/reference/_peft_trainer_run.py``, which transformers.Trainer runs in the reference
environment.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import lora
from tests.helpers.multiprocess import reset_lockstep_state, run_distributed
from tests.helpers.optional import requires
from tests.helpers.reference import peft_pythonpath, run_reference

pytestmark = [requires("transformers"), pytest.mark.distributed]

ADAPTER_FOLDERS = ("save_model", "pretrained")
ADAPTER_TENSORS = 8  # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
# 2 processes vs one on the same global batch, AdamW (measured: see the commit message)
TOLERANCE = {"ddp": 1e-6, "fsdp": 1e-6}


def _accelerator(kind: str) -> Any:
    from lockstep import Accelerator, FullyShardedDataParallelPlugin

    plugin = {"fsdp_plugin": FullyShardedDataParallelPlugin()} if kind == "fsdp" else {}
    return Accelerator(gradient_accumulation_steps=lora.ACCUMULATION, **plugin)


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)


def _train(kind: str, out: str) -> dict[str, Any]:
    accelerator = _accelerator(kind)
    model = lora.lora_llama(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, lora.loader(accelerator.num_processes))
    result: dict[str, Any] = lora.train_epoch(accelerator, model, optimizer, data)
    result["optimized"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    result["memory"] = _held_after_backward(accelerator, model, optimizer)
    result["adapter"] = lora.adapter_weights(model)
    base = accelerator.unwrap_model(model).get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    result["base_placements"] = [repr(p) for p in getattr(base, "placements", ())]
    _save_adapters(accelerator, model, Path(out))
    if accelerator.is_main_process:
        result["loaded"] = {folder: lora.load_adapter(Path(out) / folder) for folder in ADAPTER_FOLDERS}
    accelerator.save_state(str(Path(out) / "state"))
    state = Path(out) / "state"
    result["state_files"] = {
        str(p.relative_to(state)): p.stat().st_size for p in state.rglob("*") if p.is_file()
    }
    result["record"] = json.loads((state / "frozen_base.json").read_text())
    result["refused"] = _refused_loads(accelerator, model, state)
    result["after"] = (
        lora.train_epoch(accelerator, model, optimizer, data)["losses"],
        lora.adapter_weights(model),
    )
    _perturb(model)
    accelerator.load_state(str(Path(out) / "state"))
    result["resumed"] = (
        lora.train_epoch(accelerator, model, optimizer, data)["losses"],
        lora.adapter_weights(model),
    )
    if kind == "fsdp":
        result["fsdp"] = _fsdp_adapter_only(accelerator, model, Path(out))
        result["full state dict"] = _full_state_dict_resume(accelerator, model, Path(out) / "state_full")
    if kind == "single":
        result["with base"] = _saved_with_base(accelerator, model, Path(out) / "with_base")
    result["late adapters"] = lora.message_of(lambda: _adapters_after_prepare(accelerator))
    return result


def _held_after_backward(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds with one micro-batch's gradients
    present (lockstep's accounting: local shards under FSDP2), after the optimizer has its state; gradients
    cleared again. A batch of its own: the prepared loader's position is left alone."""
    from lockstep.memory.accounting import account_memory
    from tests.helpers.tiny_llama import token_ids

    ids = token_ids(lora.GLOBAL_BATCH // accelerator.num_processes, seed=accelerator.process_index)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    held = account_memory(model, optimizer)
    optimizer.zero_grad()
    return {
        "parameters": held.parameter_bytes,
        "gradients": held.gradient_bytes,
        "optimizer": held.optimizer_state_bytes,
    }


def _full_fine_tune_memory() -> dict[str, int]:
    """The same model without adapters, every weight trained, under DDP: the bytes held per rank."""
    from tests.helpers.tiny_llama import token_ids

    accelerator = _accelerator("ddp")
    model = lora.base_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = token_ids(lora.GLOBAL_BATCH // accelerator.num_processes, seed=accelerator.process_index)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()  # the optimizer's state exists from here
    return _held_after_backward(accelerator, model, optimizer)


def _refused_loads(accelerator: Any, model: torch.nn.Module, state: Path) -> dict[str, str]:
    """load_state of the adapter-only checkpoint onto another base (one frozen weight doubled) and onto a
    model whose trainable parameters differ (one adapter tensor frozen); both restored afterwards."""
    unwrapped = accelerator.unwrap_model(model)
    parameters = dict(unwrapped.named_parameters())
    with torch.no_grad():
        parameters[BASE_WEIGHT].mul_(2.0)  # exactly undone below
    refused = {"other base": lora.message_of(lambda: accelerator.load_state(str(state)))}
    with torch.no_grad():
        parameters[BASE_WEIGHT].div_(2.0)
    parameters[LORA_WEIGHT].requires_grad_(False)
    refused["other keys"] = lora.message_of(lambda: accelerator.load_state(str(state)))
    parameters[LORA_WEIGHT].requires_grad_(True)
    return refused


BASE_WEIGHT = "base_model.model.model.layers.1.mlp.up_proj.weight"
LORA_WEIGHT = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight"


def _full_state_dict_resume(accelerator: Any, model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """save_state/load_state with FSDP's FULL_STATE_DICT: the adapter gathered into model.safetensors alone."""
    from safetensors import safe_open

    accelerator.fsdp_plugin.state_dict_type = "FULL_STATE_DICT"
    accelerator.save_state(str(out))
    accelerator.fsdp_plugin.state_dict_type = "SHARDED_STATE_DICT"
    expected = lora.adapter_weights(model)
    _perturb(model)
    accelerator.load_state(str(out))
    restored = lora.adapter_weights(model)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        keys = sorted(weights.keys())
    return {"keys": keys, "restored": all(torch.equal(restored[n], expected[n]) for n in expected)}


def _saved_with_base(accelerator: Any, model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """ProjectConfiguration(save_frozen_base=True): the whole model saved, as Accelerate does, and loaded."""
    from safetensors import safe_open

    accelerator.project_configuration.save_frozen_base = True
    accelerator.save_state(str(out))
    accelerator.project_configuration.save_frozen_base = False
    expected = lora.adapter_weights(model)
    _perturb(model)
    accelerator.load_state(str(out))
    restored = lora.adapter_weights(model)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        keys = len(list(weights.keys()))
    return {
        "files": sorted(p.name for p in out.iterdir()),
        "keys": keys,
        "restored": all(torch.equal(restored[name], expected[name]) for name in expected),
        "bytes": lora.folder_bytes(out),
    }


def _adapters_after_prepare(accelerator: Any) -> None:
    """The mistake: get_peft_model on the model prepare() returned, then prepare() again."""
    from peft import LoraConfig, get_peft_model

    prepared = accelerator.prepare(lora.base_llama(1))
    accelerator.prepare(get_peft_model(prepared, LoraConfig(r=4, target_modules=lora.TARGETS)))


def _save_adapters(accelerator: Any, model: torch.nn.Module, out: Path) -> None:
    accelerator.save_model(model, str(out / "save_model"))
    state_dict = accelerator.get_state_dict(model)  # gathered from every process (a collective)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(str(out / "pretrained"), state_dict=state_dict)
    accelerator.wait_for_everyone()


def _fsdp_adapter_only(accelerator: Any, model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """Accelerate's save_fsdp_model/load_fsdp_model(adapter_only=True), both layouts, and merging refused."""
    from lockstep import FullyShardedDataParallelPlugin
    from lockstep.utils import load_fsdp_model, save_fsdp_model

    unwrapped = accelerator.unwrap_model(model)
    found: dict[str, Any] = {
        "merge": lora.message_of(lambda: unwrapped.merge_and_unload()),
        "bare save": lora.message_of(lambda: unwrapped.save_pretrained(str(out / "bare"))),
    }
    expected = lora.adapter_weights(model)
    assert len(expected) == ADAPTER_TENSORS
    for layout in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = FullyShardedDataParallelPlugin(state_dict_type=layout)
        save_fsdp_model(plugin, accelerator, model, str(out / layout), adapter_only=True)
        _perturb(model)
        load_fsdp_model(plugin, accelerator, model, str(out / layout), adapter_only=True)
        restored = lora.adapter_weights(model)
        found[layout] = all(torch.equal(restored[name], expected[name]) for name in expected)
        found[f"{layout} bytes"] = lora.folder_bytes(out / layout)
    return found


def _resumed_elsewhere(kind: str, source: Path, out: Path, durable: str) -> dict[str, Any]:
    """A fresh peft model (its adapter perturbed) prepared under ``kind`` loads the adapter-only checkpoint
    ``source`` that another layout wrote, and trains the epoch after it; then an asynchronous save (``durable``)
    of the adapter, written while training goes on, loads back to the adapter it snapshotted."""
    accelerator = _accelerator(kind)
    model = lora.lora_llama(0)
    _perturb(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, lora.loader(accelerator.num_processes))
    accelerator.load_state(str(source))
    result: dict[str, Any] = {"losses": lora.train_epoch(accelerator, model, optimizer, data)["losses"]}
    result["adapter"] = snapshot = lora.adapter_weights(model)
    folder = Path(accelerator.save_state(str(out), async_save=True, durable=durable))
    lora.train_epoch(accelerator, model, optimizer, data)  # the adapter moves on while the save is written
    accelerator.wait_for_checkpoint()  # this rank's part committed (the main process's: the whole folder)
    accelerator.wait_for_everyone()
    result["async files"] = {
        str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()
    }
    result["async record"] = json.loads((folder / "frozen_base.json").read_text())["models"]["0"]["saved"]
    _perturb(model)
    accelerator.load_state(str(folder))
    result["async restored"] = _max_difference(lora.adapter_weights(model), snapshot)
    return result


def _one_process(paths: list[str], out: str, transformers_checkpoint: str) -> dict[str, Any]:
    lora.use_peft(paths)
    result = _train("single", out)
    reset_lockstep_state()
    fsdp_state = Path(out).parent / "fsdp" / "state"  # written by the two processes, which run first
    result["from fsdp"] = _resumed_elsewhere("single", fsdp_state, Path(out) / "async", "sync")
    # peft checks this itself in get_peft_model, before lockstep sees the model: nothing is left to lockstep
    result["no target"] = lora.message_of(lambda: lora.lora_llama(0, targets=["query_key_value"]))
    reset_lockstep_state()
    result["trainer"] = _trainer_runs(Path(out) / "trainer", transformers_checkpoint)
    return result


def _trainer_runs(out: Path, transformers_checkpoint: str) -> dict[str, Any]:
    """lockstep.Trainer on the shared LoRA run, then resumed from its own checkpoint-4 and from the one
    transformers.Trainer wrote, each time with the adapter perturbed first."""
    from lockstep import Trainer, TrainingArguments
    from tests.reference import _peft_trainer_run

    found = {"trained": _peft_trainer_run.run(Trainer, TrainingArguments, str(out / "trained"))}
    reset_lockstep_state()
    neftune = _peft_trainer_run.NEFTUNE
    found["neftune"] = _peft_trainer_run.run(
        Trainer, TrainingArguments, str(out / "neftune"), settings=neftune
    )
    for name, checkpoint in (
        ("resumed", str(out / "trained" / "checkpoint-4")),
        ("from transformers", transformers_checkpoint),
    ):
        reset_lockstep_state()
        model = _peft_trainer_run.lora_model()
        _perturb(model)
        found[name] = _peft_trainer_run.run(
            Trainer,
            TrainingArguments,
            str(out / name.replace(" ", "_")),
            model,
            resume_from_checkpoint=checkpoint,
        )
    reset_lockstep_state()
    found["best"] = _best_model_run(out / "best")
    found["loaded"] = {
        folder: lora.load_adapter(out / "trained" / folder) for folder in ("checkpoint-4", "final")
    }
    return found


BEST_MODEL = {
    "eval_strategy": "steps",
    "eval_steps": 4,
    "per_device_eval_batch_size": 8,
    "load_best_model_at_end": True,
    "metric_for_best_model": "loss",
    "greater_is_better": True,  # the higher evaluation loss, step 4's, is the "best": not the last step's
    "save_only_model": True,
}


def _best_model_run(out: Path) -> dict[str, Any]:
    """load_best_model_at_end with save_only_model=True: the best checkpoint is peft's adapter folder, read back
    into the peft model at the end."""
    from lockstep import Trainer, TrainingArguments
    from tests.reference import _peft_trainer_run as shared

    model = shared.lora_model()
    args = TrainingArguments(output_dir=str(out), **{**shared.SETTINGS, **BEST_MODEL})
    trainer = Trainer(model=model, args=args, train_dataset=shared.Tokens(), eval_dataset=shared.Tokens())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return {
        "best": trainer.state.best_model_checkpoint,
        "adapter": lora.adapter_weights(model),
        "saved": {step: lora.load_adapter(out / f"checkpoint-{step}") for step in (4, 8)},
        "files": shared.listing(out / "checkpoint-4"),
    }


def _two_processes(paths: list[str], out: str) -> dict[str, dict[str, Any]]:
    lora.use_peft(paths)
    results = {}
    for kind in TOLERANCE:
        results[kind] = _train(kind, str(Path(out) / kind))
        reset_lockstep_state()  # the process group stays: the next kind's Accelerator takes it
    results["full fine-tune memory"] = _full_fine_tune_memory()
    reset_lockstep_state()
    results["fsdp trainer"] = _fsdp_trainer(Path(out) / "fsdp_trainer")
    reset_lockstep_state()
    for kind, source, durable in (("ddp", "fsdp", "background"), ("fsdp", "ddp", "sync")):
        folder = Path(out) / f"{source}_to_{kind}"
        results[f"{source} to {kind}"] = _resumed_elsewhere(
            kind, Path(out) / source / "state", folder, durable
        )
        reset_lockstep_state()
    return results


def _fsdp_trainer(out: Path) -> dict[str, Any]:
    """lockstep.Trainer with FSDP2 (sharded checkpoints): checkpoint-4 holds peft's adapter folder, gathered
    from both processes, as transformers.Trainer writes it."""
    from lockstep import Trainer, TrainingArguments
    from tests.reference import _peft_trainer_run as shared

    model = shared.lora_model()
    settings = {**shared.SETTINGS, "activation_checkpointing": False, "fsdp": "full_shard"}
    trainer = Trainer(
        model=model, args=TrainingArguments(output_dir=str(out), **settings), train_dataset=shared.Tokens()
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    found: dict[str, Any] = {"adapter": lora.adapter_weights(trainer.model_wrapped)}  # a collective
    if trainer.accelerator.is_main_process:
        found["files"] = shared.listing(out / "checkpoint-8")
        found["loaded"] = lora.load_adapter(out / "checkpoint-8")
    return found


@pytest.fixture(scope="module")
def paths() -> list[str]:
    return peft_pythonpath()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def runs(paths, out) -> dict[str, dict[str, Any]]:
    # transformers.Trainer first (reference environment): lockstep.Trainer resumes from its checkpoint-4 too
    done = run_reference(_TRANSFORMERS_RUN, str(out / "transformers"), folder=out, timeout=300)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    theirs, theirs_neftune = theirs["plain"], theirs["neftune"]
    lora.preload()
    checkpoint = str(out / "transformers" / "checkpoint-4")
    two = run_distributed(_two_processes, 2, paths, str(out), timeout=300)[
        0
    ]  # first: one process loads its state
    single = run_distributed(_one_process, 1, paths, str(out / "single"), checkpoint, timeout=180)[0]
    return {"single": single, "transformers": theirs, "transformers neftune": theirs_neftune, **two}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _check_adapter_folders(out: Path, result: dict[str, Any]) -> None:
    assert sorted(result["loaded"]) == sorted(ADAPTER_FOLDERS)
    for folder in ADAPTER_FOLDERS:
        assert sorted(p.name for p in (out / folder).iterdir() if p.suffix != ".md") == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert _max_difference(result["loaded"][folder], result["adapter"]) == 0.0, folder


def test_one_process_trains_only_the_adapters_and_resumes_exactly(runs, out):
    result = runs["single"]
    assert len(result["losses"]) == 4 and len(result["norms"]) == 2
    assert all(
        len(names) == ADAPTER_TENSORS and all("lora_" in n for n in names) for names in result["with_grad"]
    )
    assert (
        result["optimized"]
        == sum(t.numel() for t in result["adapter"].values())
        == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    )
    losses, weights = result["after"]
    assert result["resumed"][0] == losses
    assert _max_difference(result["resumed"][1], weights) == 0.0
    assert result["late adapters"].startswith(LATE_ADAPTERS.format(name="LlamaForCausalLM"))
    _check_adapter_folders(out / "single", result)


LATE_ADAPTERS = (
    "RuntimeError: prepare() got a peft model whose base model ({name}) was prepared already: "
    "get_peft_model(...) was applied after accelerator.prepare(...)"
)


FROZEN = 21  # embeddings, 2 x (7 projections + 2 norms), the final norm, lm_head
REFUSED_BASE = (
    "ValueError: load_state({state!r}): model 0 was saved without its frozen base, and the base of the model "
    f"prepared now is not the one it was trained on: the sum of the absolute values of {BASE_WEIGHT} was "
)
REFUSED_KEYS = (
    "ValueError: load_state({state!r}): model 0 was saved without its frozen base (frozen_base.json: 8 keys, "
    "the adapter), but those are not the trainable keys of the model prepared now (7). Trainable here, not in "
    f"the checkpoint (0): []; in the checkpoint, frozen or absent here (1): ['{LORA_WEIGHT}']. Load it into "
    "the same peft model it was saved from"
)


# Measured: 4,672 B of model files (single, DDP) and 35,014 B (FSDP2, two DCP shards and their metadata) for an
# adapter of 3,584 B; with the base (93,440 B) they were 97,896 and 204,633 B. The whole checkpoints: 40,242 B
# (single), 54,776 B (DDP; 143,884 before) and 174,495 B (FSDP2; 339,997 before).
MODEL_BYTES = {"single": 5_000, "ddp": 5_000, "fsdp": 36_000}
CHECKPOINT_BYTES = {"single": 42_000, "ddp": 57_000, "fsdp": 180_000}


@pytest.mark.parametrize("kind", ["single", "ddp", "fsdp"])
def test_save_state_leaves_the_frozen_base_out_and_refuses_another_base(runs, out, kind):
    result, state = runs[kind], str(out / kind / "state")
    model = result["record"]["models"]["0"]
    assert model["saved"] == sorted(result["adapter"]) and len(model["frozen"]) == FROZEN
    assert model["frozen"]["base_model.model.lm_head.weight"][:2] == [[64, 32], "float32"]
    # the same base, whole in one process or sharded over two: the same fingerprint (float64 sums)
    for name, (shape, dtype, *sums) in runs["single"]["record"]["models"]["0"]["frozen"].items():
        assert model["frozen"][name][:2] == [shape, dtype]
        assert model["frozen"][name][2:] == pytest.approx(sums, rel=1e-12), name
    files = result["state_files"]
    model_bytes = sum(size for name, size in files.items() if name.startswith(("model.", "pytorch_model")))
    print(f"{kind}: checkpoint {sum(files.values())} B, model files {model_bytes} B: {files}")
    assert model_bytes <= MODEL_BYTES[kind] and sum(files.values()) <= CHECKPOINT_BYTES[kind]
    assert result["refused"]["other base"].startswith(REFUSED_BASE.format(state=state))
    assert result["refused"]["other keys"].startswith(REFUSED_KEYS.format(state=state))


def test_save_frozen_base_saves_the_whole_model_as_accelerate(runs):
    saved = runs["single"]["with base"]
    assert saved["keys"] == ADAPTER_TENSORS + FROZEN and saved["restored"]
    assert "frozen_base.json" not in saved["files"] and "model.safetensors" in saved["files"]


def test_adapters_whose_target_modules_match_nothing_are_refused_by_peft(runs):
    assert runs["single"]["no target"] == (
        "NoMatchingPeftModuleError: Target modules {'query_key_value'} not found in the base model. "
        "Please check the target modules and try again."
    )


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_match_one_and_save_the_whole_adapter(runs, out, kind):
    result, one_process = runs[kind], runs["single"]
    difference = _max_difference(result["adapter"], one_process["adapter"])
    print(f"{kind}: max |adapter - one process| = {difference:.3g}")
    assert difference <= TOLERANCE[kind]
    assert result["losses"] == pytest.approx(one_process["losses"], abs=1e-5)
    assert result["norms"] == pytest.approx(one_process["norms"], rel=1e-5)
    assert result["with_grad"] == one_process["with_grad"]
    assert result["base_placements"] == (["Shard(dim=0)"] if kind == "fsdp" else [])
    losses, weights = result["after"]
    assert result["resumed"][0] == losses and _max_difference(result["resumed"][1], weights) == 0.0
    _check_adapter_folders(out / kind, result)
    print(kind, result["state_files"], result.get("fsdp"))
    if kind == "fsdp":
        found = result["fsdp"]
        assert found["SHARDED_STATE_DICT"] and found["FULL_STATE_DICT"]
        full = result["full state dict"]
        assert full["keys"] == sorted(result["adapter"]) and full["restored"]
        assert found["merge"].startswith(
            "RuntimeError: merge_and_unload() on a peft model prepared with FSDP2 is refused: each process holds "
            "only a shard of the base weights"
        )
        assert found["bare save"].startswith(
            f"RuntimeError: save_pretrained({str(out / kind / 'bare')!r}) on a peft model prepared with FSDP2: its "
            "weights are shards, one per process"
        )
    wrapper = "DistributedDataParallel" if kind == "ddp" else "FSDPLlamaForCausalLM"
    assert result["late adapters"].startswith(LATE_ADAPTERS.format(name=wrapper))


_TRANSFORMERS_RUN = """
import json, sys
import transformers
from tests.reference._peft_trainer_run import NEFTUNE, run
plain = run(transformers.Trainer, transformers.TrainingArguments, sys.argv[1])
neftune = run(transformers.Trainer, transformers.TrainingArguments, sys.argv[1] + "_neftune", settings=NEFTUNE)
print(json.dumps({"plain": plain, "neftune": neftune}))
"""


# Adapter-only checkpoints across layouts: loaded, then one more epoch, against the uninterrupted run of the
# layout that saved it (measured: see the commit message).
ACROSS = {
    "fsdp to ddp": ("fsdp", "ddp"),
    "ddp to fsdp": ("ddp", "fsdp"),
    "fsdp to single": ("fsdp", "single"),
}
ACROSS_TOLERANCE = 1e-6  # measured: 0 between DDP and FSDP2, 5.7e-8 for FSDP2 -> one process


@pytest.mark.parametrize("case", sorted(ACROSS))
def test_adapter_only_checkpoints_resume_under_another_layout_and_save_asynchronously(runs, case):
    """FSDP2's DCP shards load under DDP and on one process, DDP's model.safetensors under FSDP2, and each goes
    on to the adapter of the run that saved it; an async_save of the adapter (durable="background" under DDP)
    is complete once waited for, as small as a synchronous one, and loads to the adapter it snapshotted."""
    source, kind = ACROSS[case]
    result = runs["single"]["from fsdp"] if kind == "single" else runs[case]
    losses, adapter = runs[source]["after"]
    difference = _max_difference(result["adapter"], adapter)
    print(f"{case}: max |adapter - uninterrupted {source}| = {difference:.3g}")
    assert difference <= ACROSS_TOLERANCE and result["losses"] == pytest.approx(losses, abs=1e-5)
    assert result["async restored"] == 0.0 and result["async record"] == sorted(adapter)
    synchronous = runs[kind]["state_files"]
    assert sorted(result["async files"]) == sorted(synchronous)
    # the tensors' files, byte for byte as large (DCP's .metadata names the folder it was written to)
    model_files = [name for name in synchronous if name.endswith((".safetensors", ".distcp"))]
    assert model_files and all(result["async files"][n] == synchronous[n] for n in model_files), model_files


def test_trainer_with_a_peft_model_matches_transformers_trainer_and_resumes_exactly(runs, out):
    """The Trainer trains only the adapter (reentrant activation checkpointing: the gradients reach it through
    the input-require-grads hook), writes peft's adapter folder into checkpoint-4 and at the end, as
    transformers.Trainer does, and resumes from checkpoint-4 to the same adapter bit for bit."""
    theirs = runs["transformers"]
    ours, resumed = runs["single"]["trainer"]["trained"], runs["single"]["trainer"]["resumed"]
    difference = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
    adapter_difference = max(
        abs(a - b)
        for name in theirs["adapter"]
        for a, b in zip(ours["adapter"][name], theirs["adapter"][name])
    )
    print(
        f"Trainer vs transformers.Trainer: losses within {difference:.3g}, adapter within {adapter_difference:.3g}"
    )
    assert ours["rates"] == theirs["rates"] and len(ours["rates"]) == 8
    assert difference <= 1e-5 and adapter_difference <= 1e-5
    assert ours["optimized"] == theirs["optimized"] == 896 and ours["base unchanged"]
    adapter_files = {"adapter_config.json", "adapter_model.safetensors"}
    assert adapter_files <= set(ours["checkpoint"]) and adapter_files <= set(theirs["checkpoint"])
    assert adapter_files <= set(ours["final"]) and adapter_files <= set(theirs["final"])
    assert "model.safetensors" not in ours["final"]
    # the resumed history holds the 4 logged steps of checkpoint-4, then its own 4
    assert resumed["losses"] == ours["losses"] and resumed["adapter"] == ours["adapter"]
    final = {name: torch.tensor(values) for name, values in ours["adapter"].items()}
    loaded = {
        folder: {name: t.flatten() for name, t in weights.items()}
        for folder, weights in runs["single"]["trainer"]["loaded"].items()
    }
    assert _max_difference(loaded["final"], final) == 0.0
    assert _max_difference(loaded["checkpoint-4"], final) > 1e-4  # the adapter of step 4, not the final one


def test_trainer_resumes_a_peft_checkpoint_of_transformers_trainer(runs):
    """checkpoint-4 of transformers.Trainer (peft's adapter folder, optimizer.pt, scheduler.pt, rng_state.pth):
    lockstep.Trainer resumes it from a perturbed adapter and ends on transformers' final adapter."""
    theirs, resumed = runs["transformers"], runs["single"]["trainer"]["from transformers"]
    difference = max(
        abs(a - b)
        for name in theirs["adapter"]
        for a, b in zip(resumed["adapter"][name], theirs["adapter"][name])
    )
    print(
        f"resumed from transformers.Trainer's checkpoint-4: adapter within {difference:.3g} of its final one"
    )
    assert resumed["losses"][4:] == pytest.approx(theirs["losses"][4:], abs=1e-6) and difference <= 1e-6


def test_trainer_loads_the_best_adapter_at_the_end(runs, out):
    found = runs["single"]["trainer"]["best"]
    assert found["best"] == str(out / "single" / "trainer" / "best" / "checkpoint-4")
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json"} <= set(found["files"])
    assert _max_difference(found["adapter"], found["saved"][4]) == 0.0
    assert _max_difference(found["adapter"], found["saved"][8]) > 1e-4


def test_trainer_under_fsdp_writes_the_gathered_adapter_folder_into_its_checkpoints(runs):
    found = runs["fsdp trainer"]
    assert {"adapter_config.json", "adapter_model.safetensors", "frozen_base.json"} <= set(found["files"])
    assert not any(name.startswith("model") for name in found["files"])  # the adapter is in DCP shards
    assert _max_difference(found["loaded"], found["adapter"]) == 0.0  # whole tensors, not one rank's shard


def _estimated(strategy: str, adapters: bool) -> dict[str, int]:
    """``lockstep estimate-memory``'s model state per rank for the tiny Llama on 2 processes in fp32 with AdamW,
    with LoRA (``--lora-r 4 --lora-targets q_proj,v_proj``) or every weight trained."""
    from lockstep.memory.estimate import estimate_memory
    from lockstep.memory.estimate.adapters import LoraShape, with_lora
    from lockstep.memory.estimate.model_source import describe_module

    model = lora.base_llama(0)
    description = describe_module("tiny Llama", model)
    if adapters:
        description = with_lora(description, model, LoraShape(4, tuple(lora.TARGETS)))
    estimate = estimate_memory(description, num_processes=[2], dtypes=["fp32"], strategies=[strategy])
    row = estimate.rows[0]
    return {"parameters": row.parameters, "gradients": row.gradients, "optimizer": row.optimizer_state}


@pytest.mark.parametrize(
    ("case", "strategy", "adapters"),
    [("full fine-tune memory", "ddp", False), ("ddp", "ddp", True), ("fsdp", "fsdp", True)],
)
def test_memory_per_rank_is_what_estimate_memory_predicts(runs, case, strategy, adapters):
    held = runs[case] if case.endswith("memory") else runs[case]["memory"]
    estimated = _estimated(strategy, adapters)
    print(f"{case}: held {held}, estimated {estimated}")
    assert sum(held.values()) == pytest.approx(sum(estimated.values()), rel=0.10), (held, estimated)
    assert held["gradients"] == pytest.approx(estimated["gradients"], rel=0.10), (held, estimated)
    if adapters:  # only the adapters have gradients and optimizer state: a small fraction of the weights
        assert held["gradients"] < held["parameters"] / 10 and held["optimizer"] < held["parameters"] / 5


def test_trainer_with_neftune_on_a_peft_model_matches_transformers_trainer(runs):
    """NEFTune's noise on the embeddings of the peft model's base (found through the peft model), drawn as
    transformers draws it: the same losses and adapter as transformers.Trainer on one process."""
    ours, theirs = runs["single"]["trainer"]["neftune"], runs["transformers neftune"]
    # the noise is there: the first step's loss (the same weights and batch) differs from the plain run's
    assert ours["losses"][0] != runs["transformers"]["losses"][0]
    assert ours["rates"] == theirs["rates"] and ours["optimized"] == theirs["optimized"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=0.0), (ours["losses"], theirs["losses"])
    difference = max(
        abs(a - b)
        for name in theirs["adapter"]
        for a, b in zip(ours["adapter"][name], theirs["adapter"][name])
    )
    print(f"NEFTune: adapter difference {difference:.3g}, losses {ours['losses']} vs {theirs['losses']}")
    assert difference == 0.0  # measured: bit for bit
