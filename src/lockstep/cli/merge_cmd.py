"""``lockstep merge-weights CHECKPOINT_DIR OUTPUT_DIR``: one safetensors model from a sharded checkpoint.

Runs in this one process with no process group. An FSDP checkpoint: DCP's metadata gives every tensor's
global shape, and the shards of all processes are read into whole tensors. A DeepSpeed ZeRO checkpoint:
every process's fp32 partitions are joined (without DeepSpeed installed). The model is written as (sharded)
safetensors with an index, like ``save_model``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lockstep.cli._errors import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "merge-weights",
        help="turn a sharded (FSDP or DeepSpeed ZeRO) checkpoint into one safetensors model, on one process",
        description=(
            "Read the model shards of a checkpoint saved by save_state with FSDP (SHARDED_STATE_DICT) or "
            "DeepSpeed (ZeRO 0-3) and write one safetensors model. CHECKPOINT_DIR is the checkpoint folder or "
            "its pytorch_model_fsdp_N / deepspeed_N subfolder."
        ),
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
    parser.add_argument("output_dir", metavar="OUTPUT_DIR")
    parser.add_argument(
        "--model-index",
        "--model_index",
        dest="model_index",
        type=int,
        default=0,
        help="which prepared model to merge (default 0)",
    )
    parser.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        default="10GB",
        help="largest safetensors file to write (default 10GB)",
    )
    parser.add_argument(
        "--unsafe-serialization",
        "--unsafe_serialization",
        dest="unsafe",
        action="store_true",
        help="write pytorch_model.bin instead of safetensors",
    )
    parser.set_defaults(handler=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from lockstep.backends.deepspeed.merge import (
        engine_files_folder,
        is_deepspeed_checkpoint,
        read_zero_weights,
    )
    from lockstep.backends.fsdp.checkpoint import read_full_weights, sharded_model_folder
    from lockstep.checkpoint.model_files import save_model_files

    checkpoint = Path(args.checkpoint_dir)
    if not checkpoint.is_dir():
        raise UsageError(f"CHECKPOINT_DIR {checkpoint} is not a folder; pass the folder save_state wrote.")
    if args.model_index < 0:
        raise UsageError(f"--model-index {args.model_index} is invalid: it must be 0 or more.")
    output = Path(args.output_dir)
    if output.exists() and not output.is_dir():
        raise UsageError(f"OUTPUT_DIR {output} exists and is not a folder.")
    try:
        if is_deepspeed_checkpoint(checkpoint, args.model_index):
            folder = engine_files_folder(checkpoint, args.model_index)
            weights = read_zero_weights(folder)
        else:
            folder = sharded_model_folder(checkpoint, args.model_index)
            weights = read_full_weights(folder)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    save_model_files(weights, output, max_shard_size=args.max_shard_size, safe_serialization=not args.unsafe)
    total = sum(t.numel() for t in weights.values())
    print(f"merged {len(weights)} tensors ({total:,} parameters) from {folder} into {output}")
    return 0
