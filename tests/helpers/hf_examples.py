"""What the tests that run transformers' own example scripts share: the pinned upstream copy with the
test's few changes applied, small offline text, and a word-level tokenizer with a tiny GPT-2 or BERT
configuration saved to a folder (``--config_name``/``--tokenizer_name`` of the scripts).

Used by ``tests/e2e/test_no_trainer_scripts.py`` (the ``*_no_trainer.py`` scripts, on Accelerate's API) and
``tests/e2e/test_trainer_scripts.py`` (the Trainer scripts).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

UPSTREAM_REPO = "huggingface/transformers"

Change = tuple[str, str, str]
"""(what upstream has, what runs in the test, why): applied to exactly one occurrence."""


def adapted_script(source: Path, sha256: str, changes: list[Change], folder: Path, *, upstream: str) -> Path:
    """The upstream file ``source`` (checked against ``sha256``) with ``changes`` applied, written to
    ``folder`` under its own name. The upstream files are kept in the repository verbatim, with their
    Apache-2.0 notice (see the README next to each); ``upstream`` is the file's path in transformers' tree."""
    assert source.is_file(), (
        f"{source} is missing: it is {UPSTREAM_REPO}'s {upstream}, kept in the repository"
    )
    text = source.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert digest == sha256, f"{source} is not the pinned upstream file (sha256 {digest}, expected {sha256})"
    for old, new, _why in changes:
        assert text.count(old) == 1, f"{source.name}: expected exactly one {old!r}"
        text = text.replace(old, new)
    target = folder / source.name
    target.write_text(text, encoding="utf-8")
    return target


# -- offline text ------------------------------------------------------------------------------------
SUBJECTS = ["the cat", "a dog", "my friend", "the man", "a bird", "the teacher", "our neighbour", "the child"]
VERBS = ["sees", "likes", "follows", "finds", "paints", "calls", "watches", "helps"]
OBJECTS = ["the ball", "a house", "the river", "an apple", "the moon", "a tree", "the window", "a road"]
TAILS = [
    "this morning",
    "at night",
    "in spring",
    "once again",
    "very slowly",
    "with joy",
    "near home",
    "every day",
]


def sentence(rng: random.Random) -> str:
    """One sentence of 8 words and a full stop: subject, verb, object, when or how."""
    return " ".join(rng.choice(words) for words in (SUBJECTS, VERBS, OBJECTS, TAILS)) + " ."


def sentences(rng: random.Random, count: int) -> str:
    """``count`` sentences, one a line."""
    return "".join(sentence(rng) + "\n" for _ in range(count))


# -- tokenizer and model configuration -----------------------------------------------------------------
def save_model_folder(folder: Path, kind: str, words: list[str]) -> None:
    """A word-level fast tokenizer over ``words`` and a tiny configuration (2 layers, hidden size 32) saved
    to ``folder``: GPT-2 for ``kind="clm"``, BERT (``[CLS] a [SEP] b [SEP]`` pairs) otherwise."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, GPT2Config, PreTrainedTokenizerFast

    specials = ["<|endoftext|>"] if kind == "clm" else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: index for index, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0 if kind == "clm" else 1]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if kind == "clm":
        end = "<|endoftext|>"
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, unk_token=end, bos_token=end, eos_token=end, model_max_length=64
        )
        config = GPT2Config(
            vocab_size=len(vocab),
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            model_max_length=64,
        )
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=0,
        )
    save_tokenizer(fast, folder)
    config.save_pretrained(folder)


def save_tokenizer(fast: Any, folder: Path) -> None:
    """Save a ``PreTrainedTokenizerFast`` that transformers 4.x and 5.x both read.

    transformers 5 names its own tokenizer class (TokenizersBackend), which 4.x cannot read; both read
    PreTrainedTokenizerFast, the class made here."""
    fast.save_pretrained(folder)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(
        json.dumps({**settings, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
    )
