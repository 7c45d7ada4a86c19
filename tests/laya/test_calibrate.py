"""Temperature fitting, calibration measures, and `pagoda calibrate` end to end on a tiny checkpoint."""

import json

import numpy as np
import pytest

import laya
from laya.calibration import ece, ece_by_chance, fit_temperature, metrics, option_bucket, softmax
from laya.training.calibrate import Record, calibrate, fit_records, fit_temperatures


def _synthetic(n, k, true_t, qtype=0, seed=0):
    """Logits whose labels are drawn from softmax(logits / true_t): the right temperature is true_t."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        z = rng.normal(0, 3, k)
        y = rng.choice(k, p=softmax(z, true_t))
        out.append(Record(z, np.eye(k)[y], qtype))
    return out


def test_fit_recovers_the_generating_temperature():
    for true_t in (0.7, 2.5):
        assert fit_records(_synthetic(3000, 4, true_t)) == pytest.approx(true_t, rel=0.12)


def test_fit_takes_soft_targets_of_mixed_option_counts():
    """Distillation fits T against a teacher's distribution: the teacher's own T is the optimum."""
    rng = np.random.default_rng(3)
    logits = [rng.normal(0, 2, k) for k in (2, 3, 5) for _ in range(200)]
    teacher = [softmax(z, 1.8) for z in logits]
    assert fit_temperature(logits, teacher) == pytest.approx(1.8, rel=1e-3)
    assert fit_temperature(np.stack(logits[:200]), np.stack(teacher[:200])) == pytest.approx(1.8, rel=1e-3)
    assert fit_temperature([], []) == 1.0


def test_buckets_need_min_examples_and_types_fall_back():
    recs = _synthetic(200, 3, 2.0, qtype=0) + _synthetic(9, 7, 2.0, qtype=0, seed=1) + _synthetic(50, 2, 1.0, qtype=2)
    fit = fit_temperatures(recs, min_bucket=10)
    assert "choice:3-5" in fit.temperature_by_options
    assert "choice:6-10" not in fit.temperature_by_options      # 9 < 10: uses the type's T
    assert fit.counts["choice:6-10"] == 9
    assert fit.temperature[1] == 1.0                              # no score questions: unchanged
    assert fit.lookup(recs[205]) == fit.temperature[0]
    with pytest.raises(ValueError, match="min_bucket"):
        fit_temperatures(recs, min_bucket=0)


def test_fitted_values_are_clamped_but_raw_is_kept():
    fit = fit_temperatures(_synthetic(500, 3, 9.0), min_bucket=10)
    assert fit.temperature[0] == 5.0 and fit.raw["choice"] > 5.0


def test_calibration_measures_on_hand_cases():
    assert ece(np.array([0.9, 0.9, 0.6, 0.6]), np.array([1, 1, 0, 1]), 10) == pytest.approx((2 * 0.1 + 2 * 0.1) / 4)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0]), 15) == 0.0
    assert np.isnan(ece(np.array([]), np.array([]), 15))
    # bins are [lo, hi): 0.5 belongs to the upper of two bins, 1.0 to the last
    assert ece(np.array([0.5, 0.9]), np.array([1, 0]), 2) == pytest.approx(0.2)      # (lo, hi] would give 0.7
    assert ece(np.array([1.0, 0.9]), np.array([1, 1]), 2) == pytest.approx(0.05)
    recs = [Record(np.array([0.0, 0.0]), np.array([1.0, 0.0]), 2)]
    m = metrics([softmax(r.logits) for r in recs], [r.target for r in recs])
    assert m["nll"] == pytest.approx(np.log(2)) and m["brier"] == pytest.approx(0.5)
    assert [option_bucket(k) for k in (2, 3, 5, 6, 10, 11, 200)] == ["2", "3-5", "3-5", "6-10", "6-10", "11+", "11+"]


@pytest.fixture(scope="module")
def calib_data(tmp_path_factory):
    from laya.corpus.build import CorpusConfig, build, write

    cfg = CorpusConfig(seed=1, tickets_train=0, tickets_calib=60, tickets_test=0, tickets_unseen=0,
                       reviews_train=0, reviews_calib=40, reviews_test=0)
    return write(build(cfg), tmp_path_factory.mktemp("calib"), cfg)["calib"]


def test_calibrate_writes_temperatures_report_and_changes_answers(laya_tiny_bert, calib_data, tmp_path):
    out, report = tmp_path / "calibrated", tmp_path / "report"
    fit, ev = calibrate(laya_tiny_bert, str(calib_data), str(out), str(report))
    cfg = json.loads((out / "rl_agent_config.json").read_text())
    assert cfg["temperature"] == [round(t, 4) for t in fit.temperature]
    assert cfg["temperature_by_options"] and all(0.5 <= t <= 5.0 for t in cfg["temperature_by_options"].values())
    assert ev["all"]["after"]["nll"] <= ev["all"]["before"]["nll"] + 1e-9   # fitted on this split: cannot be worse
    md = (report / "calibration.md").read_text()
    assert "ECE15 before" in md and "reliability.png" in md
    assert (report / "reliability.png").stat().st_size > 1000
    assert set(json.loads((report / "calibration.json").read_text())["metrics"]) >= {"all", "type:choice", "type:noul"}
    q = {"d": {"type": "choice", "instructions": "department", "criteria": ["billing", "technical", "other"]}}
    before = laya.load(laya_tiny_bert).predict("we were billed twice", q)["answers"]["d"]["probabilities"]
    after = laya.load(str(out)).predict("we were billed twice", q)["answers"]["d"]["probabilities"]
    assert before != after


def test_a_type_without_held_out_questions_keeps_the_checkpoints_temperatures(laya_tiny_bert, calib_data, tmp_path):
    """A fine-tuned checkpoint calibrated on choices and yes/no questions only: its score temperatures (type and
    buckets) were set to 1.0 and dropped, changing the answer to every score question nobody calibrated."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(laya_tiny_bert, model)
    path = model / "rl_agent_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "temperature": [1.0, 0.646, 1.0],
                                "temperature_by_options": {"score:3-5": 0.7, "choice:2": 1.3}}))
    data = tmp_path / "no_scores.jsonl"
    lines = [line for line in calib_data.read_text().splitlines()
             if all(q["type"] != "score" for q in json.loads(line)["questions"].values())]
    data.write_text("\n".join(lines) + "\n")
    q = {"u": {"type": "score", "instructions": "How urgent is this?", "criteria": ["0", "1", "2"]}}
    before = laya.load(str(model)).predict("we were billed twice", q)["answers"]["u"]["probabilities"]
    fit, _ = calibrate(str(model), str(data), str(tmp_path / "out"), str(tmp_path / "report"))
    written = json.loads((tmp_path / "out" / "rl_agent_config.json").read_text())
    assert written["temperature"][1] == 0.646 and written["temperature_by_options"]["score:3-5"] == 0.7
    assert "choice:2" not in written["temperature_by_options"] or fit.counts.get("choice:2", 0) >= 10  # refitted
    assert fit.kept == ["score"]
    assert "0.646, score:3-5 0.700 (no data: the checkpoint's, kept)" in (tmp_path / "report" / "calibration.md").read_text()
    after = laya.load(str(tmp_path / "out")).predict("we were billed twice", q)["answers"]["u"]["probabilities"]
    assert after == before


