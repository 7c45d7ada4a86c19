"""`pagoda distill` end to end: folder contents, quality vs the teacher, resume, sharding, export check; and
a student of the real laya-mini teacher: int8 keeps fp32's and the teacher's decisions on held-out rows,
and its ONNX encoder answers over HTTP (`pagoda serve --student`) exactly as in-process."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from distill_support import HANDWRITTEN, N_TICKETS, ROOT, TASK, pagoda, torch_threads

from distill import labels as L
from distill.task import parse_task
from laya.calibration import clamp_temperature, ece, metrics
from laya.corpus import noise


def test_student_folder_holds_models_tokenizer_metadata_and_report(student_dir):
    for name in ("model.onnx", "model.int8.onnx", "tokenizer.json", "student.json", "report.md", "report.json",
                 "report-reliability.png", "report-latency.png", "baseline-linear/model.onnx",
                 "baseline-linear/student.json"):
        assert (student_dir / name).is_file(), name
    meta = json.loads((student_dir / "student.json").read_text())
    assert meta["questions"] == TASK["questions"]
    assert [h["name"] for h in meta["heads"]] == ["department", "urgency", "churn"]
    assert [h["size"] for h in meta["heads"]] == [5, 3, 2]
    for h in meta["heads"]:  # laya's clamp on the fit, both recorded
        assert 0.5 <= h["temperature"] <= 5.0
        assert h["temperature"] == round(clamp_temperature(h["temperature_raw"]), 4)
    check = meta["provenance"]["export_check"]
    assert check["fp32_vs_torch_max_abs_logit"] <= 1e-4
    assert check["int8_vs_fp32_max_abs_prob"] <= parse_task(TASK).export.int8_tolerance == 0.05
    assert meta["int8_activations"] == "per-token"
    assert meta["provenance"]["encoder"] == "all-MiniLM-L6-v2 (first 1 of 6 layers)"
    assert (student_dir / "model.int8.onnx").stat().st_size < (student_dir / "model.onnx").stat().st_size / 3
    report = (student_dir / "report.md").read_text()
    for needle in ("agreement", "ECE vs gold", "encoder int8", "linear", "teacher", "1 thread", "b4 p50/state",
                   "T applied (fit)"):
        assert needle in report


def test_student_learns_the_teacher_better_than_uniform(student_dir):
    """Held-out KL to the teacher well below what a know-nothing (uniform) student would score."""
    report = json.loads((student_dir / "report.json").read_text())
    labelled = L.load_labels(student_dir / "labels")
    rows = np.asarray(labelled[L.ROW])
    held = L.split_of(rows, parse_task(TASK)) == 2
    for q, row in report["students"]["encoder fp32"]["questions"].items():
        t = np.asarray(labelled[L.prob_column(q)], dtype=np.float64)[held]
        uniform_kl = float((t * np.log(np.clip(t, 1e-7, 1) * t.shape[1])).sum(-1).mean())
        assert row["kl"] < 0.8 * uniform_kl, (q, row["kl"], uniform_kl)


def test_report_measures_calibration_with_laya_calibration(student_dir):
    """The report's ECE figures are `laya.calibration`'s, recomputed here from the student and its labels."""
    from distill.report import student_probs

    task = parse_task(TASK)
    report = json.loads((student_dir / "report.json").read_text())
    labelled = L.load_labels(student_dir / "labels")
    held = np.flatnonzero(L.split_of(np.asarray(labelled[L.ROW]), task) == 2)
    texts = [labelled[task.text_field][i] for i in held]
    probs, temps = student_probs(student_dir, "fp32", texts)
    gold = L.gold_indices(labelled, task)
    for q, p in probs.items():
        row = report["students"]["encoder fp32"]["questions"][q]
        t = np.asarray(labelled[L.prob_column(q)], dtype=np.float64)[held]
        pick = p.argmax(-1)
        assert row["ece_teacher"] == ece(p.max(-1), t[np.arange(len(p)), pick], 15)
        g = gold[q][held]
        m = metrics(list(p[g >= 0]), list(np.eye(p.shape[1])[g[g >= 0]]))
        assert (row["ece_gold"], row["acc_gold"]) == (m["ece15"], m["accuracy"])
        assert row["temperature"] == temps[q]["temperature"] and row["temperature_raw"] is not None


def test_rerun_resumes_without_relabelling_or_retraining(student_dir, distill_inputs):
    i = distill_inputs
    weights = student_dir / "work" / "student.pt"
    before = weights.stat().st_mtime_ns
    proc = pagoda("distill", "--teacher", str(i["teacher"]), "--task", str(i["task"]), "--data", str(i["data"]),
                  "--out", str(student_dir), "--no-progress")
    assert "labels: 0 rows labelled now" in proc.stdout
    assert weights.stat().st_mtime_ns == before


def test_interrupted_labelling_relabels_only_the_missing_chunk(student_dir, distill_inputs, tmp_path):
    import laya

    task = parse_task(TASK)
    labels = tmp_path / "labels"
    shutil.copytree(student_dir / "labels", labels)
    victim = labels / "chunk-00002.parquet"
    original = L.load_labels(labels)
    victim.unlink()
    corpus = L.load_corpus(distill_inputs["data"], task)
    with torch_threads(1):
        n = L.label(task, laya.load(distill_inputs["teacher"]), corpus, labels,
                    teacher_id=json.loads((labels / "meta.json").read_text())["teacher"], progress=False)
    assert n == TASK["labels"]["chunk_rows"]
    again = L.load_labels(labels)
    for q in TASK["questions"]:
        assert again[L.prob_column(q)] == original[L.prob_column(q)]


def test_shards_label_disjoint_chunks_that_merge_into_the_full_set(student_dir, distill_inputs, tmp_path):
    """Shard 0/2 through the CLI, shard 1/2 in-process; copied together they equal the unsharded labels."""
    import laya

    i = distill_inputs
    out = tmp_path / "shard-0"
    proc = pagoda("distill", "--teacher", str(i["teacher"]), "--task", str(i["task"]), "--data", str(i["data"]),
                  "--out", str(out), "--shard", "0/2", "--no-progress")
    assert "stopping after labelling" in proc.stdout
    assert sorted(p.name for p in (out / "labels").glob("chunk-*")) == ["chunk-00000.parquet", "chunk-00002.parquet"]
    task = parse_task(TASK)
    merged = out / "labels"
    teacher_id = json.loads((merged / "meta.json").read_text())["teacher"]
    with torch_threads(1):
        n = L.label(task, laya.load(i["teacher"]), L.load_corpus(i["data"], task), merged, shard=(1, 2),
                    teacher_id=teacher_id, progress=False)
    assert n == N_TICKETS // 2
    a, b = L.load_labels(merged), L.load_labels(student_dir / "labels")
    assert len(a) == N_TICKETS
    for q in TASK["questions"]:
        assert a[L.prob_column(q)] == b[L.prob_column(q)]


def test_partial_labels_are_refused_naming_missing_chunks(student_dir, tmp_path):
    labels = tmp_path / "labels"
    shutil.copytree(student_dir / "labels", labels)
    (labels / "chunk-00001.parquet").unlink()
    with pytest.raises(ValueError, match=r"incomplete: chunks \[1\]"):
        L.load_labels(labels)


def test_export_check_fails_past_its_tolerance(student_dir):
    from distill import export, modeling_student
    from distill.inputs import minilm_ids

    model = modeling_student.load(student_dir / "work" / "student.pt")
    meta = json.loads((student_dir / "student.json").read_text())
    rows = minilm_ids(["I was billed twice", "the app crashes on start"], 64)
    with pytest.raises(export.ExportCheckError, match="export.tolerance"):
        export.check(model, student_dir / "model.onnx", student_dir / "model.int8.onnx", rows, meta["heads"],
                     tolerance=1e-12, int8_tolerance=1.0)
    with pytest.raises(export.ExportCheckError, match="int8_tolerance"):
        export.check(model, student_dir / "model.onnx", student_dir / "model.int8.onnx", rows, meta["heads"],
                     tolerance=1.0, int8_tolerance=1e-12)


def test_labels_from_another_task_are_not_mixed_in(student_dir, distill_inputs, tmp_path):
    other = parse_task(dict(TASK, questions={"churn": TASK["questions"]["churn"]}, gold={"churn": "churn"}))
    labels = tmp_path / "labels"
    shutil.copytree(student_dir / "labels", labels)
    teacher_id = json.loads((labels / "meta.json").read_text())["teacher"]
    with pytest.raises(ValueError, match=r"existing labels were made with different \['task'\]"):
        L.label(other, None, L.load_corpus(distill_inputs["data"], other), labels, teacher_id=teacher_id,
                progress=False)


def test_a_meta_json_beside_no_chunk_is_rewritten_not_refused(student_dir, distill_inputs, tmp_path):
    """A run that failed before its first chunk left only meta.json: nothing to mix, so a corrected task goes on."""
    other = parse_task(dict(TASK, questions={"churn": TASK["questions"]["churn"]}, gold={"churn": "churn"}))
    labels = tmp_path / "labels"
    labels.mkdir()
    shutil.copy(student_dir / "labels" / "meta.json", labels / "meta.json")
    teacher_id = json.loads((labels / "meta.json").read_text())["teacher"]
    corpus = L.load_corpus(distill_inputs["data"], other)
    L._check_meta(labels, other, corpus, teacher_id)
    assert json.loads((labels / "meta.json").read_text())["task"] == other.fingerprint()


def test_labels_of_a_teacher_rebuilt_in_place_are_not_resumed(student_dir, distill_inputs, tmp_path):
    """The labels record the teacher's folder and a digest of its config and weights: a teacher rebuilt at the
    same path (a new laya-mini head, refitted temperatures) makes resuming fail by name instead of mixing."""
    from distill.pipeline import teacher_fingerprint

    recorded = json.loads((student_dir / "labels" / "meta.json").read_text())["teacher"]
    assert recorded == teacher_fingerprint(Path(distill_inputs["teacher"]))
    teacher, labels = tmp_path / "teacher", tmp_path / "labels"
    shutil.copytree(distill_inputs["teacher"], teacher)
    shutil.copytree(student_dir / "labels", labels)
    before = teacher_fingerprint(teacher)
    meta = json.loads((labels / "meta.json").read_text())
    (labels / "meta.json").write_text(json.dumps({**meta, "teacher": before}))
    task = parse_task(TASK)
    corpus = L.load_corpus(distill_inputs["data"], task)
    assert L.label(task, None, corpus, labels, teacher_id=before, progress=False) == 0      # the same teacher resumes
    config = json.loads((teacher / "rl_agent_config.json").read_text())
    provenance = {**config, "laya_mini": {"fine_tune": {"out": "runs/elsewhere"}}}  # how it was made, not what it says
    (teacher / "rl_agent_config.json").write_text(json.dumps(provenance, indent=3))
    assert teacher_fingerprint(teacher) == before
    config["temperature"] = [t * 1.5 for t in config["temperature"]]
    (teacher / "rl_agent_config.json").write_text(json.dumps(config))
    assert teacher_fingerprint(teacher) != before
    with pytest.raises(ValueError, match=r"existing labels were made with different \['teacher'\]"):
        L.label(task, None, corpus, labels, teacher_id=teacher_fingerprint(teacher), progress=False)


def test_report_measures_agreement_on_the_eval_data_as_the_runtime_and_teacher_answer(student_dir, distill_inputs):
    """`--eval-data handwritten=...`: the report's agreement on those rows is the argmax agreement of what the
    shipped runtime and the teacher answer on them, per question and student variant."""
    import numpy as np

    import laya
    from distill.deferral import Deferral
    from distill.runtime import Student
    from distill.task import load_task

    report = json.loads((student_dir / "report.json").read_text())
    other = report["other_data"]["handwritten"]
    rows = [json.loads(line) for line in HANDWRITTEN.read_text().splitlines() if line.strip()]
    assert other["rows"] == len(rows) == 74 and set(other["students"]) == {"encoder int8", "encoder fp32", "linear"}
    task = load_task(distill_inputs["task"])
    texts = [r["text"] for r in rows]
    with torch_threads(1):
        agent = laya.load(str(distill_inputs["teacher"]))
        teacher = agent.predict_batch(texts, task.questions, batch_size=16)
    int8 = Student(student_dir, precision="int8")
    student = int8.predict_batch(texts)
    def top(answer: dict) -> str:
        probs = answer.get("probabilities") or {"no": 1 - answer["noul"], "yes": answer["noul"]}
        return max(probs, key=probs.get)

    for q in task.questions:
        want = float(np.mean([top(s["answers"][q]) == top(t["answers"][q]) for s, t in zip(student, teacher)]))
        assert other["students"]["encoder int8"][q]["agreement"] == pytest.approx(want, abs=1e-9), q
        # the deferral table: what `--defer-below 0.7` gives on this file, recomputed from the served answers
        with torch_threads(1):
            given = int8.predict_batch(texts, [q], defer=Deferral(agent, {q: 0.7}))
        at = {c["threshold"]: c for c in other["students"]["encoder int8"][q]["deferral"]}[0.7]
        assert at["deferred"] == pytest.approx(np.mean([g["usage"]["deferred_questions"] == [q] for g in given]))
        assert at["agreement"] == pytest.approx(
            np.mean([top(g["answers"][q]) == top(t["answers"][q]) for g, t in zip(given, teacher)]), abs=1e-9), q
    text = (student_dir / "report.md").read_text()
    assert "## Agreement on handwritten (74 rows" in text and "| 0.7 | " in text

    # Accuracy on the file's gold labels, `--eval-gold department=department5` naming the 5-way column.
    assert other["gold_columns"] == {"department": "department5", "urgency": "urgency", "churn": "churn"}
    gold = {"department": [r["department5"] for r in rows], "urgency": [str(r["urgency"]) for r in rows],
            "churn": ["yes" if r["churn"] else "no" for r in rows]}
    for q in task.questions:
        for name, answers in (("teacher", teacher), ("student", student)):
            want = float(np.mean([top(a["answers"][q]) == g for a, g in zip(answers, gold[q])]))
            got = other["teacher"][q] if name == "teacher" else other["students"]["encoder int8"][q]
            assert got["acc_gold"] == pytest.approx(want, abs=1e-9), (name, q)
    assert "| accuracy vs gold |" in (student_dir / "report.md").read_text()

    # Where the two disagree, who matches gold; and the agreement over the rows the teacher gets right.
    for q in task.questions:
        s = [top(a["answers"][q]) for a in student]
        t = [top(a["answers"][q]) for a in teacher]
        differ = [i for i in range(len(rows)) if s[i] != t[i]]
        right = [i for i in range(len(rows)) if t[i] == gold[q][i]]
        want = {"differ": len(differ), "student_right": sum(s[i] == gold[q][i] for i in differ),
                "teacher_right": sum(t[i] == gold[q][i] for i in differ),
                "neither": sum(gold[q][i] not in (s[i], t[i]) for i in differ), "teacher_right_rows": len(right)}
        got = other["students"]["encoder int8"][q]["vs_gold"]
        assert {k: got[k] for k in want} == want, q
        assert got["agreement_teacher_right"] == pytest.approx(np.mean([s[i] == t[i] for i in right]), abs=1e-9), q
    assert "| disagreements: student / teacher / neither right |" in (student_dir / "report.md").read_text()

    # The teacher's agreement with itself: its answer on each row against its answers on edited copies of it,
    # drawn as `pagoda laya-mini eval` draws them (two per row, the fixed seed, meaning-keeping edits only).
    rng = random.Random(noise.EDIT_SEED)
    copies = [noise.perturb(x, rng, texts, noise.SAME_MEANING) for x in texts for _ in range(noise.EDIT_COPIES)]
    assert sum(c != x for c, x in zip(copies, np.repeat(texts, noise.EDIT_COPIES))) > len(rows)
    with torch_threads(1):
        edited = laya.load(str(distill_inputs["teacher"])).predict_batch(copies, task.questions, batch_size=16)
    for q in task.questions:
        want = float(np.mean([top(e["answers"][q]) == top(teacher[i // noise.EDIT_COPIES]["answers"][q])
                              for i, e in enumerate(edited)]))
        assert other["teacher_unchanged_under_edits"][q] == pytest.approx(want, abs=1e-9), q
    name = Path(report["teacher"]["path"]).name
    line = (f"| teacher ({name}) | urgency | {other['teacher_unchanged_under_edits']['urgency']:.3f} | — | — | — | "
            f"{other['teacher']['urgency']['acc_gold']:.3f} | — | — |")
    assert line in (student_dir / "report.md").read_text().splitlines()


def test_an_export_past_its_tolerance_is_one_line_and_keeps_the_earlier_stages(distill_inputs, tmp_path):
    task = tmp_path / "strict.yaml"
    task.write_text(yaml.safe_dump(dict(TASK, export=dict(TASK["export"], int8_tolerance=1e-9)), sort_keys=False))
    out = tmp_path / "strict"
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(task), "--data",
                  str(distill_inputs["data"]), "--out", str(out), "--no-progress", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: export check failed: int8 probabilities differ from fp32" in proc.stderr
    assert (out / "work" / "student.pt").is_file() and not (out / "student.json").exists()


def test_per_tensor_int8_is_onnxruntime_s_dynamic_quantisation(student_dir, tmp_path):
    """`export.int8_activations: per-tensor` is onnxruntime's own quantiser (faster, one scale per call), with
    none of the per-token graph; per-token has none of onnxruntime's per-call quantisation."""
    import onnx

    from distill import export

    per_tensor, per_token = tmp_path / "pt.onnx", tmp_path / "tok.onnx"
    export.quantize_int8(student_dir / "model.onnx", per_tensor, "per-tensor")
    export.quantize_int8(student_dir / "model.onnx", per_token)
    ops = {p: {n.op_type for n in onnx.load(str(p)).graph.node} for p in (per_tensor, per_token)}
    assert "DynamicQuantizeLinear" in ops[per_tensor] and "MatMulIntegerToFloat" not in ops[per_tensor]
    assert "DynamicQuantizeLinear" not in ops[per_token] and "MatMulIntegerToFloat" in ops[per_token]
    with pytest.raises(ValueError, match="export.int8_activations"):
        export.quantize_int8(student_dir / "model.onnx", per_tensor, "per-row")


