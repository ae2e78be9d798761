"""Entity-level precision, recall and F1 as an ``evaluate`` module, for ``evaluate.load("seqeval")`` offline.

transformers' ``run_ner.py`` loads the Hub's ``evaluate-metric/seqeval``, which needs the network and the
``seqeval`` package; ``evaluate.load`` takes a local folder of the same name first, so the test puts this one
in the scripts' working directory. It computes what the Hub's module reports with seqeval's default (IOB2
chunks, the conlleval rules: a chunk starts at ``B-`` or at an ``I-`` of another type than the one before):
per entity type and overall, precision, recall, F1 and the number of true entities, and the overall token
accuracy.
"""

import datasets
import evaluate


def _chunks(tags: list[str]) -> set[tuple[str, int, int]]:
    """The (type, first, last) entities of one sentence's IOB2 tags."""
    found, kind, start = set(), None, 0
    for index, tag in enumerate([*tags, "O"]):
        prefix, _, label = tag.partition("-")
        begins = prefix == "B" or (prefix == "I" and label != kind)
        if kind is not None and (prefix == "O" or begins):
            found.add((kind, start, index - 1))
            kind = None
        if begins:
            kind, start = label, index
    return found


def _scores(correct: int, predicted: int, true: int) -> dict[str, float]:
    precision = correct / predicted if predicted else 0.0
    recall = correct / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


class Seqeval(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Entity-level precision, recall and F1 of IOB2 tag sequences, and token accuracy.",
            citation="",
            inputs_description="predictions, references: lists of lists of IOB2 tags",
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions: list[list[str]], references: list[list[str]]) -> dict:
        predicted, true = set(), set()
        for sentence, (guess, gold) in enumerate(zip(predictions, references)):
            predicted |= {(sentence, *chunk) for chunk in _chunks(guess)}
            true |= {(sentence, *chunk) for chunk in _chunks(gold)}
        results: dict = {}
        for kind in sorted({chunk[1] for chunk in true | predicted}):
            mine = {c for c in predicted if c[1] == kind}
            theirs = {c for c in true if c[1] == kind}
            results[kind] = {**_scores(len(mine & theirs), len(mine), len(theirs)), "number": len(theirs)}
        overall = _scores(len(predicted & true), len(predicted), len(true))
        results.update({f"overall_{name}": value for name, value in overall.items()})
        tokens = [(g, t) for guess, gold in zip(predictions, references) for g, t in zip(guess, gold)]
        results["overall_accuracy"] = sum(g == t for g, t in tokens) / len(tokens) if tokens else 0.0
        return results
