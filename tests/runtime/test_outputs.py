"""The multi-label decision rule (``capserve.runtime.outputs``: a label is answered when its probability is at or above
its threshold), the same in every place a user meets it: ``capserve evaluate``, the bf16/int8 agreement checks and the
HTTP service, down to a probability exactly equal to its threshold; and threshold calibration's ties."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.inprocess import in_process_service
from support.models import tiny_model
from support.server import encode, export

from capserve.evaluate.metrics import THRESHOLD_GRID, fit_thresholds, multi_label_metrics
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import (
    answer_options,
    labels_passed,
    multi_label_decisions,
    sigmoid,
    thresholds_or_default,
)
from capserve.runtime.precision import agreement, decisions

ROOT = Path(__file__).resolve().parents[2]


def logit(p: float) -> float:
    return float(np.log(p / (1 - p)))


def metadata(labels: int, thresholds: tuple[float, ...] | None = None) -> ModelMetadata:
    return ModelMetadata(
        name="m",
        task="multi_label",
        labels=tuple(str(c) for c in range(labels)),
        in_channels=3,
        image_size=36,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
        iterations=None,
        thresholds=thresholds,
    )


# ------------------------------------------------------------------------------------------ the rule


def test_a_probability_equal_to_its_threshold_passes():
    probabilities = np.array([[0.25, 0.5, 0.75]], np.float32)
    np.testing.assert_array_equal(labels_passed(probabilities, np.array([0.25, 0.5, 0.75])), [[True, True, True]])
    below = np.nextafter(probabilities.astype(np.float64), 2)  # each threshold one step above its probability
    np.testing.assert_array_equal(labels_passed(probabilities, below[0]), [[False, False, False]])
    # a float32 probability as the service writes it (JSON) and a client sends it back as a threshold
    p = sigmoid(np.array([[0.3137]], np.float32))[0, 0]  # float32, not a round decimal
    sent_back = json.loads(json.dumps({"p": float(p)}))["p"]
    assert labels_passed(np.array([p]), sent_back).all()
    assert not labels_passed(np.array([p]), float(np.nextafter(sent_back, 1))).any()


def test_default_thresholds_are_one_half_each():
    np.testing.assert_array_equal(thresholds_or_default(None, 3), [0.5, 0.5, 0.5])
    assert thresholds_or_default((0.3, 0.7), 2).dtype == np.float64


def test_a_tie_at_the_default_threshold_decides_the_same_in_evaluation_and_checks():
    """logit 0 is probability 0.5 exactly, the default threshold: the label is answered, so an image holding both
    labels with logits [0, 2] is an exact match for ``capserve evaluate`` and what the service answers."""
    logits, targets = torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, 1.0]])
    assert multi_label_metrics(logits, targets, None)["exact_match"] == 1.0
    assert multi_label_metrics(logits, targets, None)["f1"] == [1.0, 1.0]
    np.testing.assert_array_equal(multi_label_decisions(logits.numpy(), None), [[True, True]])
    meta = metadata(2)
    np.testing.assert_array_equal(decisions(logits.numpy(), meta), [[True, True]])  # bf16/int8 checks
    # a candidate whose logit 0 moved just below zero has changed the decision
    assert agreement(logits.numpy(), np.array([[-1e-6, 2.0]], np.float32), meta) == 0.0
    # and with stored thresholds, a logit exactly at one's logit passes too
    at = np.array([[logit(0.75), 0.0]], np.float32)
    p = sigmoid(at)[0, 0]
    np.testing.assert_array_equal(multi_label_decisions(at, (float(p), 0.6)), [[True, False]])


# ------------------------------------------------------------------------------------------ calibration ties


def test_calibration_ties_on_a_separable_class_go_to_the_threshold_nearest_one_half():
    """A class whose positives all score above its negatives: every threshold between them has F1 = 1, and the
    docstring's tie rule picks the one nearest 0.5 (0.5 itself when it is among them)."""
    positives, negatives = 6, 6
    rows = []
    for p_a, p_b, p_c in [(0.9, 0.97, 0.3)] * positives + [(0.1, 0.72, 0.1)] * negatives:
        rows.append([logit(p_a), logit(p_b), logit(p_c)])
    logits = torch.tensor(rows, dtype=torch.float32)
    # class a: F1 = 1 for thresholds in (0.1, 0.9], 0.5 among them; class b: in (0.72, 0.97], nearest 0.5 is 0.75;
    # class c: positives at 0.3 above negatives at 0.1, F1 = 1 on (0.1, 0.3], nearest 0.5 is 0.3
    targets = torch.tensor([[1, 1, 1]] * positives + [[0, 0, 0]] * negatives, dtype=torch.float32)
    assert fit_thresholds(logits, targets) == (0.5, 0.75, 0.3)
    assert multi_label_metrics(logits, targets, fit_thresholds(logits, targets))["exact_match"] == 1.0
    # one step either side of a grid edge: negatives just above 0.75 move class b's choice to 0.8
    rows = [[logit(0.9), logit(0.97), logit(0.3)]] * positives + [[logit(0.1), logit(0.76), logit(0.1)]] * negatives
    assert fit_thresholds(torch.tensor(rows, dtype=torch.float32), targets)[1] == 0.8
    rows = [[logit(0.9), logit(0.97), logit(0.3)]] * positives + [[logit(0.1), logit(0.74), logit(0.1)]] * negatives
    assert fit_thresholds(torch.tensor(rows, dtype=torch.float32), targets)[1] == 0.75


