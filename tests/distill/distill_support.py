"""Shared by the distill tests: the tiny task, the corpus size, and running the real `pagoda` CLI."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASK = {
    "name": "tiny-triage",
    "text_field": "text",
    "questions": {
        "department": {"type": "choice", "instructions": "Which department should handle this ticket?",
                       "criteria": {"billing": "invoices, payments, refunds", "technical": "bugs, outages",
                                    "shipping": "deliveries", "account": "login, profile", "other": "everything else"}},
        "urgency": {"type": "score", "instructions": "How urgent is this ticket?",
                    "criteria": ["not urgent", "soon", "blocking"]},
        "churn": {"type": "noul", "instructions": "Does the user threaten to cancel or leave?"},
    },
    "gold": {"department": "department", "urgency": "urgency", "churn": "churn"},
    "labels": {"chunk_rows": 30, "batch_size": 16, "threads": 1},
    "split": {"holdout": 0.25, "validation": 0.15},
    "student": {"layers": 1, "epochs": 2, "max_len": 64, "batch_size": 16, "lr": 3e-4, "threads": 1},
    "export": {"check_rows": 16},
    "report": {"singles": 5, "teacher_singles": 2, "batches": 1, "batch_size": 4},
}
N_TICKETS = 120
HANDWRITTEN = ROOT / "datasets" / "handwritten_tickets.jsonl"   # `--eval-data`: text outside the corpus
# States for the deferral tests: plain and dict states, on which the tiny student is sure of some answers only.
DEFER_STATES = ["Hi, we were billed twice for March. Refund it today or we cancel.",
                "The export button gives error 500 since the update, our whole team is blocked!",
                {"customer": "ACME", "message": "where is my parcel? tracking says delivered"},
                "thanks, all good now",
                "Hello, I cannot log in. Password reset mail never arrives.",
                "can u change the email on my profile pls"]


@contextlib.contextmanager
def torch_threads(n: int):
    """Tests share 2 cores with each other: run the in-process teacher on `n` threads, then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pagoda(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"pagoda {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