@pytest.mark.parametrize("flag,value,needle", [
    ("--eval-data", "hw=missing.jsonl", "error: eval_data: hw=missing.jsonl does not exist"),
    ("--eval-gold", "priority=department5", "error: eval_gold: 'priority' is not a question"),
    ("--eval-gold", "department", "error: --eval-gold: expected QUESTION=COLUMN"),
])
def test_bad_eval_flags_are_one_line_naming_them(distill_inputs, tmp_path, flag, value, needle):
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(distill_inputs["task"]), "--data",
                  str(distill_inputs["data"]), "--out", str(tmp_path / "o"), flag, value, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_an_eval_gold_column_a_file_lacks_is_refused_before_labelling(distill_inputs, tmp_path):
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"text": "refund me or I leave"}) + "\n")
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(distill_inputs["task"]), "--data",
                  str(distill_inputs["data"]), "--out", str(tmp_path / "o"), "--eval-data", f"bare={bare}",
                  "--eval-gold", "department=department5", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "eval_gold: department=department5: column 'department5' is not in eval data bare=" in proc.stderr
    assert not (tmp_path / "o" / "labels").exists()  # said before any label was made


def test_eval_data_without_gold_is_measured_against_the_teacher_alone(student_dir, distill_inputs, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(student_dir, out)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("refund me or I leave", "site is down")))
    pagoda("distill", "--teacher", str(distill_inputs["teacher"]), "--task", str(distill_inputs["task"]), "--data",
           str(distill_inputs["data"]), "--out", str(out), "--no-progress", "--restart-from", "report",
           "--eval-data", f"bare={bare}")
    other = json.loads((out / "report.json").read_text())["other_data"]["bare"]
    assert other["rows"] == 2 and other["gold_columns"] == {} and other["teacher"] == {}
    assert set(other["students"]["encoder int8"]) == {"department", "urgency", "churn"}
    assert all("acc_gold" not in m for m in other["students"]["encoder int8"].values())