def test_cli(laya_tiny_bert, calib_data, tmp_path, capsys):
    from serving.cli import main

    assert main(["calibrate", "--model", laya_tiny_bert, "--data", str(calib_data), "--out", str(tmp_path / "c")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["nll_after"] <= printed["nll_before"] + 1e-9


def test_ece_by_chance_shows_the_upward_bias_of_a_small_sample():
    rng = np.random.default_rng(3)
    conf = rng.uniform(0.5, 1.0, 74)
    hit = (rng.random(74) < conf).astype(float)          # calibrated by construction
    small = ece_by_chance(conf, hit, 10, draws=500)
    assert small == ece_by_chance(conf, hit, 10, draws=500)   # seeded
    assert small["ece"] == ece(conf, hit, 10)
    assert small["calibrated_mean"] > 0.03                # a perfectly calibrated model, yet ECE well above 0
    lo, hi = small["bootstrap_ci95"]
    assert lo < small["calibrated_mean"] < hi
    big_conf = rng.uniform(0.5, 1.0, 20000)
    big = ece_by_chance(big_conf, (rng.random(20000) < big_conf).astype(float), 10, draws=50)
    assert big["calibrated_mean"] < 0.01 and big["ece"] < 0.01


def test_ece_by_chance_tells_real_miscalibration_from_the_sample_size():
    conf = np.full(200, 0.95)
    hit = np.tile([1.0, 0.0], 100)                        # 95% confident, half right
    got = ece_by_chance(conf, hit, 10, draws=300)
    assert got["ece"] == pytest.approx(0.45)
    assert got["calibrated_share"] == 1.0 and got["calibrated_p95"] < 0.1


def test_ece_by_chance_names_itself_on_mismatched_input():
    with pytest.raises(ValueError, match="ece_by_chance"):
        ece_by_chance(np.array([0.9, 0.8]), np.array([1.0]))
    with pytest.raises(ValueError, match="ece_by_chance"):
        ece_by_chance(np.array([]), np.array([]))


def test_cli_names_data_not_in_utf8(laya_tiny_bert, tmp_path, capsys):
    """It was "'utf-8' codec can't decode byte 0xe9 in position 14", naming neither the flag nor the file."""
    from serving.cli import main

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"state": "caf\u00e9"}\n'.encode("latin-1"))
    assert main(["calibrate", "--model", laya_tiny_bert, "--data", str(latin1), "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip() == (f"pagoda calibrate: error: --data: {latin1} is not UTF-8: byte 0xe9 "
                                               "at offset 14 (line 1); save it as UTF-8")
