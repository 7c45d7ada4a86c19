"""The task file: which questions a student answers, over which data field, with which budgets.

A dataclass per section so every knob has one name and one default; `load_task` validates the
YAML once and every error names the field (`task.student.layers: ...`), because a typo in a task
file would otherwise surface an hour later as a shape error halfway through training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from laya.checks import MAX_THREADS
from laya.questions import Question, parse_question

KINDS = ("encoder", "linear")
# `student.init`: where an encoder student's layers start (distill/modeling_student.py, docs/distill.md)
INITS = ("minilm", "teacher")


@dataclass
class LabelConfig:
    batch_size: int = 16        # states per teacher forward
    chunk_rows: int = 256       # rows per Parquet chunk: the unit of resume and of sharding
    max_rows: int = 0           # 0: the whole corpus
    threads: int = 0            # torch threads for the teacher; 0: all cores


@dataclass
class SplitConfig:
    holdout: float = 0.2        # held out for the report, never trained or calibrated on
    validation: float = 0.1     # temperature fitting and model selection
    seed: int = 0


@dataclass
class StudentConfig:
    kind: str = "encoder"
    layers: int = 3             # MiniLM layers kept (1..6)
    # "minilm": the installed all-MiniLM-L6-v2; "teacher": the teacher's own encoder, fine-tuned from it
    # (a BERT-layout Laya checkpoint with MiniLM's geometry, as laya-mini is)
    init: str = "minilm"
    # which of the source's layers start the student's, in order; empty: the first `layers`. Spread picks
    # ([0, 2, 5]) keep the layer that reads the embeddings and the one the teacher's head reads (docs/distill.md)
    init_layers: list[int] = field(default_factory=list)
    max_len: int = 128          # state tokens the student reads
    epochs: int = 3
    batch_size: int = 32
    lr: float = 1e-4
    head_lr: float = 2e-3
    score_weight: float = 1.0   # weight of the expected-value loss on score questions
    # question -> weight of its whole loss (KL, and the expected-value term of a score), 1 for the questions not
    # named: where one question matters more, or trails the others (docs/distill.md)
    question_weights: dict[str, float] = field(default_factory=dict)
    # the teacher's distributions are trained on as softmax(log p / T): below 1 sharpens them towards their argmax
    # (the calibration step still fits the student to the teacher's own distributions: docs/distill.md)
    target_temperature: float = 1.0
    freeze_embeddings: bool = True
    threads: int = 0            # torch threads for training; 0: all cores
    baseline: bool = True       # also fit the linear student so the report carries its row
    seed: int = 0


PER_TOKEN, PER_TENSOR = "per-token", "per-tensor"   # `export.int8_activations` (runtime.PER_TOKEN_INT8 reads it)
INT8_ACTIVATIONS = (PER_TOKEN, PER_TENSOR)


@dataclass
class ExportConfig:
    tolerance: float = 1e-4       # max |ORT fp32 - torch| on logits before export fails
    int8_tolerance: float = 0.05  # max |int8 - fp32| on calibrated probabilities
    check_rows: int = 64
    # "per-token": each token's activations quantised by its own range (faithful to fp32, ~1.4x the time
    # of "per-tensor", onnxruntime's dynamic quantisation with one scale per call: docs/distill.md).
    int8_activations: str = PER_TOKEN


@dataclass
class ReportConfig:
    singles: int = 100          # timed batch-1 calls per student configuration
    teacher_singles: int = 24   # the teacher is slower: fewer calls, same statistics
    batches: int = 4            # timed batch calls per configuration
    batch_size: int = 32        # states per timed batch call


@dataclass
class Task:
    name: str
    questions: dict[str, dict[str, Any]]
    text_field: str = "text"
    gold: dict[str, str] = field(default_factory=dict)          # question -> data column with gold labels
    budgets: dict[str, Any] = field(default_factory=dict)       # passed to the teacher's predict_batch
    labels: LabelConfig = field(default_factory=LabelConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    @cached_property
    def parsed(self) -> dict[str, Question]:
        """The questions as laya parses them (keys, legend, type), once per task."""
        return {name: parse_question(name, qdef) for name, qdef in self.questions.items()}

    def heads(self) -> list[dict[str, Any]]:
        """Where each question's logits sit in the student output (student.json `heads`)."""
        out, offset = [], 0
        for name, q in self.parsed.items():
            out.append({"name": name, "offset": offset, "size": len(q.keys)})
            offset += len(q.keys)
        return out

    def fingerprint(self) -> str:
        """What the labels depend on: the questions and the budgets (not the student's knobs)."""
        blob = json.dumps({"questions": self.questions, "budgets": self.budgets, "text_field": self.text_field},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SECTIONS = {"labels": LabelConfig, "split": SplitConfig, "student": StudentConfig, "export": ExportConfig,
             "report": ReportConfig}
_BUDGETS = ("max_len", "head_max_len")


def _section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ValueError(f"task.{name}: expected a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"task.{name}.{key}: unknown field; known: {sorted(known)}")
        default = getattr(cls(), key)
        want = type(default)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is float and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if type(value) is not want:
            raise ValueError(f"task.{name}.{key}: expected {want.__name__}, got {value!r}")
        values[key] = value
    return cls(**values)


def _check_ranges(t: Task) -> None:
    def need(ok: bool, path: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"task.{path}: {msg}")

    need(t.labels.batch_size >= 1, "labels.batch_size", "must be >= 1")
    need(t.labels.chunk_rows >= 1, "labels.chunk_rows", "must be >= 1")
    need(t.labels.max_rows >= 0, "labels.max_rows", "must be >= 0 (0: all rows)")
    need(0 <= t.labels.threads <= MAX_THREADS, "labels.threads", f"must be from 0 to {MAX_THREADS} (0: all cores)")
    need(0 < t.split.holdout < 1, "split.holdout", "must be in (0, 1)")
    need(0 < t.split.validation < 1 and t.split.holdout + t.split.validation < 1, "split.validation",
         "must be in (0, 1) and leave rows to train on beside split.holdout")
    s = t.student
    need(s.kind in KINDS, "student.kind", f"must be one of {list(KINDS)}, got {s.kind!r}")
    need(s.init in INITS, "student.init", f"must be one of {list(INITS)}, got {s.init!r}")
    need(1 <= s.layers <= 6, "student.layers", "must be between 1 and 6 (all-MiniLM-L6-v2 has 6)")
    bad = {q: w for q, w in s.question_weights.items()
           if q not in t.questions or type(w) not in (int, float) or not 0 < w <= 100}
    need(not bad, "student.question_weights", f"must map questions of the task to numbers in (0, 100], got {bad!r}")
    need(type(s.target_temperature) in (int, float) and 0.1 <= s.target_temperature <= 5, "student.target_temperature",
         f"must be a number in [0.1, 5], got {s.target_temperature!r}")
    need(not s.init_layers or (len(s.init_layers) == s.layers and all(type(i) is int for i in s.init_layers)
                               and list(s.init_layers) == sorted(set(s.init_layers))
                               and 0 <= s.init_layers[0] and s.init_layers[-1] <= 5),
         "student.init_layers", f"must list student.layers ({s.layers}) distinct increasing layer numbers "
         f"in 0..5, got {s.init_layers!r}")
    need(8 <= s.max_len <= 512, "student.max_len", "must be between 8 and 512")
    need(s.epochs >= 1, "student.epochs", "must be >= 1")
    need(s.batch_size >= 1, "student.batch_size", "must be >= 1")
    need(0 < s.lr < 1 and 0 < s.head_lr < 1, "student.lr", "learning rates must be in (0, 1)")
    need(0 <= s.threads <= MAX_THREADS, "student.threads", f"must be from 0 to {MAX_THREADS} (0: all cores)")
    need(t.export.tolerance > 0 and t.export.int8_tolerance > 0, "export.tolerance", "must be > 0")
    need(t.export.check_rows >= 1, "export.check_rows", "must be >= 1")
    need(t.export.int8_activations in INT8_ACTIVATIONS, "export.int8_activations",
         f"must be one of {list(INT8_ACTIVATIONS)}, got {t.export.int8_activations!r}")
    for key in ("singles", "teacher_singles", "batches", "batch_size"):
        need(getattr(t.report, key) >= 1, "report." + key, "must be >= 1")


def parse_task(raw: Any) -> Task:
    if not isinstance(raw, dict):
        raise ValueError(f"task: expected a mapping at the top level, got {type(raw).__name__}")
    known = {f.name for f in fields(Task)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"task.{unknown[0]}: unknown field; known: {sorted(known)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ValueError(f"task.name: expected a non-empty name without '/', got {name!r}")
    questions = raw.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise ValueError("task.questions: expected a non-empty mapping of name -> question definition")
    text_field = raw.get("text_field", "text")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError("task.text_field: expected the name of the data column holding the state text")
    gold = raw.get("gold") or {}
    if not isinstance(gold, dict) or not all(isinstance(v, str) for v in gold.values()):
        raise ValueError("task.gold: expected a mapping of question -> data column")
    for qname in gold:
        if qname not in questions:
            raise ValueError(f"task.gold.{qname}: no such question in task.questions")
    budgets = raw.get("budgets") or {}
    if not isinstance(budgets, dict):
        raise ValueError("task.budgets: expected a mapping")
    for key, value in budgets.items():
        if key not in _BUDGETS:
            raise ValueError(f"task.budgets.{key}: unknown budget; known: {list(_BUDGETS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # checked before any label is made
            raise ValueError(f"task.budgets.{key}: must be a positive integer (tokens), got {value!r}")
    task = Task(name=name, questions=questions, text_field=text_field, gold=dict(gold), budgets=dict(budgets),
                **{sec: _section(sec, cls, raw.get(sec)) for sec, cls in _SECTIONS.items()})
    try:
        task.parsed  # noqa: B018 -- parse (and cache) every question once, naming the bad one
    except ValueError as exc:
        raise ValueError(f"task.questions: {exc}") from None
    _check_ranges(task)
    return task


def load_task(path: str | Path) -> Task:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"task file {path}: not valid YAML: {exc}") from None
    return parse_task(raw)