def test_cli_reports_bad_input_without_a_traceback(distill_inputs, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nquestions: {q: {type: yesno, instructions: hi}}\n")
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(bad), "--data",
                  str(distill_inputs["data"]), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2
    assert "error: task.questions: question 'q': field 'type'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n"), ("header.csv", "text\n")])
def test_a_data_file_without_rows_is_one_line_naming_data(distill_inputs, tmp_path, name, text):
    """An empty --data file was a StopIteration traceback out of `datasets`; a blank one or a header-only CSV
    was its "Instruction 'train' corresponds to no data!", naming neither the flag nor the file."""
    data = tmp_path / name
    data.write_text(text)
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(distill_inputs["task"]), "--data",
                  str(data), "--out", str(tmp_path / "o"), "--no-progress", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"pagoda distill: error: --data: {data} holds no rows"
    assert not (tmp_path / "o").exists()


def test_an_eval_data_file_without_rows_is_refused_before_labelling(distill_inputs, tmp_path):
    """Without --eval-gold the eval files were first read by the report, after labelling, training and export."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(distill_inputs["task"]), "--data",
                  str(distill_inputs["data"]), "--out", str(tmp_path / "o"), "--eval-data", f"e={empty}",
                  "--no-progress", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"pagoda distill: error: --eval-data: {empty} holds no rows"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["latin1.jsonl", "latin1.csv"])
def test_a_data_file_not_in_utf8_is_one_line_naming_data(distill_inputs, tmp_path, name):
    """A JSONL one failed when labelling reached the row, with "'utf-8' codec can't decode byte 0xe9 in position
    178" (a position in pyarrow's string, not in the file); a CSV one was a DatasetGenerationError traceback."""
    rows = [json.loads(line) for line in Path(distill_inputs["data"]).read_text().splitlines()]
    rows[5]["text"] += " caf\u00e9"
    if name.endswith(".csv"):
        lines = ["text"] + [" ".join(r["text"].replace(",", " ").replace('"', " ").split()) for r in rows]
    else:
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    data = tmp_path / name
    data.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))
    offset = data.read_bytes().index(b"caf\xe9") + 3
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(distill_inputs["task"]), "--data",
                  str(data), "--out", str(tmp_path / "o"), "--no-progress", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"pagoda distill: error: --data: {data} is not UTF-8: byte 0xe9 "
                                                    f"at offset {offset} (line {len(lines) - len(rows) + 6}); save it "
                                                    "as UTF-8")
    assert not (tmp_path / "o").exists()


