"""Task files: the shipped one loads; every mistake names its field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from distill_support import TASK

from distill.task import load_task, parse_task

SHIPPED = Path(__file__).resolve().parents[2] / "distill" / "tasks" / "support-triage.yaml"


def test_shipped_support_triage_task_loads():
    task = load_task(SHIPPED)
    assert list(task.questions) == ["department", "urgency", "churn"]
    assert [h["size"] for h in task.heads()] == [5, 3, 2]
    assert task.student.kind == "encoder" and task.student.max_len <= 128


def _with(path: str, value):
    raw = copy.deepcopy(TASK)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return raw


@pytest.mark.parametrize("path,value,needle", [
    ("student.kind", "forest", "task.student.kind"),
    ("student.layers", 7, "task.student.layers"),
    ("student.layers", "three", "task.student.layers"),
    ("student.colour", 1, "task.student.colour: unknown field"),
    ("split.holdout", 1.5, "task.split.holdout"),
    ("labels.chunk_rows", 0, "task.labels.chunk_rows"),
    ("labels.threads", 99999, "task.labels.threads: must be from 0 to 1024"),
    ("student.threads", 4096, "task.student.threads: must be from 0 to 1024"),
    ("gold.sentiment", "sentiment", "task.gold.sentiment"),
    ("budgets.temperature", 1, "task.budgets.temperature"),
    ("budgets.max_len", -5, "task.budgets.max_len: must be a positive integer"),
    ("budgets.head_max_len", "abc", "task.budgets.head_max_len: must be a positive integer"),
    ("student.lr", float("inf"), "task.student.lr"),
    ("student.head_lr", 1.0e30, "task.student.lr"),
    ("text_field", "", "task.text_field"),
    ("name", "a/b", "task.name"),
    ("questions.churn.type", "yesno", "question 'churn': field 'type'"),
    ("questions.urgency.criteria", ["only one"], "question 'urgency': field 'criteria'"),
    ("questions.department.instructions", "", "question 'department': field 'instructions'"),
    ("report.singles", 0, "task.report.singles"),
    ("export.int8_activations", "per-row", "task.export.int8_activations"),
    ("student.init", "bert", "task.student.init"),
    ("student.target_temperature", 0, "task.student.target_temperature"),
    ("student.target_temperature", True, "task.student.target_temperature"),
    ("student.target_temperature", 9, "task.student.target_temperature"),
    ("student.question_weights", {"sentiment": 2}, "task.student.question_weights"),
    ("student.question_weights", {"churn": 0}, "task.student.question_weights"),
    ("student.question_weights", {"churn": "2"}, "task.student.question_weights"),
    ("student.question_weights", [2], "task.student.question_weights"),
])
def test_errors_name_the_field(path, value, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        parse_task(_with(path, value))


@pytest.mark.parametrize("picks", [[0, 2], [0, 5, 2], [0, 2, 2], [0, 2, 6], [-1, 2, 5], [0, 2, "5"], [0, 2, True],
                                   "0,2,5"])
def test_init_layers_must_name_as_many_increasing_layers_as_the_student_has(picks):
    raw = _with("student.layers", 3)
    raw["student"]["init_layers"] = picks
    with pytest.raises(ValueError, match=r"task\.student\.init_layers"):
        parse_task(raw)
    raw["student"]["init_layers"] = [0, 2, 5]
    assert parse_task(raw).student.init_layers == [0, 2, 5]


def test_target_temperature_sharpens_each_row_towards_its_answer():
    """T < 1 keeps every row's argmax and raises its weight; T = 1 trains on the teacher's distributions as they are."""
    import numpy as np

    from distill.trainer import sharpen

    t = {"urgency": np.array([[0.47, 0.44, 0.09], [0.2, 0.3, 0.5]], dtype=np.float32), "churn": np.array([[1.0, 0.0]])}
    assert sharpen(t, 1.0) is t
    s = sharpen(t, 0.5)
    np.testing.assert_allclose(s["urgency"][1], np.array([0.04, 0.09, 0.25]) / 0.38, rtol=1e-5)
    assert s["urgency"].dtype == np.float32 and np.allclose(s["urgency"].sum(1), 1)
    assert (s["urgency"].argmax(1) == t["urgency"].argmax(1)).all() and (s["urgency"].max(1) > t["urgency"].max(1)).all()
    np.testing.assert_allclose(s["churn"], [[1.0, 0.0]], atol=1e-12)
    assert parse_task(_with("student.target_temperature", 0.5)).student.target_temperature == 0.5


def test_question_weights_scale_that_questions_part_of_the_loss():
    """A weight w on one question adds (w - 1) x its own loss and leaves the others' parts as they were."""
    import torch

    from distill.trainer import distill_loss

    heads = [{"name": "department", "offset": 0, "size": 2}, {"name": "urgency", "offset": 2, "size": 3}]
    logits = torch.tensor([[0.3, -0.2, 1.0, 0.1, -1.0], [0.0, 0.5, -0.3, 0.2, 0.9]])
    targets = {"department": torch.tensor([[0.7, 0.3], [0.4, 0.6]]),
               "urgency": torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])}
    base = distill_loss(logits, heads, {"urgency"}, targets, 1.0)
    only_u = distill_loss(logits, heads[1:], {"urgency"}, targets, 1.0)
    assert torch.equal(distill_loss(logits, heads, {"urgency"}, targets, 1.0, {}), base)
    assert torch.allclose(distill_loss(logits, heads, {"urgency"}, targets, 1.0, {"urgency": 3.0}), base + 2 * only_u)
    assert parse_task(_with("student.question_weights", {"urgency": 2})).student.question_weights == {"urgency": 2}


def test_unknown_top_level_field_and_missing_questions():
    with pytest.raises(ValueError, match="task.teachr: unknown field"):
        parse_task({**TASK, "teachr": "x"})
    with pytest.raises(ValueError, match="task.questions"):
        parse_task({**TASK, "questions": {}})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="task file"):
        load_task(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_task(bad)
