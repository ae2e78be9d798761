"""``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments``: evaluation by generation, transformers' names and meanings.

With ``predict_with_generate=True`` each evaluation and prediction batch is answered by ``model.generate`` (the
predictions are token ids, padded to the generation length), so ``compute_metrics`` can score text (BLEU,
ROUGE, exact match); the loss is still the model's loss on the labels. Generation settings come, first to
last, from the keyword arguments of :meth:`Seq2SeqTrainer.evaluate`/:meth:`~Seq2SeqTrainer.predict`
(``max_length``, ``num_beams``, any ``generate`` argument), ``generation_max_length``/``generation_num_beams``,
and the model's ``generation_config`` (which ``generation_config=`` replaces).

Example:
    >>> from lockstep import Seq2SeqTrainer, Seq2SeqTrainingArguments
    >>> args = Seq2SeqTrainingArguments(output_dir="runs/t5", predict_with_generate=True, generation_num_beams=2)
    >>> args.generation_max_length is None
    True

Sharded models generate with ``synced_gpus=True`` (FSDP2, ZeRO-3): every process keeps stepping until all
have finished, because each forward gathers parameters from all of them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.backends import GatheredForward
from lockstep.trainer._evaluation import PredictionOutput
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.trainer import Trainer

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]

logger = logging.getLogger(__name__)

DEFAULT_GENERATION_MAX_LENGTH = 20
"""transformers' ``max_length`` of ``generate`` when neither the call nor the model's generation config sets one."""


@dataclass(kw_only=True)
class Seq2SeqTrainingArguments(TrainingArguments):
    """:class:`TrainingArguments` and the settings of evaluation by generation (transformers' names)."""

    sortish_sampler: bool = field(
        default=False,
        metadata={
            "help": "Accepted for transformers' scripts; transformers' Seq2SeqTrainer does not read it."
        },
    )
    predict_with_generate: bool = field(
        default=False,
        metadata={"help": "Evaluate and predict with model.generate, for generative metrics (BLEU, ROUGE)."},
    )
    generation_max_length: int | None = field(
        default=None,
        metadata={"help": "generate's max_length in evaluation (default: the model's generation config's)."},
    )
    generation_num_beams: int | None = field(
        default=None,
        metadata={"help": "generate's num_beams in evaluation (default: the model's generation config's)."},
    )
    generation_config: str | None = field(
        default=None,
        metadata={
            "help": "A GenerationConfig, or a folder or generation_config.json file to load one from, that replaces "
            "the model's generation config."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, least in (("generation_max_length", 1), ("generation_num_beams", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(
                    f"Seq2SeqTrainingArguments({name}={value!r}): give a whole number of at least {least}, or "
                    "None for the model's generation config's value."
                )
        if self.sortish_sampler:
            logger.warning(
                "Seq2SeqTrainingArguments(sortish_sampler=True) has no effect: transformers' Seq2SeqTrainer does "
                "not read it either. Use group_by_length=True to batch examples of similar length."
            )


def load_generation_config(gen_config_arg: Any) -> Any:
    """A ``transformers.GenerationConfig`` from ``generation_config=``: a copy of one, or one loaded from a folder
    or a ``.json`` file; a ValueError naming the problem for anything else or an invalid configuration."""
    from transformers import GenerationConfig

    config = gen_config_arg
    if isinstance(config, GenerationConfig):
        loaded = copy.deepcopy(config)
    elif isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_file():
            loaded = GenerationConfig.from_pretrained(str(path.parent), path.name)
        elif path.is_dir():
            loaded = GenerationConfig.from_pretrained(str(path))
        else:
            raise ValueError(
                f"Seq2SeqTrainingArguments(generation_config={str(config)!r}): no such file or folder. Give a "
                "folder holding generation_config.json, a .json file, or a transformers.GenerationConfig."
            )
    else:
        raise ValueError(
            f"Seq2SeqTrainingArguments(generation_config=...) got {type(config).__name__}; give a folder, a .json "
            "file or a transformers.GenerationConfig."
        )
    try:
        loaded.validate(strict=True)
    except ValueError as error:
        raise ValueError(f"{error}\n\nFix these issues in generation_config= to train your model.") from error
    return loaded


class Seq2SeqTrainer(Trainer):
    """transformers' ``Seq2SeqTrainer``: the :class:`Trainer`, evaluating by ``model.generate`` when
    ``args.predict_with_generate`` is set. Takes the :class:`Trainer`'s arguments."""

    @functools.wraps(Trainer.__init__, assigned=("__doc__",), updated=())
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # wraps: inspect.signature(Seq2SeqTrainer) and help() show the Trainer's parameters, not *args
        super().__init__(*args, **kwargs)
        self._gen_kwargs: dict[str, Any] = {}
        config = getattr(self.args, "generation_config", None)
        if config is not None:
            self.model.generation_config = self.load_generation_config(config)

    load_generation_config = staticmethod(load_generation_config)

    def _generation_kwargs(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's ``generate`` arguments, completed from ``generation_max_length``/``generation_num_beams``."""
        gen_kwargs = dict(gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length:
            gen_kwargs["max_length"] = max_length
        num_beams = getattr(self.args, "generation_num_beams", None)
        if gen_kwargs.get("num_beams") is None and num_beams is not None:
            gen_kwargs["num_beams"] = num_beams
        return gen_kwargs

    def evaluate(
        self,
        eval_dataset: Any | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """:meth:`Trainer.evaluate`; ``gen_kwargs`` (``max_length``, ``num_beams``, ...) go to ``generate``."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """:meth:`Trainer.predict`; ``gen_kwargs`` (``max_length``, ``num_beams``, ...) go to ``generate``."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """``(loss, generated token ids, labels)`` with ``predict_with_generate`` (see
        :meth:`_generated_predictions`); otherwise the Trainer's step."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        generated, labels = self._generated_predictions(inputs, gen_kwargs)
        loss = None
        if isinstance(inputs, Mapping) and "labels" in inputs:
            loss = super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)[0]
        if self.args.prediction_loss_only:
            return loss, None, None
        return loss, generated, labels

    def _generated_predictions(
        self, inputs: Any, gen_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(generated ids, labels)`` of a batch, both padded with the pad token to the generation config's
        ``max_length`` (``max_new_tokens + 1`` when that is set), as transformers pads them."""
        gen_kwargs = {
            key: value for key, value in (gen_kwargs or self._gen_kwargs).items() if value is not None
        }
        gen_kwargs.setdefault("synced_gpus", self._generation_is_collective())
        with self._root_parameters_gathered():
            generated = self.model.generate(**_generation_inputs(inputs), **gen_kwargs)
        width = self._padded_width()
        labels = inputs.get("labels")
        return self._pad_to(generated, width), None if labels is None else self._pad_to(labels, width)

    def _generation_is_collective(self) -> bool:
        """Whether each forward gathers parameters from every process (FSDP2, ZeRO-3): then every process
        must keep generating until all have finished (``synced_gpus``)."""
        gathered = self.accelerator.capability(GatheredForward)
        return gathered is not None and gathered.gathers_in_forward(self.model)

    def _root_parameters_gathered(self) -> contextlib.AbstractContextManager:
        """The parameters sharded with the model's root gathered meanwhile (FSDP2): ``generate`` calls
        submodules (the encoder) directly, not the root's forward, whose hook would gather them; without this
        the embedding meets a sharded weight."""
        gathered = self.accelerator.capability(GatheredForward)
        return contextlib.nullcontext() if gathered is None else gathered.root_parameters_gathered(self.model)

    def _padded_width(self) -> int:
        """The width transformers pads generated ids and labels to (0: no padding)."""
        config = getattr(self.model, "generation_config", None)
        if config is None:
            return 0
        if getattr(config, "_from_model_config", False):
            config._from_model_config = False  # as transformers: generate() has read the model's settings
        max_new_tokens = getattr(config, "max_new_tokens", None)
        if max_new_tokens is not None:
            return max_new_tokens + 1
        return getattr(config, "max_length", None) or DEFAULT_GENERATION_MAX_LENGTH

    def _pad_to(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        return (
            _pad_tensors_to_max_len(tensor, width, self._pad_token_id())
            if tensor.shape[-1] < width
            else tensor
        )

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """``tensor`` padded on the right with the pad token to ``max_length`` columns (transformers' name)."""
        return _pad_tensors_to_max_len(tensor, max_length, self._pad_token_id())

    def _pad_token_id(self) -> int:
        tokenizer = self.processing_class
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is not None:
                return int(pad)
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "Seq2SeqTrainer pads generated ids and labels with the pad token, but neither processing_class "
                "nor model.config has a pad_token_id. Pass processing_class=tokenizer or set model.config.pad_token_id."
            )
        return int(pad)


def _generation_inputs(inputs: Any) -> dict[str, Any]:
    """The batch for ``generate``: without the labels' ``decoder_input_ids`` (those would be teacher forcing)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"Seq2SeqTrainer(predict_with_generate=True) generates from dict batches (mappings); the batch is a "
            f"{type(inputs).__name__}. Use a data collator that returns a dict (e.g. DataCollatorForSeq2Seq)."
        )
    inputs = dict(inputs)
    labels, decoder_ids = inputs.get("labels"), inputs.get("decoder_input_ids")
    if labels is not None and decoder_ids is not None and labels.shape == decoder_ids.shape:
        inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
    return {k: v for k, v in inputs.items() if k != "labels"}


def _pad_tensors_to_max_len(tensor: torch.Tensor, max_length: int, pad_token_id: int) -> torch.Tensor:
    padded = torch.full((tensor.shape[0], max_length), pad_token_id, dtype=tensor.dtype, device=tensor.device)
    padded[:, : tensor.shape[-1]] = tensor
    return padded
