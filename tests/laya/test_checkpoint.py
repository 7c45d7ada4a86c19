"""Official-layout save/load round trips, config round trips, and the row builder's budget rules."""

import json

import pytest
import torch

import laya
from laya.checkpoint import load_checkpoint, save_checkpoint
from laya.config import LayaConfig
from laya.questions import parse_questions
from laya.rows import MIN_INSTRUCTION_TOKENS, MIN_TOKENS_PER_OPTION, Budgets, build_rows


def test_config_round_trip_keeps_unknown_keys():
    raw = {"encoder": "x", "head_layers": 1, "act_costs": {"ask": 0.1}, "temperature": [1, 2, 3],
           "training": {"epochs": 3}, "fine_tuned": True}
    cfg = LayaConfig.from_dict(raw)
    assert cfg.n_act == 2 and cfg.max_len == 512 and cfg.head_max_len == 192
    assert {k: v for k, v in cfg.to_dict().items() if k in raw} == raw
    with pytest.raises(ValueError, match="temperature"):
        LayaConfig.from_dict({"temperature": [1.0]})
    with pytest.raises(ValueError, match="option_layout"):
        LayaConfig.from_dict({"option_layout": "parallel"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_load_round_trip(laya_tiny_modernbert, tmp_path, dtype):
    model, tok, cfg = load_checkpoint(laya_tiny_modernbert)
    save_checkpoint(tmp_path / "copy", model, tok, cfg, dtype=dtype)
    again, _, cfg2 = load_checkpoint(str(tmp_path / "copy"))
    assert cfg2.to_dict() == cfg.to_dict()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert b.dtype == torch.float32 and torch.equal(a, b), name   # the source is F16, so F16 is lossless too
    state, q = "refund please", {"q": {"type": "noul", "instructions": "Refund?"}}
    assert laya.load(tmp_path / "copy").predict(state, q) == laya.load(laya_tiny_modernbert).predict(state, q)


def test_encoder_config_bytes_do_not_name_the_transformers_release(laya_tiny_modernbert, tmp_path):
    """A checkpoint rebuilt from the same seed must be the same bytes under any transformers release (the
    golden fixtures pin them): the `transformers_version` stamp is left out, and transformers still reads
    the file as the same config."""
    from transformers import AutoConfig

    model, tok, cfg = load_checkpoint(laya_tiny_modernbert)
    save_checkpoint(tmp_path / "copy", model, tok, cfg)
    text = (tmp_path / "copy" / "encoder" / "config.json").read_text()
    assert "transformers_version" not in json.loads(text) and text.endswith("}\n")
    again = AutoConfig.from_pretrained(tmp_path / "copy" / "encoder").to_diff_dict()
    before = model.encoder.config.to_diff_dict()
    again.pop("transformers_version", None), before.pop("transformers_version", None)
    assert again == before


def test_head_max_len_below_its_floors_is_clamped_not_refused(laya_tiny_modernbert):
    """By design, not by accident: the official runtime keeps the instructions at least 8 tokens and each option 4
    (its [MASK] and 3) whatever `head_max_len` says, and its goldens (head_max_len 24, 30 with many options) hold
    us to the same rows; docs/laya.md and the OpenAPI description say so. Only `max_len` is a hard bound."""
    tok = laya.load(laya_tiny_modernbert).tokenizer
    long = "Which of these departments should handle the message, given everything it says about billing"
    qs = parse_questions({"q": {"type": "choice", "instructions": long,
                                "criteria": {n: "a long description of what this desk handles " * 3
                                             for n in ("billing", "technical", "sales")}}})
    (row,) = build_rows(tok, "word", qs, Budgets(max_len=200, head_max_len=1))
    head = row.markers[-1] + MIN_TOKENS_PER_OPTION + 1          # through the [SEP] closing the options
    assert row.markers[0] == 1 + MIN_INSTRUCTION_TOKENS + 1      # [CLS], 8 instruction tokens, [SEP]
    assert row.tokens_per_option == MIN_TOKENS_PER_OPTION
    assert head == 1 + MIN_INSTRUCTION_TOKENS + 1 + 3 * MIN_TOKENS_PER_OPTION + 1 > 1
    assert row.input_ids[head - 1] == tok.sep_token_id


def test_row_budget_rules(laya_tiny_modernbert):
    tok = laya.load(laya_tiny_modernbert).tokenizer
    qs = parse_questions({"q": {"type": "choice", "instructions": "Pick one", "criteria": ["alpha", "beta"]}})
    state = " ".join(["word"] * 300)
    (row,) = build_rows(tok, state, qs, Budgets(max_len=100, head_max_len=64))
    assert row.n_tokens == 100 and row.input_ids[0] == tok.cls_token_id and row.input_ids[-1] == tok.sep_token_id
    assert [row.input_ids[m] for m in row.markers] == [tok.mask_token_id] * 2
    head_end = row.n_tokens - row.state_tokens_used - 2          # the [SEP] closing the options
    assert row.input_ids[head_end] == tok.sep_token_id and head_end > row.markers[-1]
    assert row.state_tokens_dropped == row.state_tokens - row.state_tokens_used > 0
    chat = [f"turn {i}" for i in range(80)]
    (left,) = build_rows(tok, chat, qs, Budgets(max_len=60))
    kept = tok.tokenizer.decode(left.input_ids[left.markers[-1]:])
    assert "79" in kept and '"turn 0"' not in kept        # chat lists keep their newest turns
    (right,) = build_rows(tok, json.dumps(chat), qs, Budgets(max_len=60))
    assert "79" not in tok.tokenizer.decode(right.input_ids)   # strings keep their start
