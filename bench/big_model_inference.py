"""Big-model inference: a Llama generating fully in memory vs with two thirds of it on disk, lockstep and
Accelerate side by side (each run in a fresh process, interleaved).

    .venv/bin/python bench/big_model_inference.py [--layers 12] [--hidden 384] [--tokens 32] [--repeats 3]

Accelerate runs with the reference environment's python (.venv-reference, built by ``make test``); without
it only lockstep's rows are printed. Prints, per tool and placement: load time, tokens per second and the
peak growth of the resident memory during load + generate (medians), and whether the tokens equal the
in-memory run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("_big_model_worker.py"))
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"OMP_NUM_THREADS": "1"}


def save_model(folder: Path, layers: int, hidden: int) -> int:
    """A random Llama saved with save_pretrained (100 MB shards); returns its size in bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(python: str, tool: str, folder: Path, budget: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as offload:
        env = ENV | {"PYTHONPATH": str(ROOT / "src")} if tool == "lockstep" else ENV
        done = subprocess.run(
            [python, WORKER, tool, str(folder), offload, str(budget), str(tokens)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--reference-python",
        default=str(ROOT / ".venv-reference" / "bin" / "python"),
        help="the python of an environment with Accelerate (default: .venv-reference)",
    )
    args = parser.parse_args()
    tools = {"lockstep": sys.executable}
    reference = Path(args.reference_python)
    if reference.exists():
        tools["accelerate"] = str(reference)
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "model"
        size = save_model(folder, args.layers, args.hidden)
        placements = {"in memory": 0, "1/3 in memory, rest on disk": size // 3}
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            for placement, budget in placements.items():
                for tool, python in tools.items():
                    results.setdefault((tool, placement), []).append(
                        run(python, tool, folder, budget, args.tokens)
                    )
    reference_tokens = results[("lockstep", "in memory")][0]["tokens"]
    print(
        f"Llama, {args.layers} layers, hidden {args.hidden}: {size / 2**20:.1f} MiB fp32; {args.tokens} "
        f"new tokens, greedy, one thread; medians of {args.repeats}"
    )
    print(
        f"{'tool':<11} {'placement':<28} {'blocks on disk':>14} {'load s':>7} {'tokens/s':>9} "
        f"{'peak RSS growth':>16} {'same tokens':>11}"
    )
    for (tool, placement), runs in results.items():
        print(
            f"{tool:<11} {placement:<28} {runs[0]['on_disk']:>14} "
            f"{statistics.median(r['load_s'] for r in runs):>7.2f} "
            f"{statistics.median(r['tokens_per_s'] for r in runs):>9.1f} "
            f"{statistics.median(r['peak_growth'] for r in runs) / 2**20:>12.1f} MiB "
            f"{all(r['tokens'] == reference_tokens for r in runs)!s:>11}"
        )


if __name__ == "__main__":
    main()