def test_a_fitted_threshold_decides_exactly_as_calibration_scored_it():
    """Positives exactly at a float32 grid value (a probability a hair below the decimal 0.7), negatives below the
    next step: the stored threshold must score in evaluation what calibration scored it, the best F1 any grid value
    reaches there (calibrating in float32 chose 0.7, which evaluation then answered for no positive)."""
    at = float(np.float32(THRESHOLD_GRID[13]))  # 0.7 as a float32 probability: below the decimal 0.7
    rows = [[logit(at)]] * 5 + [[logit(0.66)]] * 5
    logits = torch.tensor(rows, dtype=torch.float32)
    targets = torch.tensor([[1.0]] * 5 + [[0.0]] * 5)
    thresholds = fit_thresholds(logits, targets)
    best = max(multi_label_metrics(logits, targets, (t,))["f1"][0] for t in THRESHOLD_GRID)
    assert multi_label_metrics(logits, targets, thresholds)["f1"][0] == pytest.approx(best), thresholds


# ------------------------------------------------------------------------------------------ through the service

# the multi-label model's logits, whatever the image: a CNN whose classifier has no weights, only these biases
CONSTANT_LOGITS = (0.0, 2.0, 0.3137, -1.2345, 0.7071, -0.05, 1.5, -2.25, 0.999, -0.6)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs")
    model = tiny_model("multimnist-cnn-avgpool-small")  # no stored thresholds: 0.5 each
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(CONSTANT_LOGITS))
    multi = export(model, tmp / "constant", explain=False)
    with in_process_service(
        tmp,
        CAPSERVE_MODEL=str(ROOT / "models" / "cifar10"),
        CAPSERVE_MULTILABEL_MODEL=str(multi),
        CAPSERVE_MAX_BATCH_SIZE="1",
    ) as client:
        yield client


IMAGE = encode(np.random.default_rng(0).integers(0, 256, (36, 36, 3), dtype=np.uint8))


def test_the_service_answers_a_label_whose_probability_ties_its_threshold(service):
    r = service.post("/multilabel", content=IMAGE, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["probabilities"]["0"] == 0.5 and body["thresholds"]["0"] == 0.5  # logit 0: the tie
    expected = [str(c) for c in np.argsort(-np.array(CONSTANT_LOGITS), kind="stable") if CONSTANT_LOGITS[c] >= 0]
    assert [label["label"] for label in body["labels"]] == expected and "0" in expected


def test_a_threshold_equal_to_a_returned_probability_answers_that_label(service):
    """``/multilabel?threshold=P`` with P one of the probabilities the same image got back: float32 probabilities
    written to JSON and read back are the same number, and at or above is answered."""
    first = service.post("/multilabel", content=IMAGE, headers={"content-type": "image/png"}).json()
    for label, p in first["probabilities"].items():
        r = service.post(
            "/multilabel", params={"threshold": repr(p)}, content=IMAGE, headers={"content-type": "image/png"}
        )
        assert r.status_code == 200, r.text
        answered = {a["label"] for a in r.json()["labels"]}
        assert label in answered, (label, p, r.json())
        assert answered == {name for name, q in first["probabilities"].items() if q >= p}
        assert r.json()["threshold"] == p


def test_one_check_of_top_k_and_threshold_for_the_service_and_predict():
    """``answer_options``: no top_k is "up to 5", never more than the labels; an explicit one outside 1..labels is
    refused, except by a multi-label answer, which takes none; a threshold outside (0, 1) is refused."""
    assert [answer_options(n)[0] for n in (2, 3, 5, 10)] == [2, 3, 5, 5]
    assert answer_options(10, top_k=7, threshold=0.3) == (7, 0.3)
    assert answer_options(3, top_k=3) == (3, None)
    for top_k in (0, 4):
        with pytest.raises(ValueError, match=rf"^top_k={top_k} but the model has 3 labels: give 1\.\.3$"):
            answer_options(3, top_k=top_k)
    assert answer_options(3, top_k=9, multi_label=True) == (3, None)
    for threshold in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="threshold must be in"):
            answer_options(3, threshold=threshold, multi_label=True)
