"""``lockstep estimate-memory``: per-rank training memory for DDP, ZeRO 1/2/3 and FSDP, before running.

Examples::

    lockstep estimate-memory ./my-model                    # a folder with config.json
    lockstep estimate-memory mypkg.models:build_model      # a function returning an nn.Module
    lockstep estimate-memory --config-class LlamaConfig --set hidden_size=2048 --set num_hidden_layers=16 \\
        --num-processes 1,8,64 --dtypes bf16 --batch-size 4 --seq-len 2048 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from lockstep.config.activation_policy import parse_activation_policy
from lockstep.errors import UsageError

_STRATEGY_NOTES = {
    "ddp": "DistributedDataParallel: everything replicated",
    "zero1": "ZeRO-1: optimizer state sharded",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3: + parameters sharded",
    "fsdp": "FSDP FULL_SHARD (= ZeRO-3)",
    "mesh": "an N-D layout: TP splits what the model's tp plan names, FSDP shards over dp_shard x cp",
    "ep": "expert parallelism (DDP): num_experts / ep_size experts per block on each rank, the rest replicated; "
    "with --dp-shard M (FSDP2), the rest sharded over M and each rank's experts over their M / ep_size replicas",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "estimate-memory",
        help="per-rank training memory for DDP, ZeRO 1/2/3 and FSDP, by dtype and number of processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="a folder with a transformers config.json, 'module:factory' or 'file.py:factory' (a function "
        "returning an nn.Module, called on the meta device), or a transformers config class name",
    )
    parser.add_argument("--config-class", help="a transformers config class (BertConfig, LlamaConfig, ...)")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='set a config field (repeatable); VALUE is read as JSON when it parses (256, true, "gelu")',
    )
    parser.add_argument(
        "--model-class",
        help="transformers model class to build (default: the config's "
        "architectures entry, else AutoModel), e.g. AutoModelForCausalLM",
    )
    parser.add_argument(
        "--num-processes", "--num_processes", default="1,2,4,8", help="comma-separated (1,2,4,8)"
    )
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16 (fp32,bf16)")
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp", help="comma-separated subset")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd-momentum or sgd (adamw)")
    parser.add_argument("--batch-size", "--batch_size", default="1", help="micro-batch per process (1)")
    parser.add_argument("--seq-len", "--seq_len", default="512", help="sequence length (512)")
    for flag, what in (
        ("--tp", "tensor-parallel size"),
        ("--cp", "context-parallel size"),
        ("--dp-shard", "FSDP (sharded data parallel) size"),
        ("--dp-replicate", "replicated data parallel size"),
    ):
        parser.add_argument(
            flag,
            flag.replace("-", "_").replace("__", "--"),
            dest=flag[2:].replace("-", "_"),
            metavar="N",
            help=f"{what} of an N-D layout (ParallelismConfig): adds a 'mesh' row",
        )
    parser.add_argument(
        "--ep-size",
        "--ep_size",
        dest="ep_size",
        metavar="N",
        help="expert parallelism over N processes (ParallelismConfig(ep_size=N)) of a mixture-of-experts "
        "model (its config sets num_experts or num_local_experts): adds an 'ep' row, each rank holding "
        "num_experts / N experts per layer; with --dp-shard M (N dividing M), FSDP2 with expert parallelism "
        "(ParallelismConfig(dp_shard_size=M, ep_size=N)): 1/M of the dense part and the N-th of the experts "
        "sharded over M / N replicas",
    )
    parser.add_argument(
        "--activation-policies",
        "--activation_policies",
        help="comma-separated activation policies (none, full, every_<k>, op, offload): what each keeps for "
        "backward, by a forward on the meta device",
    )
    parser.add_argument(
        "--input-shape",
        "--input_shape",
        help="with --activation-policies, for a model that is not a transformers model: its float input's "
        "shape, batch first (e.g. 32,384)",
    )
    parser.add_argument(
        "--block-class",
        "--block_class",
        help="with --activation-policies: the class of the blocks the policy wraps (default: the model's "
        "transformers layers or _no_split_modules)",
    )
    parser.add_argument(
        "--lora-r",
        "--lora_r",
        help="estimate LoRA fine-tuning: adapters of this rank on --lora-targets are the only trainable "
        "parameters, the base is frozen",
    )
    parser.add_argument(
        "--lora-targets",
        "--lora_targets",
        default="q_proj,v_proj",
        help="with --lora-r: comma-separated names of the linear layers that get adapters, as peft's "
        "target_modules (q_proj,v_proj)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run_estimate)


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"{flag} {text!r} is invalid: give whole numbers separated by commas, e.g. 1,2,4,8."
        ) from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r} is invalid: every value must be >= 1.")
    return values


def _names(text: str) -> list[str]:
    return [part.strip().lower() for part in text.split(",") if part.strip()]


def _targets(text: str) -> list[str]:
    """Module names as given (peft matches them case-sensitively)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _settings(pairs: list[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {pair!r} is invalid: write KEY=VALUE, e.g. --set hidden_size=256.")
        try:
            settings[key.strip()] = json.loads(value)
        except ValueError:
            settings[key.strip()] = value
    return settings


def run_estimate(args: argparse.Namespace) -> int:
    from lockstep.memory.estimate.formulas import check_choices

    options = {
        "num_processes": _positive_ints(args.num_processes, "--num-processes"),
        "dtypes": _names(args.dtypes),
        "strategies": _names(args.strategies),
        "optimizer": args.optimizer.lower(),
        "batch_size": _positive_ints(args.batch_size, "--batch-size")[0],
        "seq_len": _positive_ints(args.seq_len, "--seq-len")[0],
    }
    check_choices(dtypes=options["dtypes"], strategies=options["strategies"], optimizer=options["optimizer"])
    sizes = {name: getattr(args, name) for name in ("tp", "cp", "dp_shard", "dp_replicate")}
    if any(value is not None for value in sizes.values()):
        from lockstep.memory.estimate.formulas import MeshLayout

        options["layout"] = MeshLayout(
            **{
                name: _positive_ints(value, f"--{name.replace('_', '-')}")[0]
                for name, value in sizes.items()
                if value
            }
        )
    if args.ep_size is not None:
        options["ep_size"] = _positive_ints(args.ep_size, "--ep-size")[0]
    settings = _settings(args.settings)
    policies = _names(args.activation_policies or "")
    input_shape = _positive_ints(args.input_shape, "--input-shape") if args.input_shape else None
    if (input_shape or args.block_class) and not policies:
        raise UsageError(
            "--input-shape and --block-class go with --activation-policies (none, full, op, ...)."
        )
    for name in policies:
        try:
            parse_activation_policy(name, owner="--activation-policies")
        except ValueError as error:
            raise UsageError(str(error)) from None

    from lockstep.memory.estimate import estimate_memory  # imports torch: after the cheap checks
    from lockstep.memory.estimate.model_source import build_model, describe_module
    from lockstep.memory.estimate.policies import policy_estimates

    try:
        source, module = build_model(
            args.model, config_class=args.config_class, settings=settings, model_class=args.model_class
        )
    except ImportError as error:  # transformers missing: one line with the pip command, exit 2
        raise UsageError(str(error)) from None
    description = describe_module(source, module)
    if args.lora_r is not None:
        from lockstep.memory.estimate.adapters import LoraShape, with_lora

        lora = LoraShape(_positive_ints(args.lora_r, "--lora-r")[0], tuple(_targets(args.lora_targets)))
        description = with_lora(description, module, lora)
    estimate = estimate_memory(description, **options)
    if policies:
        kept = policy_estimates(
            module,
            policies=policies,
            batch_size=options["batch_size"],
            seq_len=options["seq_len"],
            input_shape=input_shape,
            block_class=args.block_class,
        )
        estimate = dataclasses.replace(estimate, policies=kept)
    if args.json:
        print(json.dumps(estimate.as_dict(), indent=1))
    else:
        print("\n".join(format_table(estimate)))
    return 0


def human_bytes(count: int | None) -> str:
    """``1.50 GiB``, ``12.0 MiB``...; ``unknown`` for None."""
    if count is None:
        return "unknown"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1000 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(estimate: Any) -> list[str]:
    """The terminal report: the model, the assumptions, then one table per dtype."""
    model, info = estimate.model, estimate.as_dict()["assumptions"]
    lines = [
        f"Model: {model.model_class} from {model.source}: {model.num_parameters:,} parameters "
        f"({model.trainable_parameters:,} trainable{': ' + model.adapters if model.adapters else ''})",
        f"Optimizer: {estimate.optimizer}. Memory per rank (process); ZeRO paper accounting.",
        f"Activations, batch {estimate.batch_size} x seq {estimate.seq_len} per process: {info['activations']}",
    ]
    header = (
        "strategy",
        "procs",
        "parameters",
        "gradients",
        "optimizer",
        "model state",
        "activations",
        "total",
    )
    for dtype in dict.fromkeys(row.dtype for row in estimate.rows):
        mixed = (
            "no mixed precision" if dtype == "fp32" else "mixed precision, fp32 master weights in optimizer"
        )
        lines += ["", f"{dtype} ({mixed})"]
        table = [header]
        for row in (r for r in estimate.rows if r.dtype == dtype):
            table.append(
                (
                    row.layout or row.strategy,
                    str(row.num_processes),
                    *(human_bytes(v) for v in (row.parameters, row.gradients, row.optimizer_state)),
                    human_bytes(row.model_state),
                    human_bytes(row.activations),
                    human_bytes(row.total),
                )
            )
        widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
        for cells in table:
            lines.append(
                "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            )
    lines += ["", "Strategies: " + "; ".join(f"{k} = {v}" for k, v in _STRATEGY_NOTES.items())]
    return lines + _policy_lines(estimate)


def _policy_lines(estimate: Any) -> list[str]:
    if not estimate.policies:
        return []
    lines = [
        "",
        "Activations kept for backward per policy (one forward on the meta device, in the model's dtype; "
        "recomputation adds one block's activations in backward):",
    ]
    header = ("policy", "kept", "on the accelerator", "in CPU memory")
    table = [header] + [
        (k.policy, human_bytes(k.kept), human_bytes(k.on_device), human_bytes(k.offloaded))
        for k in estimate.policies
    ]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    for cells in table:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        )
    return lines
