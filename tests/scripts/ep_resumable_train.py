"""A mixture-of-experts training loop that survives a lost process and a restart on another number of
processes, written as a user writes it (tests/expert_parallel/test_resize.py).

Usage: ep_resumable_train.py PROJECT_DIR [--steps N] [--save-every K] [--die-at STEP]
    (under ``lockstep launch --num-processes P --parallelism-config-ep-size E``)

A tiny Qwen3-MoE (8 experts, top-2, router aux loss on) from its config, AdamW, a shuffled DataLoader of 64
sequences of 8 tokens (2 per process per step), ``save_state`` every K steps and
``resume_from_latest_checkpoint()`` at start. Rank 0 appends each step's sample ids (every process's, by
``gather_for_metrics``) to PROJECT_DIR/ids.jsonl as ``{"step": N, "ids": [...]}`` and at the end writes the
one-process state dict (``get_state_dict``) to PROJECT_DIR/final.pt. With --die-at, rank 1 kills itself with
SIGKILL after that step on the first attempt. Attempt k seeds torch with k, so only a real resume reaches
the weights of the logged history.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lockstep import Accelerator, ProjectConfiguration

SAMPLES, SEQUENCE, VOCAB, PER_PROCESS, LR = 64, 8, 64, 2, 1e-3


def build() -> Qwen3MoeForCausalLM:
    """The model, the same weights every call."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def tokens_of(ids: torch.Tensor) -> torch.Tensor:
    """Sample ``i``'s tokens: a counting sequence from its own random start (the next token is learnable)."""
    starts = torch.stack(
        [torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(int(i))) for i in ids]
    )
    return (starts + torch.arange(SEQUENCE)) % VOCAB


class Progress:
    """The optimizer steps taken, saved with the checkpoints."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--die-at", type=int, default=-1)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(args.project_dir), automatic_checkpoint_naming=True, total_limit=2
        )
    )
    model = build()
    optimizer = optimizer_of(model)
    torch.manual_seed(attempt)  # the data order of a fresh start: only a resume gives the logged one
    loader = DataLoader(torch.arange(SAMPLES), batch_size=PER_PROCESS, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resumed = accelerator.resume_from_latest_checkpoint()
    accelerator.print(
        f"attempt {attempt} world {accelerator.num_processes} resumed from {resumed} at step {progress.done}"
    )
    while progress.done < args.steps:
        for ids in loader:
            tokens = tokens_of(ids)
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            progress.done += 1
            step = progress.done
            trained = accelerator.gather_for_metrics(ids).tolist()
            if accelerator.is_main_process:
                with open(args.project_dir / "ids.jsonl", "a") as log:
                    log.write(json.dumps({"step": step, "ids": trained}) + "\n")
            if step == args.die_at and accelerator.process_index == 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.save_every == 0:
                accelerator.save_state()
            if step == args.steps:
                break
    weights = accelerator.get_state_dict(model)  # every rank: the experts are gathered
    if accelerator.is_main_process:
        torch.save(
            {name: tensor.detach().clone() for name, tensor in weights.items()}, args.project_dir / "final.pt"
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
