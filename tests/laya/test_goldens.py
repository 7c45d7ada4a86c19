"""Answers match the official runtime (laya 0.4.15) on checkpoints rebuilt from their seeds.

`tests/fixtures/laya/goldens.json` was produced by `make fixtures` (see make_goldens.py there). Each case
holds the official JSON (`expected`, 4 decimals) and the same call's unrounded floats (`expected_raw`).
The raw floats are the real check, at RAW_TOL: the two runtimes' float32 (and F16-weight) arithmetic
differs by at most 3.8e-6 over every raw float (measured on this machine, 1 and 2 torch threads), and
RAW_TOL = 2e-5 leaves 5x headroom over that while staying 5x below one rounding step (1e-4), so neither a
machine's last-bit noise nor a drift that 4 decimals would round away can pass by luck. The rounded
JSON is checked for shape and types, its floats at most one rounding step (plus RAW_TOL) apart: a
value on a rounding boundary may legitimately print differently.
"""

import json
import math
import sys
import warnings
from pathlib import Path

import pytest

import laya

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "laya"
GOLDENS = json.loads((FIXTURES / "goldens.json").read_text(encoding="utf-8"))
ROUNDED_TOL = 1e-4          # one step of the official 4-decimal rounding
RAW_TOL = 2e-5              # 5x the observed max |ours - theirs| (3.8e-6) over every raw float


@pytest.fixture(scope="module")
def agents(laya_checkpoint):
    sys.path.insert(0, str(FIXTURES))
    from make_goldens import digests

    out = {}
    for name, spec in GOLDENS["checkpoints"].items():
        path = laya_checkpoint(**spec["args"])
        assert digests(path) == spec["sha256"], f"laya.testing no longer rebuilds checkpoint {name!r} byte for byte"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # the bert spec ships out-of-range temperatures
            out[name] = laya.load(path)
    return out


def assert_close(ours, theirs, where="$", tol=ROUNDED_TOL + RAW_TOL):
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{where}: keys {list(ours) if isinstance(ours, dict) else ours} != {list(theirs)}"
        for k in theirs:
            assert_close(ours[k], theirs[k], f"{where}.{k}", tol)
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{where}: {ours!r} != {theirs!r}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_close(a, b, f"{where}[{i}]", tol)
    elif isinstance(theirs, float) and not isinstance(theirs, bool):
        assert isinstance(ours, (int, float)) and math.isclose(ours, theirs, abs_tol=tol), \
            f"{where}: {ours!r} != {theirs!r}"
    else:
        assert ours == theirs and type(ours) is type(theirs), f"{where}: {ours!r} != {theirs!r}"


def _choice_is_near_tie(answer, tol):
    top = sorted(answer["probabilities"].values(), reverse=True)
    return len(top) > 1 and top[0] - top[1] <= tol


def _adopt_tied_choices(ours, expected, tol):
    """The argmax of two options within `tol` of each other is not a disagreement."""
    for o, e in zip(ours if isinstance(ours, list) else [ours], expected if isinstance(expected, list) else [expected]):
        for name, answer in e["answers"].items():
            if answer["type"] == "choice" and _choice_is_near_tie(answer, tol):
                o["answers"][name]["choice"] = answer["choice"]


def _unrounded(monkeypatch):
    """Our answers without their 4-decimal rounding: the same switch make_goldens.py flips in the official
    runtime (`round(x, ndigits)` in the answer module becomes float(x); `round(x)` keeps its meaning)."""
    import builtins

    import laya.answers

    monkeypatch.setattr(laya.answers, "round", lambda x, ndigits=None: builtins.round(x) if ndigits is None
                        else float(x), raising=False)


def _call(agents, case):
    agent = agents[case["checkpoint"]]
    call = agent.predict if case["call"] == "predict" else agent.predict_batch
    return call(case["state"], case["questions"], **case["kwargs"])


CASES = [c for c in GOLDENS["cases"] if "error" not in c]


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=[c["id"] for c in GOLDENS["cases"]])
def test_matches_official_runtime(agents, case):
    if "error" in case:
        with pytest.raises(ValueError, match="question '[^']+': field 'max_len'"):
            _call(agents, case)
        return
    ours = _call(agents, case)
    _adopt_tied_choices(ours, case["expected"], ROUNDED_TOL)
    assert_close(ours, case["expected"])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_raw_floats_match_official_runtime(agents, case, monkeypatch):
    _unrounded(monkeypatch)
    ours = _call(agents, case)
    _adopt_tied_choices(ours, case["expected_raw"], RAW_TOL)
    assert_close(ours, case["expected_raw"], tol=RAW_TOL)


def _floats(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _floats(v)
    elif isinstance(x, list):
        for v in x:
            yield from _floats(v)
    elif isinstance(x, float):
        yield x


def test_raw_goldens_are_unrounded_and_agree_with_the_rounded_json():
    """`expected_raw` really is the unrounded run of the same calls: rounding it gives `expected` exactly,
    and it is not itself rounded (a regenerated fixture that lost the switch would fail here)."""
    raw = [f for c in CASES for f in _floats(c["expected_raw"])]
    rounded = [f for c in CASES for f in _floats(c["expected"])]
    assert len(raw) == len(rounded) > 500
    assert [round(f, 4) for f in raw] == rounded
    assert sum(f != round(f, 4) for f in raw) > 0.9 * len(raw)


def test_goldens_cover_the_issue_list():
    ids = {c["id"] for c in GOLDENS["cases"]}
    for needed in ("dict_state", "chat_state", "long_string_keeps_start", "long_chat_keeps_end",
                   "two_and_twelve_options", "noul_labels", "option_order", "budgets_small",
                   "min_confidence", "empty_questions", "head_cut_collapses", "batch"):
        assert needed in ids
    collapsed = [c for c in GOLDENS["cases"] if isinstance(c.get("expected"), dict)
                 and "options" in c["expected"]["usage"]]
    assert collapsed, "no golden exercises usage.options (collapsed option spans)"
