"""SQuAD v1.1's exact match and F1 as an ``evaluate`` module, for ``evaluate.load("squad")`` offline.

``run_qa.py`` loads the Hub's ``evaluate-metric/squad``, which needs the network; ``evaluate.load`` takes a
local folder of the same name first, so the test puts this one in the script's working directory. The
definitions are SQuAD v1.1's (Rajpurkar et al., 2016): answers are compared after lower-casing and removing
punctuation, the articles a/an/the and extra white space; per question the best score over its reference
answers counts; both scores are percentages over the questions.
"""

import collections
import re
import string

import datasets
import evaluate


def _normalize(text: str) -> str:
    text = "".join(character for character in text.lower() if character not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _f1(prediction: str, reference: str) -> float:
    predicted, expected = _normalize(prediction).split(), _normalize(reference).split()
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


class Squad(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        answers = datasets.Sequence(
            {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
        )
        return evaluate.MetricInfo(
            description="SQuAD v1.1 exact match and F1.",
            citation="",
            inputs_description="predictions: {id, prediction_text}; references: {id, answers}",
            features=datasets.Features(
                {
                    "predictions": {
                        "id": datasets.Value("string"),
                        "prediction_text": datasets.Value("string"),
                    },
                    "references": {"id": datasets.Value("string"), "answers": answers},
                }
            ),
        )

    def _compute(self, predictions: list[dict], references: list[dict]) -> dict[str, float]:
        predicted = {p["id"]: p["prediction_text"] for p in predictions}
        exact, f1 = 0.0, 0.0
        for reference in references:
            prediction = predicted[reference["id"]]
            texts = reference["answers"]["text"]
            exact += max(float(_normalize(prediction) == _normalize(text)) for text in texts)
            f1 += max(_f1(prediction, text) for text in texts)
        return {"exact_match": 100.0 * exact / len(references), "f1": 100.0 * f1 / len(references)}
