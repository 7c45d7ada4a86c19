"""The onnxruntime graph against the torch module it replaces on CPU: same tensors, same answers, every
encoder shape the graph claims (ModernBERT local/global attention, BERT, 0/1/2 head layers, F16/F32/BF16
weights), the unsupported ones sent to torch, and int8 close to exact while staying deterministic."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_support import torch_agent

import laya
from laya.layout import read_parts
from laya.onnx_graph import EncoderSpec, LayaGraph
from laya.scenarios import load as scenario
from laya.weights import SafeTensors

STATE, QUESTIONS = scenario("billing")
STATES = [STATE, STATE * 6, ["user: hi", "user: I want to cancel"], {"plan": "pro", "ticket": "refund"}]


def _outputs(agent, states):
    rows = [r for s in states for r in agent.prepare(s, QUESTIONS).rows]
    return agent.forward(rows)


@pytest.mark.parametrize("spec", [
    {"arch": "modernbert", "head_layers": 0},
    {"arch": "modernbert", "head_layers": 2, "local_attention": 16},
    {"arch": "bert", "head_layers": 2, "dtype": "f32"},
    {"arch": "bert", "head_layers": 0},
], ids=lambda s: "-".join(str(v) for v in s.values()))
def test_graph_matches_the_torch_module(laya_checkpoint, spec):
    path = laya_checkpoint(**spec)
    ours, ref = laya.load(path), torch_agent(path)
    assert ours.plan.backend == "onnxruntime"
    for a, b in zip(_outputs(ours, STATES), _outputs(ref, STATES)):
        assert np.abs(a.logits - b.logits).max() < 1e-4
        assert np.abs(a.act_probabilities - b.act_probabilities).max() < 1e-5


def test_bf16_weights_are_read_as_stored(laya_checkpoint, tmp_path):
    import torch

    from laya.checkpoint import load_checkpoint, save_checkpoint

    model, tok, cfg = load_checkpoint(laya_checkpoint(arch="modernbert"))
    save_checkpoint(str(tmp_path / "bf16"), model, tok, cfg, dtype=torch.bfloat16)
    assert SafeTensors(tmp_path / "bf16" / "model.safetensors").dtype("type_emb.weight") == "BF16"
    for a, b in zip(_outputs(laya.load(tmp_path / "bf16"), STATES), _outputs(torch_agent(str(tmp_path / "bf16")),
                                                                              STATES)):
        assert np.abs(a.logits - b.logits).max() < 1e-4


@pytest.mark.parametrize("spec", [{"arch": "modernbert", "head_layers": 2}, {"arch": "bert", "head_layers": 0}])
def test_tensor_list_is_the_modules_state_dict(laya_checkpoint, spec):
    """The graph checks a checkpoint against its own list of tensors; it must be LayaModel's exactly."""
    from laya.checkpoint import load_checkpoint

    path = laya_checkpoint(**spec)
    config, encoder_config, _, weights = read_parts(path)
    graph = LayaGraph(SafeTensors(weights), EncoderSpec.from_config(encoder_config), config)
    model = load_checkpoint(path)[0]
    assert graph.tensor_shapes() == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_unsupported_encoder_runs_on_torch_and_int8_is_refused(laya_checkpoint):
    path = laya_checkpoint(arch="bert", encoder_overrides={"position_embedding_type": "relative_key"})
    with pytest.warns(RuntimeWarning, match="relative_key"):
        agent = laya.load(path)
    assert agent.plan.backend == "torch" and "fallback" in agent.plan.reason
    assert agent.predict(STATE, QUESTIONS)["answers"]
    with pytest.raises(ValueError, match="precision 'int8'.*relative_key"):
        laya.load(path, precision="int8")


def test_int8_is_close_to_exact_and_reports_its_scheme(laya_tiny_modernbert):
    exact, int8 = laya.load(laya_tiny_modernbert), laya.load(laya_tiny_modernbert, precision="int8")
    desc = int8.engine.describe()
    assert desc["precision"] == "int8" and desc["int8"]["activations"] == "per token, 8-bit"
    gaps = [np.abs(softmax(a.logits) - softmax(b.logits)).max()
            for a, b in zip(_outputs(exact, STATES), _outputs(int8, STATES))]
    assert 0 < max(gaps) < 0.1, gaps     # a real change of arithmetic, and a small one


def test_weights_are_memory_mapped_views(laya_tiny_bert):
    st = SafeTensors(f"{laya_tiny_bert}/model.safetensors")
    name = "encoder.embeddings.word_embeddings.weight"
    view = st.float32(name)
    assert st.dtype(name) == "F32" and not view.flags.owndata and not view.flags.writeable
    from safetensors.numpy import load_file

    assert np.array_equal(view, load_file(f"{laya_tiny_bert}/model.safetensors")[name])
    offset, length, shape = st.span(name, slice(2, 5))
    assert shape == (3, view.shape[1]) and length == 3 * view.shape[1] * 4
    with open(f"{laya_tiny_bert}/model.safetensors", "rb") as f:
        f.seek(offset)
        assert np.array_equal(np.frombuffer(f.read(length), np.float32).reshape(shape), view[2:5])


def test_encoder_spec_defaults_for_configs_without_layer_types():
    """Configs written by transformers 4 carry global/local rope thetas and no layer_types."""
    spec = EncoderSpec.from_config({"model_type": "modernbert", "hidden_size": 64, "num_attention_heads": 2,
                                    "num_hidden_layers": 4, "intermediate_size": 96, "vocab_size": 10,
                                    "global_attn_every_n_layers": 2, "global_rope_theta": 1000.0,
                                    "local_attention": 8})
    assert spec.layer_types == ("full_attention", "sliding_attention") * 2
    assert spec.rope_theta == {"full_attention": 1000.0, "sliding_attention": 10000.0} and spec.window == 4
    with pytest.raises(ValueError, match="activation"):
        EncoderSpec.from_config({**json.loads(json.dumps({"model_type": "bert", "hidden_size": 8,
                                 "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8,
                                 "vocab_size": 5})), "hidden_act": "quick_gelu"})


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_chunked_calls_change_no_bit(laya_tiny_modernbert, monkeypatch, precision):
    """Rows are run in chunks of `chunk_tokens` tokens; where the cuts fall must not matter."""
    agent = laya.load(laya_tiny_modernbert, precision=precision)
    rows = [r for s in STATES * 3 for r in agent.prepare(s, QUESTIONS).rows]
    monkeypatch.setattr(agent.engine, "chunk_tokens", 10**6)     # one run over all rows
    whole = agent.forward(rows)
    monkeypatch.setattr(agent.engine, "chunk_tokens", 150)
    for a, b in zip(whole, agent.forward(rows)):
        assert np.array_equal(a.logits, b.logits) and np.array_equal(a.act_probabilities, b.act_probabilities)


def test_chunks_grow_with_threads_up_to_the_cap():
    from laya.packing import MAX_TOKENS, TOKENS_PER_THREAD, chunk_tokens

    assert chunk_tokens(1) == TOKENS_PER_THREAD and chunk_tokens(2) == 2 * TOKENS_PER_THREAD
    assert chunk_tokens(64) == MAX_TOKENS and chunk_tokens(0) >= TOKENS_PER_THREAD
