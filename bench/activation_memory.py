"""Bytes kept for backward per activation policy, measured and predicted, and what the recomputation costs.

Two models, one process, CPU, fp32, training mode:

* ``mlp``: the pipeline benchmark's model (bench/_pipeline_worker.py: 12 residual blocks of width 256, LayerNorm,
  up to 2x, ReLU, down), batch 1024;
* ``llama``: a small ``LlamaForCausalLM`` built from its config (4 layers, hidden 256, 8 heads, 4 key/value
  heads, MLP 688, vocabulary 1000), batch 4 x 256 tokens.

For every policy (none, full, every_2, op, offload) the blocks are wrapped as ``FullyShardedDataParallelPlugin(
activation_checkpointing=...)`` wraps them, and the script reports:

* ``kept``: the meter (lockstep.memory.activation_meter.KeptActivations): storages alive after the forward;
* ``hooks peak``: the pipeline benchmark's meter (saved-tensor hooks, peak over forward and backward), which
  sees nothing inside a checkpointed or offloaded block (their own hooks replace it);
* ``predicted``: ``lockstep estimate-memory --activation-policies`` (a forward on the meta device) and its
  ratio to ``kept``;
* ``step ms``: median forward + backward time, the price of recomputation.

Usage: ``python bench/activation_memory.py [--steps 10] [--json out.json]``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pipeline_worker import ActivationMeter
from _pipeline_worker import Model as PipelineModel

from lockstep.memory.activation_meter import KeptActivations
from lockstep.memory.activation_policy import apply_activation_policy, parse_activation_policy
from lockstep.memory.estimate.policies import model_blocks, policy_estimates

POLICIES = ("none", "full", "every_2", "op", "offload")
MLP_BATCH = 1024
LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8}
LLAMA |= {"num_key_value_heads": 4, "vocab_size": 1000}
LLAMA_BATCH, LLAMA_SEQ = 4, 256


def _mlp() -> tuple[nn.Module, nn.Module, Callable[[nn.Module], torch.Tensor], dict]:
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = PipelineModel()
    batch = torch.randn(MLP_BATCH, 256)

    def loss(model: nn.Module) -> torch.Tensor:
        return model(batch.clone()).square().mean()

    return PipelineModel(), meta, loss, {"input_shape": (MLP_BATCH, 256), "block_class": "Layer"}


def _llama() -> tuple[nn.Module, nn.Module, Callable[[nn.Module], torch.Tensor], dict]:
    import transformers

    config = transformers.LlamaConfig(**LLAMA, use_cache=False)  # training
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ))

    def loss(model: nn.Module) -> torch.Tensor:
        return model(input_ids=ids).logits.float().square().mean()

    return transformers.LlamaForCausalLM(config), meta, loss, {}


def _blocks(model: nn.Module, options: dict) -> list[nn.Module]:
    return model_blocks(model, options.get("block_class"))


def measure(name: str, steps: int) -> list[dict]:
    real, meta, loss, options = _mlp() if name == "mlp" else _llama()
    real.train()
    predicted = policy_estimates(
        meta,
        policies=POLICIES,
        batch_size=LLAMA_BATCH,
        seq_len=LLAMA_SEQ,
        input_shape=options.get("input_shape"),
        block_class=options.get("block_class"),
    )
    rows = []
    for policy, estimate in zip(POLICIES, predicted, strict=True):
        model = copy.deepcopy(real)
        apply_activation_policy(
            model, _blocks(model, options), parse_activation_policy(policy, owner="bench")
        )
        with KeptActivations(exclude=[*model.parameters(), *model.buffers()]) as meter:
            value = loss(model)
        kept = meter.kept_bytes()
        value.backward()
        del value
        hooks = ActivationMeter(list(model.parameters()))
        with hooks.context():
            loss(model).backward()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            loss(model).backward()
            times.append(time.perf_counter() - started)
        rows.append(
            {
                "model": name,
                "policy": policy,
                "kept_bytes": kept,
                "hooks_peak_bytes": hooks.peak,
                "predicted_bytes": estimate.kept,
                "predicted_on_device_bytes": estimate.on_device,
                "step_ms": statistics.median(times) * 1e3,
            }
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | policy | kept MiB (meter) | saved-tensor-hooks meter, peak MiB | predicted MiB (ratio) "
        "| on the accelerator MiB | step ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    mib = 2.0**20
    for row in rows:
        ratio = row["predicted_bytes"] / row["kept_bytes"]
        lines.append(
            f"| {row['model']} | {row['policy']} | {row['kept_bytes'] / mib:.2f} | {row['hooks_peak_bytes'] / mib:.2f} "
            f"| {row['predicted_bytes'] / mib:.2f} ({ratio:.3f}) | {row['predicted_on_device_bytes'] / mib:.2f} "
            f"| {row['step_ms']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per policy (10)")
    parser.add_argument("--models", default="mlp,llama", help="comma-separated: mlp, llama (both)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for name in args.models.split(",") for row in measure(name.strip(), args.steps)]
    print("\n".join(table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
