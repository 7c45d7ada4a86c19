"""The Agent API others build on: load, predict, the prepare/forward/finish split, batching, determinism.

Every engine is held to the same determinism: onnxruntime exact and int8 (the CPU paths), the packed bf16
engine (CPUs with bf16 units) and the torch module (GPUs, fallback), each bit-identical on repeat and
whatever shares a forward.
"""

import pytest
from engine_support import torch_agent

import laya
from laya.scenarios import load as scenario
from laya.testing import packed_bf16_agent

STATE, QUESTIONS = scenario("billing")


@pytest.fixture(scope="module", params=[(arch, engine) for arch in ("modernbert", "bert")
                                        for engine in ("exact", "int8", "bf16", "torch")], ids=lambda p: "-".join(p))
def agent(request, laya_tiny_modernbert, laya_tiny_bert):
    arch, engine = request.param
    path = laya_tiny_modernbert if arch == "modernbert" else laya_tiny_bert
    if engine in ("torch", "bf16"):
        return torch_agent(path) if engine == "torch" else packed_bf16_agent(path)
    return laya.load(path, precision=engine)


def test_predict_shape(agent):
    out = agent.predict(STATE, QUESTIONS)
    assert out["model"] == "laya-rl-agent"
    a = out["answers"]
    assert set(a) == set(QUESTIONS)
    assert a["department"]["choice"] in QUESTIONS["department"]["criteria"]
    assert abs(sum(a["department"]["probabilities"].values()) - 1) < 1e-3
    assert 0 <= a["urgency"]["score"] <= 2
    assert set(a["urgency"]["legend"]) == {"0", "1", "2"}
    assert 0 <= a["churn_risk"]["noul"] <= 1
    assert out["usage"]["input_tokens"] > 0 and out["usage"]["truncated"] is False


def test_split_equals_predict_and_repeat_is_bit_identical(agent):
    p = agent.prepare(STATE, QUESTIONS)
    assert len(p.rows) == 3 and all(r.n_tokens == len(r.input_ids) for r in p.rows)
    assert agent.finish(p, agent.forward(p.rows)) == agent.predict(STATE, QUESTIONS)
    o1, o2 = agent.forward(p.rows), agent.forward(p.rows)
    assert all((a.logits == b.logits).all() and (a.act_probabilities == b.act_probabilities).all()
               for a, b in zip(o1, o2))


def test_rows_from_many_requests_share_one_forward(agent):
    states = [STATE, {"customer": "ACME", "text": "server down"}, ["user: hi", "user: cancel my plan"],
              "short", STATE * 8]
    prepared = [agent.prepare(s, QUESTIONS) for s in states]
    rows = [r for p in prepared for r in p.rows]
    outs = agent.forward(rows)
    alone = [agent.forward(p.rows) for p in prepared]
    flat = [o for group in alone for o in group]
    for a, b in zip(outs, flat):
        assert (a.logits == b.logits).all() and (a.act_probabilities == b.act_probabilities).all()


def test_predict_batch_identical_to_predict(agent):
    states = [STATE, "The server is down", ["hello", "I was charged twice"], {"a": 1}, STATE * 5]
    single = [agent.predict(s, QUESTIONS) for s in states]
    for batch_size in (1, 2, 32):
        for sort in (True, False):
            assert agent.predict_batch(states, QUESTIONS, batch_size=batch_size, sort_by_length=sort) == single


def test_empty_questions(agent):
    assert agent.predict(STATE, {}) == {"model": "laya-rl-agent", "answers": {},
                                        "usage": {"input_tokens": 0, "output_tokens": 0}}


def test_default_model_missing_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_LAYA_MINI", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="pagoda laya-mini build"):
        laya.load()


@pytest.mark.parametrize("threads", [0, 1025])  # not 99999: the old code ran it
def test_load_refuses_a_thread_count_torch_cannot_run(laya_tiny_bert, threads):
    """It was taken, and torch or onnxruntime then segfaulted or hung; refused before anything loads, naming the
    argument, with the bound every --threads has (`laya.checks.MAX_THREADS`)."""
    with pytest.raises(ValueError, match=f"threads: must be an integer from 1 to 1024, got {threads}"):
        laya.load(laya_tiny_bert, threads=threads)


def test_load_refuses_an_omp_num_threads_no_runtime_can_run(laya_tiny_bert, monkeypatch):
    """threads defaults to $OMP_NUM_THREADS; 5000 there hung onnxruntime's session creation (the argument itself
    was checked, the environment's default was not)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "5000")
    with pytest.raises(ValueError, match=r"\$OMP_NUM_THREADS \(the default of threads\): must be an integer from 1 "
                                         r"to 1024, got 5000"):
        laya.load(laya_tiny_bert)
    assert laya.load(laya_tiny_bert, threads=1) is not None  # an explicit count needs no default


def test_import_laya_is_cheap(tmp_path):
    import subprocess
    import sys

    code = "import sys, laya; assert 'torch' not in sys.modules, 'import laya pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_cpu_engines_decide_without_torch(tmp_path, laya_tiny_modernbert, precision):
    """The onnxruntime engines load and answer without ever importing torch or transformers."""
    import subprocess
    import sys

    code = (f"import sys, laya\nfrom laya.scenarios import load\ns, q = load()\n"
            f"laya.load({laya_tiny_modernbert!r}, precision={precision!r}).predict(s, q)\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_inference_path_equals_training_forward(agent):
    """`LayaModel.infer` (last head layer only where read, fixed-shape tail) == the differentiable `forward`."""
    import torch

    from laya.batching import collate

    rows = agent.prepare(STATE, QUESTIONS).rows + agent.prepare(["hi", "cancel now"], QUESTIONS).rows
    b = collate(rows, agent.tokenizer.pad_token_id)
    with torch.inference_mode():
        logits, act = agent.model(**b)
        per_row = agent.model.infer(b["input_ids"], b["attention_mask"], b["qtype"], b["marker_pos"],
                                    [len(r.markers) for r in rows])
    for j, (lg, ac) in enumerate(per_row):
        k = len(rows[j].markers)
        assert torch.allclose(lg, logits[j, :k], atol=1e-5) and torch.allclose(ac, act[j], atol=1e-5)
