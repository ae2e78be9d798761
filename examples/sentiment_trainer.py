"""Fine-tune a pretrained MiniLM on movie-review sentiment with ``lockstep.Trainer`` (no loop to write).

The same task, data, split and model as ``sentiment_loop.py``; the loop, schedule, sharding, evaluation
gathering and checkpoints are the Trainer's. Every ``TrainingArguments`` field is a command-line option
(``--learning_rate 3e-5 --num_train_epochs 2 --bf16 ...``; see ``--help``).

    python examples/sentiment_trainer.py                                        # one process
    lockstep launch --num-processes 2 examples/sentiment_trainer.py             # two processes on CPU
    lockstep launch --num-processes 2 examples/sentiment_trainer.py --limit 400 # a quick smoke run
    lockstep launch --num-processes 2 examples/sentiment_trainer.py --save_strategy steps --save_steps 50 \\
        --resume_from_checkpoint latest                                         # survive restarts
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sentiment_data import (
    add_data_arguments,
    default_model_path,
    encode,
    quiet_transformers,
    read_examples,
    split,
)

from lockstep import EvalPrediction, Trainer, TrainingArguments, set_seed

DEFAULTS = {
    "output_dir": "runs/sentiment_trainer",
    "num_train_epochs": 1,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "learning_rate": 1e-4,
    "weight_decay": 0.01,
    "warmup_ratio": 0.1,
    "logging_steps": 20,
    "save_strategy": "no",
    "seed": 42,
    "ddp_find_unused_parameters": False,  # every MiniLM parameter is used: skip DDP's search for unused ones
}


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description="Fine-tune MiniLM for sentiment with lockstep's Trainer.")
    add_data_arguments(parser)
    args, data_args = TrainingArguments.from_cli_with(parser, defaults=DEFAULTS)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    quiet_transformers()
    model_path = data_args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples, eval_examples = split(read_examples(data_args), data_args, args.seed)
    set_seed(args.seed)  # the new classification head is drawn from the seeded generator
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    trainer = Trainer(
        model,
        args,
        train_dataset=encode(train_examples, tokenizer, data_args.max_length),
        eval_dataset=encode(eval_examples, tokenizer, data_args.max_length),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    accelerator = trainer.accelerator
    accelerator.print(
        f"training on {len(train_examples)} reviews, evaluating on {len(eval_examples)}, "
        f"{accelerator.num_processes} process(es), {len(trainer.get_train_dataloader())} steps per epoch per process"
    )
    started = time.perf_counter()
    trainer.train()
    metrics = trainer.evaluate()
    accelerator.print(
        f"eval accuracy: {metrics['eval_accuracy']:.4f} on {len(eval_examples)} held-out reviews "
        f"({time.perf_counter() - started:.0f} s, {accelerator.num_processes} process(es))"
    )


if __name__ == "__main__":
    main()
