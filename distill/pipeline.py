"""`pagoda distill`: label -> train -> calibrate -> export -> report, each stage resumable.

A stage is skipped when its output already exists in the output folder (labels chunk by chunk,
`work/student.pt`, `work/temperatures.json`, the ONNX files, `report.md`), so rerunning the same
command after an interruption continues where it stopped; `restart_from` deletes one stage's output
and everything after it. With `--shard I/N` (N > 1) only this shard is labelled and the run stops:
labelling is the expensive, embarrassingly parallel part, training needs all of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distill import labels as L
from distill.task import Task, load_task
from laya.layout import answers_digest
from laya.rows import state_text

STAGES = ("label", "train", "calibrate", "export", "report")


@dataclass
class Layout:
    """Where each stage writes, in one place so resume and restart agree on it."""
    out: Path

    @property
    def labels(self) -> Path:
        return self.out / "labels"

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def baseline(self) -> Path:
        return self.out / "baseline-linear"

    def stage_outputs(self, stage: str) -> list[Path]:
        w = self.work
        return {
            "label": [self.labels],
            "train": [w / "student.pt", w / "linear.pkl", w / "history.json"],
            "calibrate": [w / "temperatures.json"],
            "export": [self.out / "model.onnx", self.out / "model.int8.onnx", self.out / "student.json",
                       self.out / "tokenizer.json", self.baseline],
            "report": [self.out / "report.md", self.out / "report.json"] + list(self.out.glob("report-*.png")),
        }[stage]


def resolve_teacher(teacher: str) -> Path:
    if teacher == "default":
        from laya.paths import default_model_dir

        path = default_model_dir()
        if not (path / "rl_agent_config.json").is_file():
            raise FileNotFoundError(f"teacher: the default laya-mini is not built at {path} (run `make model`)")
        return path
    path = Path(teacher)
    if not (path / "rl_agent_config.json").is_file():
        raise FileNotFoundError(f"teacher: {path} is not a Laya checkpoint folder (no rl_agent_config.json)")
    return path


def teacher_fingerprint(path: Path) -> str:
    """Its folder plus `laya.layout.answers_digest`: labels resume only under the teacher that made them."""
    return f"{path.resolve()}@{answers_digest(path)}"


class Run:
    """One distillation run: the task, its data, the output folder and the teacher (loaded on first use)."""

    def __init__(self, task: Task, teacher: str, data: str | Path, out: str | Path, progress: bool = True,
                 eval_data: dict[str, Path] | None = None, eval_gold: dict[str, str] | None = None):
        self.task, self.data, self.progress = task, Path(data), progress
        # Other text the report measures agreement on (e.g. hand-written tickets): never labelled for training.
        self.eval_data = {name: Path(path) for name, path in (eval_data or {}).items()}
        for name, path in self.eval_data.items():
            if not path.is_file():
                raise FileNotFoundError(f"eval_data: {name}={path} does not exist")
        # Their gold columns, per question, where they differ from the task's: accuracy of teacher and students.
        self.eval_gold = dict(eval_gold or {})
        for question in self.eval_gold:
            if question not in task.questions:
                raise ValueError(f"eval_gold: {question!r} is not a question of task {task.name!r} "
                                 f"(has {sorted(task.questions)})")
        # Read now, not after labelling and training: the report is the last stage, and an eval file without rows,
        # not in UTF-8 or without a --eval-gold column was refused only there.
        for name, path in self.eval_data.items():
            columns = L.load_corpus(path, dataclasses.replace(task, gold={}), "--eval-data").column_names
            for question, column in self.eval_gold.items():
                if column not in columns:
                    raise ValueError(f"eval_gold: {question}={column}: column {column!r} is not in eval data "
                                     f"{name}={path} (columns: {sorted(columns)})")
        self.layout = Layout(Path(out))
        self.teacher_dir = resolve_teacher(teacher)
        if task.student.kind == "encoder" and task.student.init == "teacher":
            from distill.modeling_student import check_teacher_init

            s = task.student
            check_teacher_init(self.teacher_dir, max(s.init_layers) + 1 if s.init_layers else s.layers)
        self._agent = None

    @property
    def agent(self):
        if self._agent is None:
            import torch

            import laya

            if self.task.labels.threads:
                torch.set_num_threads(self.task.labels.threads)
            self._agent = laya.load(str(self.teacher_dir))
        return self._agent

    def restart(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"restart_from: unknown stage {stage!r}; stages: {list(STAGES)}")
        for s in STAGES[STAGES.index(stage):]:
            for p in self.layout.stage_outputs(s):
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()

    # -- stage 1 ------------------------------------------------------------------------------------------
    def label(self, shard: tuple[int, int]) -> bool:
        """Label this shard; True when the whole corpus is labelled and training can start."""
        corpus = L.load_corpus(self.data, self.task)
        n_new = L.label(self.task, self.agent if L.missing_chunks(self.layout.labels, len(corpus),
                                                                 self.task.labels.chunk_rows) else None,
                        corpus, self.layout.labels, shard=shard, teacher_id=teacher_fingerprint(self.teacher_dir),
                        progress=self.progress)
        missing = L.missing_chunks(self.layout.labels, len(corpus), self.task.labels.chunk_rows)
        print(f"labels: {n_new} rows labelled now, {len(missing)} chunks missing")
        return not missing

    # -- stages 2-5 read the labelled set ---------------------------------------------------------------------
    def dataset(self) -> dict[str, Any]:
        ds = L.load_labels(self.layout.labels)
        rows = np.asarray(ds[L.ROW])
        split = L.split_of(rows, self.task)
        return {"ds": ds, "split": split, "texts": [state_text(x) for x in ds[self.task.text_field]],
                "targets": L.targets(ds, self.task), "gold": L.gold_indices(ds, self.task)}

    def run(self, shard: tuple[int, int] = (0, 1)) -> Path | None:
        if not self.label(shard):
            print("stopping after labelling: label the missing chunks (other shards), then rerun without --shard")
            return None
        d = self.dataset()
        n = [int((d["split"] == k).sum()) for k in range(3)]
        print(f"split: {n[0]} train, {n[1]} validation, {n[2]} held-out")
        self.train(d)
        self.calibrate(d)
        self.export(d)
        from distill.report import write_report

        if not (self.layout.out / "report.md").exists():
            write_report(self, d)
        print(f"student ready in {self.layout.out}")
        return self.layout.out

    def _part(self, d: dict, k: int) -> tuple[list[str], dict[str, np.ndarray]]:
        sel = np.flatnonzero(d["split"] == k)
        return [d["texts"][i] for i in sel], {q: v[sel] for q, v in d["targets"].items()}

    def train(self, d: dict) -> None:
        w, s = self.layout.work, self.task.student
        w.mkdir(parents=True, exist_ok=True)
        (tr_x, tr_t), (va_x, va_t) = self._part(d, 0), self._part(d, 1)
        if s.kind == "encoder" and not (w / "student.pt").exists():
            from distill import modeling_student, trainer
            from distill.inputs import minilm_ids

            model, history = trainer.train_encoder(self.task, minilm_ids(tr_x, s.max_len), tr_t,
                                                   minilm_ids(va_x, s.max_len), va_t, self.progress,
                                                   teacher=self.teacher_dir)
            modeling_student.save(model, w / "student.pt")
            (w / "history.json").write_text(json.dumps(history, indent=1))
        if (s.kind == "linear" or s.baseline) and not (w / "linear.pkl").exists():
            from distill.linear import fit_linear

            fitted = fit_linear(self.task.heads(), tr_x, tr_t, va_x, va_t, seed=s.seed)
            with open(w / "linear.pkl.tmp", "wb") as f:
                pickle.dump(fitted, f)
            (w / "linear.pkl.tmp").replace(w / "linear.pkl")

    def _val_logits(self, d: dict, kind: str) -> np.ndarray:
        texts, _ = self._part(d, 1)
        if kind == "encoder":
            from distill import modeling_student, trainer
            from distill.inputs import minilm_ids

            model = modeling_student.load(self.layout.work / "student.pt")
            return trainer.predict_logits(model, minilm_ids(texts, self.task.student.max_len))
        from distill.linear import sklearn_logits

        return sklearn_logits(*self._linear(), texts)

    def _linear(self):
        with open(self.layout.work / "linear.pkl", "rb") as f:
            return pickle.load(f)

    def kinds(self) -> list[str]:
        s = self.task.student
        return ["encoder", "linear"] if s.kind == "encoder" and s.baseline else [s.kind]

    def calibrate(self, d: dict) -> None:
        """Per question and student kind, laya's temperature fit on the validation split, then laya's clamp.

        The fit minimises cross-entropy to the teacher's distributions (KL up to a constant). Both the
        raw fit and the applied (clamped) T are kept: a raw T below 0.5 would sharpen the student past
        what the teacher's own calibration allows, which laya refuses for checkpoints too.
        """
        path = self.layout.work / "temperatures.json"
        if path.exists():
            return
        from laya.calibration import clamp_temperature, fit_temperature

        _, va_t = self._part(d, 1)
        temps: dict[str, dict[str, dict[str, float]]] = {}
        for kind in self.kinds():
            logits = self._val_logits(d, kind)
            temps[kind] = {}
            for h in self.task.heads():
                raw = fit_temperature(logits[:, h["offset"]:h["offset"] + h["size"]], va_t[h["name"]])
                temps[kind][h["name"]] = {"temperature": round(clamp_temperature(raw), 4),
                                          "temperature_raw": round(raw, 4)}
            shown = ", ".join(f"{q} {t['temperature']:g} (fit {t['temperature_raw']:g})"
                              for q, t in temps[kind].items())
            print(f"temperatures ({kind}): {shown}")
        path.write_text(json.dumps(temps, indent=1))

    def heads(self, kind: str) -> list[dict]:
        """`task.heads()` with this kind's applied and raw temperatures: student.json's `heads`."""
        temps = json.loads((self.layout.work / "temperatures.json").read_text())[kind]
        return [{**h, **temps[h["name"]]} for h in self.task.heads()]

    def export(self, d: dict) -> None:
        out = self.layout.out
        for kind in self.kinds():
            folder = out if kind == self.task.student.kind else self.layout.baseline
            if (folder / "student.json").exists():
                continue
            folder.mkdir(parents=True, exist_ok=True)
            heads = self.heads(kind)
            held, _ = self._part(d, 2)
            check_texts = held[:self.task.export.check_rows]
            if kind == "encoder":
                from distill import export, modeling_student
                from distill.inputs import minilm_ids, minilm_tokenizer_file

                model = modeling_student.load(self.layout.work / "student.pt")
                export.export_fp32(model, folder / "model.onnx")
                export.quantize_int8(folder / "model.onnx", folder / "model.int8.onnx",
                                     self.task.export.int8_activations)
                shutil.copyfile(minilm_tokenizer_file(), folder / "tokenizer.json")
                rows = minilm_ids(check_texts, self.task.student.max_len)
                checked = export.check(model, folder / "model.onnx", folder / "model.int8.onnx", rows, heads,
                                       self.task.export.tolerance, self.task.export.int8_tolerance)
                models, default, extra = {"int8": "model.int8.onnx", "fp32": "model.onnx"}, "int8", {
                    "encoder": f"all-MiniLM-L6-v2 (first {self.task.student.layers} of 6 layers"
                               + (f", as fine-tuned in the teacher {self.teacher_dir.name})"
                                  if self.task.student.init == "teacher" else ")")}
            else:
                from distill.linear import export as export_linear

                vec, w, b = self._linear()
                export_linear(vec, w, b, folder / "model.onnx")
                checked = self._check_linear(folder / "model.onnx", vec, w, b, check_texts)
                models, default, extra = {"fp32": "model.onnx"}, "fp32", {}
            self._write_student_json(folder, kind, heads, models, default, checked, d, extra)

    def _check_linear(self, path: Path, vec, w, b, texts: list[str]) -> dict[str, float]:
        import onnxruntime as ort

        from distill.export import ExportCheckError
        from distill.inputs import normalise_words
        from distill.linear import sklearn_logits

        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = sess.run(["logits"], {"text": np.array(normalise_words(texts), dtype=object).reshape(-1, 1)})[0]
        diff = float(np.abs(got - sklearn_logits(vec, w, b, texts)).max())
        tol = self.task.export.tolerance
        print(f"export check (linear): max |onnx - scikit-learn| logits = {diff:.2e} (tolerance {tol:.0e})")
        if not diff <= tol:
            raise ExportCheckError(f"export check failed: linear ONNX differs from scikit-learn by {diff:.3e} > {tol:.1e}")
        return {"onnx_vs_sklearn_max_abs_logit": diff}

    def _write_student_json(self, folder: Path, kind: str, heads: list[dict], models: dict, default: str,
                            checked: dict, d: dict, extra: dict) -> None:
        # The reader defines the format the writer must produce.
        from distill.student_folder import FORMAT

        history = self.layout.work / "history.json"
        meta = {
            "format": FORMAT,
            "name": self.task.name,
            "kind": kind,
            "input": "tokens" if kind == "encoder" else "text",
            "models": models,
            "default_precision": default,
            "max_len": self.task.student.max_len,
            "n_logits": sum(h["size"] for h in heads),
            "questions": self.task.questions,
            "heads": heads,
            **({"int8_activations": self.task.export.int8_activations} if "int8" in models else {}),
            "budgets": {"teacher": self.task.budgets, "student_max_len": self.task.student.max_len},
            "provenance": {
                "teacher": str(self.teacher_dir),
                "teacher_digest": answers_digest(self.teacher_dir),  # what a deferring server checks its teacher by
                "task_fingerprint": self.task.fingerprint(),
                "data": str(self.data),
                "rows": {name: int((d["split"] == k).sum()) for k, name in enumerate(("train", "validation", "held_out"))},
                "student": self.task.to_dict()["student"],
                "training": json.loads(history.read_text()) if kind == "encoder" and history.exists() else None,
                "export_check": checked,
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                **extra,
            },
        }
        (folder / "student.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))


def distill(task: str | Path, teacher: str, data: str | Path, out: str | Path, *, shard: str | None = None,
            restart_from: str | None = None, progress: bool = True,
            eval_data: dict[str, Path] | None = None, eval_gold: dict[str, str] | None = None) -> Path | None:
    run = Run(load_task(task), teacher, data, out, progress, eval_data, eval_gold)
    if restart_from:
        run.restart(restart_from)
    return run.run(L.parse_shard(shard))
