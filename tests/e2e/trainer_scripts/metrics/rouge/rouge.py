"""ROUGE as an ``evaluate`` module, for ``evaluate.load("rouge")`` offline.

transformers' ``run_summarization.py`` loads the Hub's ``evaluate-metric/rouge``, which needs the network and
Google's ``rouge_score`` package; ``evaluate.load`` takes a local folder of the same name first, so the test puts
this one in the script's working directory. It computes what that module computes, by ``rouge_score``'s
documented rules (Lin, 2004): texts lowercased, every run of characters other than ``a-z0-9`` a separator,
with ``use_stemmer`` NLTK's Porter stemmer (its default mode, as rouge_score) on tokens longer than 3 characters;
ROUGE-N from clipped n-gram overlaps, ROUGE-L from the longest common subsequence, ROUGE-Lsum from the
union of each reference sentence's LCS with the prediction's sentences (sentences separated by newlines); the
F-measure of each; with several references the best F-measure. One deliberate difference: the Hub's module
aggregates with a random bootstrap (the median of 1,000 resampled means); this one returns the plain mean,
which that median approximates, so that two runs on the same predictions give the same number.
"""

import re
from collections import Counter
from typing import Any

import datasets
import evaluate

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_SEPARATORS = re.compile(r"[^a-z0-9]+")


def tokenize(text: str, stemmer: Any = None) -> list[str]:
    tokens = [token for token in _SEPARATORS.sub(" ", text.lower()).split() if token]
    if stemmer is not None:
        tokens = [stemmer.stem(token) if len(token) > 3 else token for token in tokens]
    return tokens


def _fmeasure(overlap: int, predicted: int, target: int) -> float:
    precision = overlap / predicted if predicted else 0.0
    recall = overlap / target if target else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_n(target: list[str], prediction: list[str], n: int) -> float:
    grams = [
        Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1)) for words in (target, prediction)
    ]
    overlap = sum((grams[0] & grams[1]).values())
    return _fmeasure(overlap, sum(grams[1].values()), sum(grams[0].values()))


def _lcs_table(reference: list[str], candidate: list[str]) -> list[list[int]]:
    table = [[0] * (len(candidate) + 1) for _ in range(len(reference) + 1)]
    for i, word in enumerate(reference, 1):
        for j, other in enumerate(candidate, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if word == other else max(table[i - 1][j], table[i][j - 1])
    return table


def _lcs_positions(reference: list[str], candidate: list[str]) -> list[int]:
    """The positions in ``reference`` of one longest common subsequence, found backwards as rouge_score does."""
    table, positions = _lcs_table(reference, candidate), []
    i, j = len(reference), len(candidate)
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            positions.insert(0, i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return positions


def rouge_l(target: list[str], prediction: list[str]) -> float:
    if not target or not prediction:
        return 0.0
    return _fmeasure(_lcs_table(target, prediction)[-1][-1], len(prediction), len(target))


def rouge_lsum(targets: list[list[str]], predictions: list[list[str]]) -> float:
    """Summary-level LCS: each reference sentence's union of LCS hits over the prediction's sentences, each
    token counted at most as often as it occurs on both sides."""
    target_length, predicted_length = sum(map(len, targets)), sum(map(len, predictions))
    if not target_length or not predicted_length:
        return 0.0
    left_target, left_predicted = Counter(), Counter()
    for sentence in targets:
        left_target.update(sentence)
    for sentence in predictions:
        left_predicted.update(sentence)
    hits = 0
    for sentence in targets:
        union = sorted(set().union(*(_lcs_positions(sentence, other) for other in predictions)))
        for token in (sentence[i] for i in union):
            if left_predicted[token] > 0 and left_target[token] > 0:
                hits += 1
                left_predicted[token] -= 1
                left_target[token] -= 1
    return _fmeasure(hits, predicted_length, target_length)


def score(target: str, prediction: str, rouge_type: str, stemmer: Any = None) -> float:
    if rouge_type == "rougeLsum":
        sentences = [[tokenize(s, stemmer) for s in text.split("\n")] for text in (target, prediction)]
        return rouge_lsum(*sentences)
    words = tokenize(target, stemmer), tokenize(prediction, stemmer)
    if rouge_type == "rougeL":
        return rouge_l(*words)
    return rouge_n(*words, int(rouge_type[5:]))


class Rouge(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures, by rouge_score's rules.",
            citation="",
            inputs_description="predictions: list of strings; references: a string or a list of strings for each",
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence")),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[Any],
        rouge_types: list[str] | None = None,
        use_aggregator: bool = True,
        use_stemmer: bool = False,
        tokenizer: Any = None,
    ) -> dict:
        if tokenizer is not None:
            raise NotImplementedError(
                "this local rouge module tokenizes as rouge_score does; tokenizer= is not supported"
            )
        stemmer = None
        if use_stemmer:
            from nltk.stem import porter

            stemmer = porter.PorterStemmer()
        types = list(rouge_types or ROUGE_TYPES)
        scores = {rouge_type: [] for rouge_type in types}
        for prediction, reference in zip(predictions, references):
            targets = reference if isinstance(reference, list) else [reference]
            for rouge_type in types:
                scores[rouge_type].append(max(score(t, prediction, rouge_type, stemmer) for t in targets))
        if use_aggregator:
            return {key: sum(values) / len(values) if values else 0.0 for key, values in scores.items()}
        return scores
