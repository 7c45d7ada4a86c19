"""The decision API's settings: which model answers, how its batcher shapes passes, what a request may ask.

A section of `ServeConfig` with an empty flag prefix: these flags (`--model`, `--max-queue`, ...) were the
server's only ones before it served more than one API, and operators' scripts use them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from distill.deferral import parse_below, teacher_mismatch
from distill.remote_teacher import RemoteTeacher
from distill.student_folder import read_meta
from laya.paths import default_model_dir
from laya.precision import PRECISION_ENV, PRECISIONS, check_device, requested_precision
from serving.flags import MAX_TORCH_THREADS, Settings, option

SHIPPED_PRESETS = Path(__file__).with_name("presets.yaml")


@dataclass
class DecideConfig(Settings):
    model: str | None = option(None, "Laya checkpoint folder (default: the embedded laya-mini)")
    student: str | None = option(None, "serve a distilled student folder instead of a Laya checkpoint")
    defer_below: str | None = option(None, "with --student: the Laya model (--model, default laya-mini) answers "
                                           "each answer whose answer_confidence is under this; one number for every "
                                           "question or QUESTION=NUMBER,... (docs/distill.md, deferring)")
    defer_to: str | None = option(None, "with --defer-below: the base URL of a Laya server (pagoda serve, or the "
                                        "official laya-serve) whose /v1/systemone/batch takes the unsure answers, "
                                        "instead of a model loaded here")
    defer_model: str | None = option(None, "with --defer-to: the checkpoint a laya-serve answers with (its `model` "
                                           "field; pagoda serve ignores it)")
    defer_timeout_s: float = option(10.0, "with --defer-to: the longest one call to the remote teacher may take; "
                                          "past it the answers stay the student's (usage.deferral_error)",
                                    positive=True)
    defer_max_states: int = option(64, "with --defer-to: most states in one call to the remote teacher (at most "
                                       "its --max-states)", minimum=1)
    defer_cooldown_s: float = option(5.0, "with --defer-to: after the remote teacher seemed down (no connection, a "
                                           "timeout, a 5xx), how long to keep the student's answers without asking",
                                     minimum=0)
    defer_any_teacher: bool = option(False, "with --defer-below: let a Laya model other than the student's own "
                                            "teacher (student.json's provenance.teacher_digest) take its unsure "
                                            "answers; otherwise such a model loaded here is refused at startup, and "
                                            "a --defer-to server's answers whenever it names another checkpoint")
    defer_api_key: str | None = option(None, "with --defer-to: the remote server's API key (environment only)",
                                       env_only=True)
    device: str = option("cpu", "torch device for the Laya model (cpu, cuda, cuda:1, mps)")
    torch_threads: int = option(0, "intra-op threads of the decision model per worker, torch or onnxruntime (0: the "
                                   "runtime's default)", minimum=0, maximum=MAX_TORCH_THREADS)
    precision: str | None = option(None, "decision arithmetic: exact (fp32, the default), int8, bf16 (CPUs with AMX "
                                         "or AVX512-BF16, GPUs) or fast (the best of those this machine has)")
    presets: str = option(str(SHIPPED_PRESETS), "JSON or YAML file of named question sets")
    policy: str | None = option(None, "JSON or YAML file of named rules over answers (returned as `actions`)")
    batching: bool = option(True, "batch questions from concurrent requests into shared forward passes")
    max_batch_questions: int = option(256, "most question rows in one forward pass", minimum=1)
    max_batch_tokens: int = option(65536, "most tokens (rows x padded length) in one forward pass", minimum=1)
    max_wait_ms: float = option(5.0, "how long the model worker may wait for requests still being prepared to "
                                     "join a batch (never when none are)", minimum=0)
    max_queue: int = option(1024, "most states waiting for the model; past it requests get 503", minimum=1)
    max_states: int = option(64, "most states in one /decide/batch request", minimum=1)
    max_questions: int = option(64, "most questions in one request", minimum=1)
    max_options: int = option(100, "most options of one question", minimum=1)
    max_state_chars: int = option(50000, "longest state, in characters of its text", minimum=1)
    max_len_cap: int = option(8192, "largest max_len / head_max_len a request may ask for", minimum=1)
    max_request_rows: int = option(1024, "most question rows (states x questions) in one request; past it 413",
                                   minimum=1)
    max_request_tokens: int = option(131072, "most encoder tokens one request may cost (each state's questions x "
                                             "its longest row, summed over states); past it 413", minimum=1)
    question_cache_mb: float = option(64.0, "memory the question-token cache may hold per worker, in MiB "
                                            "(0: no cache)", minimum=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_queue < self.max_states:
            raise ValueError(f"{self.where('max_queue')} ({self.max_queue}) must be at least "
                             f"{self.where('max_states')} ({self.max_states}), or a full batch request could "
                             "never be queued")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"{self.where('precision')} must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.defer_below is not None and not self.student:
            raise ValueError(f"{self.where('defer_below')} needs --student: it hands a student's unsure answers "
                             "to the Laya model")
        if self.defer_to is not None:
            if self.defer_below is None:
                raise ValueError(f"{self.where('defer_to')} needs --defer-below: it names the server that takes "
                                 "the student's unsure answers")
            if self.model:
                raise ValueError(f"give either --model or {self.where('defer_to')}: one teacher takes the "
                                 "student's unsure answers")
            RemoteTeacher(self.defer_to, timeout_s=self.defer_timeout_s, cooldown_s=self.defer_cooldown_s,
                          max_states=self.defer_max_states, field=self.where("defer_to"))
        elif self.defer_model is not None:
            raise ValueError(f"{self.where('defer_model')} needs --defer-to")
        if self.model and self.student and self.defer_below is None:
            raise ValueError("give either --model or --student, not both (or both with --defer-below: the student "
                             "answers, the model takes its unsure answers)")
        if not self.student or (self.defer_below is not None and self.defer_to is None):  # the device is laya's
            check_device(self.device, self.where("device"))
        for name, marker in (("model", "rl_agent_config.json"), ("student", "student.json")):
            path = getattr(self, name)
            if path and not Path(path).is_dir():
                raise ValueError(f"{self.where(name)} {path}: no such folder")
            if path and not (Path(path) / marker).is_file():  # else the worker fails to boot, with a traceback
                raise ValueError(f"{self.where(name)} {path}: not a {name} folder (no {marker})")
        if self.defer_any_teacher and self.defer_below is None:
            raise ValueError(f"{self.where('defer_any_teacher')} needs --defer-below: it lets the teacher that "
                             "takes the student's unsure answers be another model than the student's own")
        if self.student:  # its student.json is there: checked just above
            meta = read_meta(self.student)
            student_precision(self.precision, meta["models"])
            if self.defer_below is not None:
                parse_below(self.defer_below, meta["questions"], self.where("defer_below"))
                teacher = self.model or default_model_dir()
                if self.defer_to is None and not self.model and not (Path(teacher) / "rl_agent_config.json").is_file():
                    # the worker found it missing as it loaded, and its advice (build laya-mini) needs pagoda[laya]
                    raise ValueError(f"{self.where('defer_below')}: the teacher that takes the unsure answers, the "
                                     f"default laya-mini ({teacher}), is not built here: build it (`make model`, "
                                     f"with pagoda[laya]), give one with --model, or a server's URL with "
                                     f"{self.where('defer_to')}")
                if self.defer_to is None and not self.defer_any_teacher:
                    why = teacher_mismatch(meta, teacher)
                    if why:
                        raise ValueError(f"{self.where('defer_below')}: {why}. Distil the student again from this "
                                         f"teacher (`make student`), or pass {self.where('defer_any_teacher')}")


def student_precision(precision: str | None, models: dict) -> str | None:
    """Which of a student's ONNX models (`models`: student.json's, fp32 and usually int8) a process-wide
    precision names: `exact` its fp32 model, `int8` its int8 one, `fast` int8 where it has one (a linear
    student has fp32 only); it has no bf16 model. Neither the flag nor `$PAGODA_PRECISION` given: None, the
    student's own default (`default_precision`)."""
    if precision is None and not os.environ.get(PRECISION_ENV):
        return None
    requested = requested_precision(precision)
    wanted = {"exact": "fp32", "int8": "int8", "bf16": "bf16", "fast": "int8" if "int8" in models else "fp32"}[requested]
    if wanted not in models:
        raise ValueError(f"precision {requested!r}: this student has {' and '.join(sorted(models))} models only")
    return wanted
