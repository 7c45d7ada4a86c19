import math

import numpy as np

from distill.fidelity import disagreements_vs_gold


def onehot(idx: list[int], k: int = 3) -> np.ndarray:
    return np.eye(k)[idx] * 0.8 + 0.2 / k


def test_disagreements_are_split_by_who_matches_gold_and_rows_without_gold_are_left_out():
    student = onehot([0, 1, 2, 0, 1, 2])
    teacher = onehot([0, 2, 1, 1, 1, 0])
    gold = np.array([0, 1, 1, 2, 1, -1])      # the last row has no gold: its disagreement is not counted
    got = disagreements_vs_gold(student, teacher, gold)
    # rows 1, 2, 3 differ: the student is right on 1, the teacher on 2, neither on 3
    assert {k: got[k] for k in ("differ", "student_right", "teacher_right", "neither")} == \
        {"differ": 3, "student_right": 1, "teacher_right": 1, "neither": 1}
    # the teacher is right on rows 0, 2 and 4; the student agrees with it on 0 and 4
    assert got["teacher_right_rows"] == 3 and math.isclose(got["agreement_teacher_right"], 2 / 3)


def test_no_row_with_a_right_teacher_gives_nan_not_an_error():
    got = disagreements_vs_gold(onehot([0]), onehot([1]), np.array([2]))
    assert got["teacher_right_rows"] == 0 and math.isnan(got["agreement_teacher_right"])
