"""``lockstep device-map``: the device map a model would get under a memory budget, without loading it.

The model is built from its ``config.json`` on the meta device (no weight is read) and planned with
``lockstep.utils.infer_auto_device_map``, as ``load_checkpoint_and_dispatch(device_map="auto")`` would.

Examples::

    lockstep device-map ./my-model --max-memory cpu=2GiB
    lockstep device-map ./my-model --max-memory 0=20GiB,cpu=30GiB --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lockstep.errors import UsageError

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "device-map",
        help="the device map (GPUs, CPU, disk) a model would get under a memory budget, without loading it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="a folder with a transformers config.json")
    parser.add_argument(
        "--max-memory",
        "--max_memory",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="the budget per device, e.g. cpu=2GiB or 0=20GiB,cpu=30GiB (repeatable); default: the free "
        "memory of every device",
    )
    parser.add_argument(
        "--no-split",
        help="comma-separated class names never split across devices (default: the model's _no_split_modules)",
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="size the weights as loaded in this dtype")
    parser.add_argument(
        "--model-class", help="transformers class to build (default: the config's architecture)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run_device_map)


def parse_max_memory(entries: list[str]) -> dict[int | str, str] | None:
    """``["0=20GiB,cpu=2GiB"]`` -> ``{0: "20GiB", "cpu": "2GiB"}`` (None when no entry is given)."""
    from lockstep.checkpoint.model_files import parse_size

    budget: dict[int | str, str] = {}
    for entry in ",".join(entries).split(","):
        if not entry.strip():
            continue
        device, sep, size = entry.partition("=")
        device, size = device.strip(), size.strip()
        key: int | str = int(device) if device.isdigit() else device
        if not sep or not (isinstance(key, int) or key in ("cpu", "mps", "disk")):
            raise UsageError(
                f"--max-memory {entry!r} is invalid: write DEVICE=SIZE where DEVICE is a GPU index, cpu, mps "
                "or disk, e.g. --max-memory cpu=2GiB."
            )
        try:
            parse_size(size)
        except (TypeError, ValueError):
            raise UsageError(
                f"--max-memory {entry!r}: {size!r} is not a size; write e.g. 2GiB, 500MB or 1073741824."
            ) from None
        budget[key] = size
    return budget or None


def run_device_map(args: argparse.Namespace) -> int:
    max_memory = parse_max_memory(args.max_memory)
    from lockstep.memory.estimate.model_source import build_model_from_folder  # imports torch
    from lockstep.utils.modeling import compute_module_sizes, infer_auto_device_map

    model = build_model_from_folder(args.model, args.model_class)
    no_split = (
        args.no_split.split(",") if args.no_split else list(getattr(model, "_no_split_modules", None) or [])
    )
    dtype = _DTYPES[args.dtype] if args.dtype else None
    try:
        plan = infer_auto_device_map(model, max_memory, no_split_module_classes=no_split, dtype=dtype)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.json:
        sizes = compute_module_sizes(model, dtype=dtype)
        print(json.dumps({"device_map": plan, "sizes": {name: sizes[name] for name in plan}}, indent=1))
        return 0
    print(
        f"Model: {type(model).__name__} from {args.model}; no-split blocks: {', '.join(no_split) or 'none'}"
    )
    # the same plan again (it reads only shapes), printed as infer_auto_device_map's verbose table
    infer_auto_device_map(model, max_memory, no_split_module_classes=no_split, dtype=dtype, verbose=True)
    return 0
