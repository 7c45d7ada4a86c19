"""One small student distilled end to end through `pagoda distill`, shared by the distill tests.

Teacher: a tiny random Laya checkpoint (laya.testing); data: 120 synthetic tickets; student: one
MiniLM layer, two epochs. The whole build is a few tens of seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import yaml
from distill_support import HANDWRITTEN, N_TICKETS, TASK, pagoda


@pytest.fixture(scope="session")
def distill_inputs(tmp_path_factory, laya_checkpoint):
    from distill.corpus import write_corpus

    d = tmp_path_factory.mktemp("distill-inputs")
    task = d / "task.yaml"
    task.write_text(yaml.safe_dump(TASK, sort_keys=False))
    data = write_corpus(d / "tickets.jsonl", N_TICKETS, seed=5)
    return {"teacher": laya_checkpoint(), "task": task, "data": data}


@pytest.fixture(scope="session")
def student_dir(tmp_path_factory, distill_inputs):
    out = tmp_path_factory.mktemp("student") / "tiny-triage"
    i = distill_inputs
    proc = pagoda("distill", "--teacher", str(i["teacher"]), "--task", str(i["task"]), "--data", str(i["data"]),
                  "--out", str(out), "--no-progress", "--eval-data", f"handwritten={HANDWRITTEN}",
                  "--eval-gold", "department=department5")
    assert "student ready" in proc.stdout
    return out
