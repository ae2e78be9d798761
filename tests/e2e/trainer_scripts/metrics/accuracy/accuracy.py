"""Accuracy as an ``evaluate`` module, for ``evaluate.load("accuracy")`` offline.

transformers' example scripts load the Hub's ``evaluate-metric/accuracy``, which needs the network (and
scikit-learn); ``evaluate.load`` takes a local folder of the same name first, so the test puts this one in the
scripts' working directory. It computes what the Hub's does for plain labels: the fraction of predictions equal
to their reference.
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="The fraction of predictions equal to their reference.",
            citation="",
            inputs_description="predictions, references: lists of integer labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}