def test_bench_distill_prints_ratios_for_every_variant(student_dir):
    proc = pagoda("bench", "distill", "--student", str(student_dir), "--teacher", "none", "--singles", "5")
    lines = proc.stdout.splitlines()
    assert "baseline (encoder int8)" in lines[0]
    for name in ("encoder int8", "encoder fp32", "linear"):
        rows = [line for line in lines if line.startswith(name)]
        assert len(rows) == 2 and all(line.rstrip().endswith("x") for line in rows), rows


def test_bench_distill_times_deferral_to_the_teacher(student_dir, distill_inputs):
    """`--defer-below 1`: nearly every answer goes to the teacher, so agreement is ~1 and the share ~1; a bad
    threshold is refused by name before anything is timed."""
    proc = pagoda("bench", "distill", "--student", str(student_dir), "--teacher", str(distill_inputs["teacher"]),
                  "--singles", "3", "--defer-below", "1")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("int8 deferred")]
    assert len(rows) == 3 and all(line.rstrip().endswith("x") for line in rows[:2]), proc.stdout
    shares = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert set(shares) == set(TASK["questions"])
    assert all(float(v[1]) >= 0.9 and float(v[3]) >= 0.9 for v in shares.values()), shares
    bad = pagoda("bench", "distill", "--student", str(student_dir), "--defer-below", "churn=2", check=False)
    assert bad.returncode == 2 and "--defer-below: churn: must be a number in [0, 1]" in bad.stderr
    assert "Traceback" not in bad.stderr



