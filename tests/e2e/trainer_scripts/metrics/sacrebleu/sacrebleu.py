"""Corpus BLEU as an ``evaluate`` module, for ``evaluate.load("sacrebleu")`` offline.

transformers' ``run_translation.py`` loads the Hub's ``evaluate-metric/sacrebleu``, which needs the network and
the ``sacrebleu`` package; ``evaluate.load`` takes a local folder of the same name first, so the test puts this
one in the script's working directory. It computes what that module computes with its defaults (sacrebleu 2.x's
``corpus_bleu``: the ``13a`` tokenizer, n-grams up to 4, ``exp`` smoothing, case-sensitive, the closest
reference length for the brevity penalty) and returns the same keys. Written here from BLEU's definition
(Papineni et al., 2002) and sacrebleu's documented choices; checked equal to sacrebleu 2.6.0's scores on the
translation script's data (see ``tests/e2e/trainer_scripts/README.md``).
"""

import math
import re
from collections import Counter

import datasets
import evaluate

MAX_ORDER = 4
_PUNCTUATION = [  # mteval-v13a's rules, in order
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),  # most punctuation apart
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),  # a period or comma not after a digit
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),  # ... or not before one
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),  # a dash after a digit
]


def tokenize_13a(line: str) -> str:
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        for entity, text in (("&quot;", '"'), ("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">")):
            line = line.replace(entity, text)
    line = f" {line} "
    for pattern, replacement in _PUNCTUATION:
        line = pattern.sub(replacement, line)
    return " ".join(line.split())


def _ngrams(words: list[str]) -> Counter:
    return Counter(
        tuple(words[i : i + n]) for n in range(1, MAX_ORDER + 1) for i in range(len(words) - n + 1)
    )


def corpus_bleu(predictions: list[str], references: list[list[str]]) -> dict:
    """``references[k][i]``: the k-th reference of prediction i (sacrebleu's layout)."""
    correct, totals = [0] * MAX_ORDER, [0] * MAX_ORDER
    sys_len = ref_len = 0
    for index, prediction in enumerate(predictions):
        words = tokenize_13a(prediction).split()
        refs = [tokenize_13a(stream[index]).split() for stream in references]
        sys_len += len(words)
        ref_len += min((abs(len(ref) - len(words)), len(ref)) for ref in refs)[1]  # the closest length
        most = Counter()
        for ref in refs:
            most |= _ngrams(ref)
        for gram, count in _ngrams(words).items():
            correct[len(gram) - 1] += min(count, most[gram])
        for n in range(1, MAX_ORDER + 1):
            totals[n - 1] += max(0, len(words) - n + 1)
    precisions = [0.0] * MAX_ORDER
    brevity = 1.0 if sys_len >= ref_len else (math.exp(1 - ref_len / sys_len) if sys_len > 0 else 0.0)
    if not any(correct):  # no match at all: 0, as sacrebleu stops early
        return _result(0.0, correct, totals, precisions, brevity, sys_len, ref_len)
    smooth = 1.0
    for n in range(MAX_ORDER):  # "exp" smoothing: each n-gram order without a match halves the next guess
        if totals[n] == 0:
            break
        if correct[n] == 0:
            smooth *= 2
            precisions[n] = 100.0 / (smooth * totals[n])
        else:
            precisions[n] = 100.0 * correct[n] / totals[n]
    logs = [math.log(p) if p > 0 else -9999999999 for p in precisions]
    score = brevity * math.exp(sum(logs) / MAX_ORDER)
    return _result(score, correct, totals, precisions, brevity, sys_len, ref_len)


def _result(
    score: float, correct: list, totals: list, precisions: list, bp: float, sys_len: int, ref_len: int
):
    return {
        "score": score,
        "counts": correct,
        "totals": totals,
        "precisions": precisions,
        "bp": bp,
        "sys_len": sys_len,
        "ref_len": ref_len,
    }


class Sacrebleu(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Corpus BLEU with sacrebleu's default settings.",
            citation="",
            inputs_description="predictions: list of strings; references: a list of reference strings for each",
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string", id="sequence"),
                    "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                }
            ),
        )

    def _compute(self, predictions: list[str], references: list[list[str]]) -> dict:
        counts = {len(refs) for refs in references}
        if len(counts) != 1:
            raise ValueError("sacrebleu needs the same number of references for every prediction")
        per_prediction = counts.pop()
        streams = [[refs[k] for refs in references] for k in range(per_prediction)]
        return corpus_bleu(predictions, streams)
