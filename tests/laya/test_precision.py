"""Which precision runs where: features read from the CPU, bf16 refused without its units, `fast` picking
what the machine has, the variable and the argument, and the bf16 path itself (on any CPU: where the
units are faked, oneDNN emulates the arithmetic; on a CPU that has them, as CI's may, the model-width
tests below exercise the kernels it really picks, which is where rows once depended on their mates)."""

from __future__ import annotations

import numpy as np
import pytest

import laya
from laya import precision
from laya.precision import CpuFeatures, parse_cpuinfo, plan
from laya.scenarios import load as scenario

STATE, QUESTIONS = scenario("billing")
AVX2 = CpuFeatures("Zen 3", frozenset({"avx2", "fma"}), 2)
VNNI = CpuFeatures("Cascade Lake", frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}), 8)
AMX = CpuFeatures("Sapphire Rapids", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"}), 16)


def test_cpuinfo_flags_are_parsed():
    text = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"
    assert parse_cpuinfo(text) == ("AMD EPYC 7B13", frozenset({"fpu", "avx2", "fma"}))
    here = precision.detect()
    assert here.summary()["cores"] >= 1 and set(here.summary()["flags"]) <= here.flags


def test_bf16_needs_its_units_and_says_so():
    with pytest.raises(ValueError, match="amx_bf16 or avx512_bf16.*Zen 3.*'int8'"):
        plan("bf16", cpu=AVX2)
    p = plan("bf16", cpu=AMX)
    assert (p.precision, p.backend) == ("bf16", "torch") and "amx_bf16" in p.reason


def test_fast_picks_what_the_cpu_has():
    assert plan("fast", cpu=AMX).precision == "bf16"
    avx2, vnni = plan("fast", cpu=AVX2), plan("fast", cpu=VNNI)
    assert (avx2.precision, avx2.backend) == ("int8", "onnxruntime") and "no VNNI" in avx2.reason
    assert vnni.precision == "int8" and "avx512_vnni" in vnni.reason
    assert plan(None, cpu=AVX2).precision == "exact" and plan("exact", cpu=AMX).backend == "onnxruntime"


def test_gpu_plans():
    assert plan("exact", device="cuda").backend == "torch"
    assert plan("fast", device="cuda:1").precision == "bf16"
    with pytest.raises(ValueError, match="CPU only"):
        plan("int8", device="cuda")


def test_a_device_torch_cannot_use_is_refused_at_load(monkeypatch, laya_tiny_bert):
    """`laya.load(device=...)` checks the device before anything loads; on a CPU-only torch `cuda` used to be
    an AssertionError from the first weight moved."""
    import torch

    from laya.precision import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device("cpu") == "cpu" and check_device("cpu:0") == "cpu:0"
    with pytest.raises(ValueError, match=r"^device: 'cuda' is not available to this torch"):  # the argument's name
        laya.load(laya_tiny_bert, device="cuda")
    with pytest.raises(ValueError, match=r"--model-device: 'banana' is not a device name"):
        check_device("banana", "--model-device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match="'cuda:1' asks for cuda device 1, but torch sees 1"):
        check_device("cuda:1")


def test_variable_and_argument(monkeypatch, laya_tiny_bert):
    monkeypatch.setenv("PAGODA_PRECISION", "int8")
    assert laya.load(laya_tiny_bert).plan.precision == "int8"
    assert laya.load(laya_tiny_bert, precision="exact").plan.precision == "exact"   # the argument wins
    monkeypatch.setenv("PAGODA_PRECISION", "fp8")
    with pytest.raises(ValueError, match=r"\$PAGODA_PRECISION.*fp8"):
        laya.load(laya_tiny_bert)
    with pytest.raises(ValueError, match="precision: expected one of exact, int8, bf16, fast"):
        laya.load(laya_tiny_bert, precision="half")


@pytest.mark.parametrize("prepacked", [True, False], ids=["onednn", "plain-fallback"])
@pytest.mark.parametrize("arch", ["modernbert", "bert"])
def test_bf16_runs_packed_deterministically(monkeypatch, laya_tiny_modernbert, laya_tiny_bert, arch, prepacked):
    from laya import packed_engine

    path = laya_tiny_modernbert if arch == "modernbert" else laya_tiny_bert
    monkeypatch.setattr(precision, "detect", lambda: AMX)
    if not prepacked:
        monkeypatch.setattr(packed_engine, "_can_prepack", lambda: False)
    agent = laya.load(path, precision="fast")
    described = agent.engine.describe()
    assert agent.plan.precision == "bf16" and described["rows_per_forward"] == "packed", described
    exact = laya.load(path)
    states = [STATE, "the server is down", ["user: hi", "user: cancel"]]
    rows = [r for s in states for r in agent.prepare(s, QUESTIONS).rows]
    together, again = agent.forward(rows), agent.forward(rows)
    alone = [o for s in states for o in agent.forward(agent.prepare(s, QUESTIONS).rows)]
    for a, b, c in zip(together, again, alone):
        assert np.array_equal(a.logits, b.logits) and np.array_equal(a.logits, c.logits)
        assert np.array_equal(a.act_probabilities, c.act_probabilities)
    gap = max(np.abs(a.logits - r.logits).max() for a, r in zip(together, exact.forward(rows)))
    assert 0 < gap < 0.3, gap   # really bf16, and close


def test_bf16_packed_and_autocast_paths_agree(monkeypatch, laya_tiny_modernbert):
    """The packed engine and `LayaModel` under bf16 autocast (what a GPU, or an encoder the packed engine does
    not build, runs) round differently but compute the same model."""
    from laya.torch_engine import TorchEngine

    monkeypatch.setattr(precision, "detect", lambda: AMX)
    packed = laya.load(laya_tiny_modernbert, precision="bf16")
    autocast = TorchEngine.load(laya_tiny_modernbert, packed.plan)
    rows = packed.prepare(STATE, QUESTIONS).rows
    for a, b in zip(packed.forward(rows), autocast.forward(rows)):
        assert np.abs(a.logits - b.logits).max() < 0.3


def test_prepacked_bf16_weights_give_the_plain_gemm_bits():
    """oneDNN's reordered weight layout is a speed choice only: every row's bits equal F.linear's, for any row
    count and any place of the row in the matrix."""
    import torch
    import torch.nn.functional as F

    from laya import packed_engine

    if not packed_engine._can_prepack():
        pytest.skip("this torch's oneDNN has no bf16 linear kernels: the engine runs F.linear")
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(300, 64)
    lin = packed_engine.Bf16Linear(w, None)
    full = lin(x)
    assert torch.equal(full, F.linear(x.bfloat16(), w.bfloat16()).float())
    for rows, offset in ((1, 0), (7, 3), (64, 100), (129, 40), (299, 1)):
        assert torch.equal(lin(x[offset:offset + rows]), full[offset:offset + rows])


@pytest.mark.parametrize("prepacked", [True, False], ids=["onednn-post-ops", "plain-fallback"])
def test_fused_bf16_linears_keep_rows_independent(monkeypatch, prepacked):
    """The activation and GeGLU's gate product run inside oneDNN's GEMM (post-ops on the fp32 accumulator,
    one rounding to bf16): a row's bits stay its own whatever the row count or its place, and each post-op
    computes the activation it names. A torch without oneDNN's bf16 linear takes the plain path, alike."""
    import torch

    from laya import packed_engine

    if prepacked and not packed_engine._can_prepack():
        pytest.skip("this torch's oneDNN has no bf16 linear kernels: the engine runs F.linear")
    if not prepacked:
        monkeypatch.setattr(packed_engine, "_can_prepack", lambda: False)
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64) * 0.1, torch.randn(96), torch.randn(300, 64)
    pre = x.bfloat16().float() @ w.bfloat16().float().T + b
    gate = torch.randn(300, 96).bfloat16()
    for activation, fn in packed_engine._ACT.items():
        lin = packed_engine.Bf16Linear(w, b, activation)
        full = lin.bf16(x)
        assert full.dtype == torch.bfloat16
        assert (full.float() - fn(pre)).abs().max() < 0.05, activation      # bf16 rounding of values up to ~4
        for rows, offset in ((1, 0), (7, 3), (64, 100), (129, 40), (299, 1)):
            assert torch.equal(lin.bf16(x[offset:offset + rows]), full[offset:offset + rows]), (activation, rows)
    lin = packed_engine.Bf16Linear(w, b, product=True)
    full = lin.bf16(x, times=gate)
    assert (full.float() - pre * gate.float()).abs().max() < 0.1
    for rows, offset in ((1, 0), (7, 3), (129, 40)):
        assert torch.equal(lin.bf16(x[offset:offset + rows], times=gate[offset:offset + rows]), full[offset:offset + rows])


def test_interleaved_rotary_matches_rotate_half():
    """Wqkv's rows reordered at load put each rotate-half pair side by side; rotary is then one complex
    product, and attention scores (q.k over a head's dims, in any order) are the checkpoint's."""
    import torch

    from laya import packed_engine

    torch.manual_seed(0)
    heads, hd, n = 3, 8, 5
    hidden = heads * hd
    qkv = torch.randn(n, 3 * hidden)
    angle = torch.randn(n, hd // 2)
    cos, sin = angle.cos(), angle.sin()

    def rotate_half(t):      # the checkpoint's convention, as transformers writes it
        t = t.unflatten(-1, (heads, hd))
        x1, x2 = t.chunk(2, -1)
        return torch.cat([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1)

    q_ref, k_ref = rotate_half(qkv[:, :hidden]), rotate_half(qkv[:, hidden:2 * hidden])
    order = packed_engine._interleave_rotary_pairs(hidden, heads)
    assert sorted(order.tolist()) == list(range(3 * hidden))
    assert torch.equal(qkv[:, order][:, 2 * hidden:], qkv[:, 2 * hidden:])          # v as stored
    q, k = packed_engine._rotary(qkv[:, order][:, :2 * hidden], torch.complex(cos, sin), heads)
    assert q.shape == (heads, n, hd)
    scores_ref = torch.einsum("qhd,khd->hqk", q_ref, k_ref)
    assert torch.allclose(torch.einsum("hqd,hkd->hqk", q, k), scores_ref, atol=1e-5)


@pytest.mark.parametrize("prepacked", [True, False], ids=["onednn", "plain-fallback"])
def test_bf16_linears_of_model_size_keep_rows_independent(monkeypatch, prepacked):
    """At a model's real widths oneDNN picks its kernel and K blocking by the row count (on an AMX CPU a row's
    bits differed between calls of 16, 57, 170 and 1,000 rows), so `Bf16Linear` only calls the GEMM with row
    counts measured to agree: a row's bits must not depend on how many rows share the call or where it sits."""
    import torch

    from laya import packed_engine

    if prepacked and not packed_engine._can_prepack():
        pytest.skip("this torch's oneDNN has no bf16 linear kernels: the engine runs F.linear")
    if not prepacked:
        monkeypatch.setattr(packed_engine, "_can_prepack", lambda: False)
    torch.manual_seed(0)
    x = torch.randn(1100, 3072)
    for k, n, bias, activation, product in ((768, 2304, False, None, False), (1152, 768, True, None, False),
                                            (3072, 768, True, None, False), (768, 1152, False, "gelu", False),
                                            (768, 1152, False, None, True)):
        lin = packed_engine.Bf16Linear(torch.randn(n, k) * k ** -0.5, torch.randn(n) if bias else None, activation,
                                       product)
        times = torch.randn(1100, n).bfloat16() if product else None

        def call(a: int, b: int, lin=lin, k=k, times=times) -> torch.Tensor:
            if lin.product:
                return lin.bf16(x[a:b, :k], times[a:b])
            return lin.bf16(x[a:b, :k]) if lin.activation else lin(x[a:b, :k])

        full = call(0, 1100)
        for rows, offset in ((1, 0), (16, 5), (57, 300), (170, 0), (170, 401), (300, 7), (700, 400)):
            assert torch.equal(call(offset, offset + rows), full[offset:offset + rows]), (k, n, activation, rows)


def test_bf16_runs_are_sized_by_activation_bytes_not_threads():
    """The packed engine cuts a call into runs whose fp32 activations stay cache-sized (docs/benchmarks.md):
    512 tokens at d=768, twice that at d=384, within the GEMM's smallest call and the packing limit."""
    from laya.packed_engine import MIN_ROWS, RUN_BYTES, run_tokens
    from laya.packing import MAX_TOKENS

    assert run_tokens(768) == 512 and run_tokens(384) == 1024
    assert run_tokens(1 << 20) == MIN_ROWS and run_tokens(8) == MAX_TOKENS
    for hidden in (256, 768, 1000, 1024):
        assert run_tokens(hidden) % MIN_ROWS == 0 and run_tokens(hidden) * 4 * hidden <= RUN_BYTES


@pytest.mark.parametrize("engine", ["bf16", "exact", "int8"])
def test_engines_of_model_size_answer_alike_whatever_shares_the_call(laya_checkpoint, engine):
    """Each CPU engine at ModernBERT-base widths (one encoder layer, the two 768-wide head layers, where the
    GEMMs' kernel choices are those of the real model): a row answered alone, with its own question mates,
    or in a crowd of other states gives the same bits."""
    from laya.testing import MODERNBERT_BASE, packed_bf16_agent

    path = laya_checkpoint(arch="modernbert", hidden=768, layers=1, head_layers=2, local_attention=128,
                           encoder_overrides={k: v for k, v in MODERNBERT_BASE.items() if k != "vocab_size"})
    agent = packed_bf16_agent(path) if engine == "bf16" else laya.load(path, precision=engine)
    rows = agent.prepare(STATE, QUESTIONS).rows
    crowd = [r for s in ("the server is down " * 12, ["user: hi", "user: cancel"], "refund " * 40)
             for r in agent.prepare(s, QUESTIONS).rows]
    alone = [agent.forward([r])[0] for r in rows]
    for got in (agent.forward(rows), agent.forward(crowd[:4] + rows + crowd * 3)[4:4 + len(rows)]):
        for a, b in zip(alone, got):
            assert np.array_equal(a.logits, b.logits) and np.array_equal(a.act_probabilities, b.act_probabilities)


def test_bf16_is_refused_where_the_gemm_rounds_a_row_by_its_place(monkeypatch, laya_tiny_modernbert):
    """If even the reference row count gives a row different bits at another place in the call, no padding
    can keep rows independent: the packed engine refuses and `laya.load` runs the torch model (autocast, one
    row per forward), saying why."""
    from laya import packed_engine

    monkeypatch.setattr(precision, "detect", lambda: AMX)
    monkeypatch.setattr(packed_engine.Bf16Linear, "_measure_rows", lambda self, rows: False)
    monkeypatch.setattr(packed_engine, "_ROWS_OK", {})
    with pytest.warns(RuntimeWarning, match="rounds a row differently by its place"):
        agent = laya.load(laya_tiny_modernbert, precision="bf16")
    assert agent.engine.describe()["rows_per_forward"] != "packed"