# ---- a student of the real teacher ------------------------------------------------------------------------
# The tiny random teacher above answers (nearly) the same option for every ticket, so agreement with it says
# nothing about decisions. laya-mini, the embedded default, routes the synthetic tickets for real (its
# department accuracy is ~1.0), so a student of it has varied decisions for int8 to keep or lose.
# Its student starts from laya-mini's own encoder layers, as the shipped support-triage task's does.
MINI_TASK = dict(TASK, name="mini-triage", student=dict(TASK["student"], epochs=6, lr=1e-3, init="teacher"),
                 labels={"chunk_rows": 40, "batch_size": 16, "threads": 1},
                 report={"singles": 2, "teacher_singles": 1, "batches": 1, "batch_size": 4})
MINI_TICKETS = 160


@pytest.fixture(scope="module")
def mini_student(tmp_path_factory):
    """`pagoda distill --teacher default` (laya-mini) on 160 tickets: about 2 minutes on 2 shared cores."""
    from distill.corpus import write_corpus
    from laya.training import mini

    mini.ensure()  # `--teacher default` is the built laya-mini: a fresh clone has not assembled it yet
    d = tmp_path_factory.mktemp("mini-student")
    (d / "task.yaml").write_text(yaml.safe_dump(MINI_TASK, sort_keys=False))
    data = write_corpus(d / "tickets.jsonl", MINI_TICKETS, seed=7)
    out = d / "mini-triage"
    proc = pagoda("distill", "--teacher", "default", "--task", str(d / "task.yaml"), "--data", str(data),
                  "--out", str(out), "--no-progress")
    assert "student ready" in proc.stdout
    return out


def _held_out(folder, task_dict):
    task = parse_task(task_dict)
    labelled = L.load_labels(folder / "labels")
    held = np.flatnonzero(L.split_of(np.asarray(labelled[L.ROW]), task) == 2)
    texts = [labelled[task.text_field][i] for i in held]
    teacher = {q: np.asarray(labelled[L.prob_column(q)], dtype=np.float64)[held] for q in task_dict["questions"]}
    return texts, teacher


def test_int8_keeps_the_decisions_of_fp32_and_the_teacher_on_held_out_rows(mini_student):
    """What int8 must keep is the decision. On held-out rows its argmax equals fp32's wherever fp32 is not torn
    between two options (top two within 0.02), and its agreement with the teacher is fp32's within one row in
    twenty. The export check's probability tolerance bounds the numbers; this bounds the answers."""
    from distill.fidelity import agreement
    from distill.report import student_probs

    texts, teacher = _held_out(mini_student, MINI_TASK)
    n = len(texts)
    assert n >= 30
    meta = json.loads((mini_student / "student.json").read_text())
    teacher_name = Path(meta["provenance"]["teacher"]).name
    assert meta["provenance"]["encoder"] == f"all-MiniLM-L6-v2 (first 1 of 6 layers, as fine-tuned in the teacher {teacher_name})"
    fp32, _ = student_probs(mini_student, "fp32", texts)
    int8, _ = student_probs(mini_student, "int8", texts)
    for q in MINI_TASK["questions"]:
        top2 = np.sort(fp32[q], axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) >= 0.02
        assert clear.mean() >= 0.5, (q, clear.mean())
        assert agreement(int8[q][clear], fp32[q][clear]) == 1.0, q
        assert agreement(int8[q], fp32[q]) >= 0.95, q
        assert abs(agreement(int8[q], teacher[q]) - agreement(fp32[q], teacher[q])) <= 0.05, q
    # the comparison is about real decisions: the teacher routes held-out tickets to several departments, and
    # both students copy those routes far better than always answering the most common one
    picks = teacher["department"].argmax(-1)
    usual = np.bincount(picks).max() / n
    assert len(set(picks.tolist())) >= 3 and usual <= 0.6, np.bincount(picks)
    for student in (fp32, int8):
        assert agreement(student["department"], teacher["department"]) >= max(0.8, usual + 0.2)


def _server_process():
    """tests/serving's `ServerProcess` (a real `pagoda serve` on a free loopback port), loaded by path: the
    distill tests do not have tests/serving on their import path."""
    spec = importlib.util.spec_from_file_location("serving_support", ROOT / "tests/serving/serving_support.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ServerProcess


def test_onnx_encoder_student_over_http(mini_student, tmp_path):
    """`pagoda serve --student DIR` with the ONNX encoder student (int8, its default precision): every HTTP
    answer equals the in-process runtime's, alone and batched, on held-out tickets."""
    from distill.runtime import Student

    local = Student(mini_student)
    assert local.kind == "encoder" and local.precision == "int8"
    server = _server_process()(tmp_path / "serve.log", ["--student", str(mini_student)]).running()
    try:
        models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert models[0]["kind"] == "student" and models[0]["questions"] == sorted(MINI_TASK["questions"])
        texts, _ = _held_out(mini_student, MINI_TASK)
        for text in texts[:8]:
            r = requests.post(server.url + "/decide", json={"state": text}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["answers"] == local.predict(text)["answers"]
        r = requests.post(server.url + "/decide/batch", json={"states": texts[8:16]}, timeout=60)
        assert r.status_code == 200, r.text
        assert [x["answers"] for x in r.json()["results"]] == [x["answers"] for x in local.predict_batch(texts[8:16])]
        r = requests.post(server.url + "/decide", json={"state": texts[0], "max_len": 32}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "max_len"
    finally:
        assert server.stop() == 0


def test_per_token_rounding_is_the_op_by_op_chain_bit_for_bit():
    """The per-token graph rounds through one `QuantizeLinear` over a [tokens, features] view; its uint8 codes
    must be the divide, round (half to even), shift, clip and cast chain computed in float32, token by token,
    including rows that are all positive, all negative, all zero or carry an outlier."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from distill import export

    rng = np.random.default_rng(0)
    d, n = 24, 8
    w = rng.normal(size=(d, n)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    export._per_token_linears(model)
    model.graph.output.append(helper.make_tensor_value_info("q8.x0.u8", TensorProto.UINT8, ["b", "t", d]))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(size=(3, 5, d)).astype(np.float32)
    x[0, 0] = np.abs(x[0, 0])
    x[0, 1] = -np.abs(x[0, 1])
    x[0, 2] = 0
    x[1, 3, 7] = 300.0
    x[2] = np.round(x[2] * 4) / 4            # values on exact halves of some steps
    y, codes = sess.run(None, {"x": x})
    hi = np.maximum(x.max(-1, keepdims=True), np.float32(0))
    lo = np.minimum(x.min(-1, keepdims=True), np.float32(0))
    step = np.maximum((hi - lo) * np.float32(1 / 255), np.float32(1e-30))
    zp = np.rint(-(lo / step))
    expected = np.clip(np.rint(x / step) + zp, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(codes, expected)
    assert y.shape == (3, 5, n)
    np.testing.assert_allclose(y, x @ w, atol=0.05 * np.abs(x).max(-1, keepdims=True).max())
