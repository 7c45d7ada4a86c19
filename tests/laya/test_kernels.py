"""The bf16 engine's compiled kernels (`laya.kernels`): each computes what the torch ops it replaces compute, to
bf16 rounding; a row's (or token's) bits never depend on what shares the call or on the thread count; and the
build is cached per CPU, can be switched off, and fails soft without a compiler."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import laya
from laya import kernels
from laya.packed_engine import _attention, _heads, _rotary
from laya.scenarios import load as scenario

# Skipped only where there is no compiler at all: with one, a kernel that fails to build must fail here, not skip.
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def test_the_kernels_build_where_there_is_a_compiler():
    assert kernels.available(), kernels.unavailable_reason()


def _inputs(lengths: list[int], heads: int, hd: int, pad: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    starts = np.cumsum([0, *lengths]).tolist()
    tokens = starts[-1] + pad
    qkv = (torch.randn(tokens, 3 * heads * hd, generator=g) * 1.5).bfloat16()
    rope = torch.polar(torch.ones(tokens, hd // 2), torch.rand(tokens, hd // 2, generator=g) * 6.3)
    return qkv, rope, starts


def _reference(qkv, rope, starts, heads, window):
    d = qkv.size(1) // 3
    y = qkv.float()
    if rope is None:
        q, k = _heads(y[:, :d], heads), _heads(y[:, d:2 * d], heads)
    else:
        q, k = _rotary(y[:, :2 * d], rope, heads)
    return _attention(q, k, _heads(y[:, 2 * d:], heads), starts, starts, window)


@pytest.mark.parametrize("hd", kernels.HEAD_DIMS)
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("window", [None, 8, 64])
def test_attention_computes_the_torch_ops(hd, rotary, window):
    """Rotary plus each row's softmax attention over its own keys (a local window where given; rows of 1 to 300
    tokens, so windows clip and chunks end mid-row) equals the engine's torch ops up to the one bf16 rounding."""
    heads = 3
    qkv, rope, starts = _inputs([1, 17, 64, 300, 45], heads, hd)
    rope = rope if rotary else None
    got = kernels.attention(qkv, heads, torch.tensor(starts, dtype=torch.int32), rope=rope, window=window)
    want = _reference(qkv, rope, starts, heads, window)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    assert got[starts[-1]:].eq(0).all()         # padding tokens, in no row


def test_attention_rows_keep_their_bits_whatever_shares_the_call():
    heads, hd = 4, 64
    qkv, rope, starts = _inputs([62, 51, 300, 3], heads, hd, pad=0)
    st = torch.tensor(starts, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.attention(qkv, heads, st, rope=rope, window=64)
        torch.set_num_threads(2)
        together = kernels.attention(qkv, heads, st, rope=rope, window=64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)
    for r in range(len(starts) - 1):
        rows = slice(starts[r], starts[r + 1])
        own = torch.tensor([0, starts[r + 1] - starts[r]], dtype=torch.int32)
        alone = kernels.attention(qkv[rows].contiguous(), heads, own, rope=rope[rows], window=64)
        assert torch.equal(alone, together[rows]), r


def test_add_widened_gives_torch_add_bits():
    g = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 1023, 1025, 170 * 768):
        r, y = torch.randn(n, generator=g) * 10, (torch.randn(n, generator=g) * 3).bfloat16()
        y[0] = float("nan") if n > 3 else y[0]
        assert torch.equal(kernels.add_widened(r, y).nan_to_num(7.0), torch.add(r, y).nan_to_num(7.0)), n


@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
def test_layer_norm_bf16_is_layer_norm_rounded_once(affine):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 768, generator=g) * 4 + 2
    w = torch.randn(768, generator=g) if affine != "none" else None
    b = torch.randn(768, generator=g) if affine == "weight and bias" else None
    got, same = kernels.layer_norm_bf16(x, w, b, 1e-5)
    assert same is x
    want = F.layer_norm(x, (768,), w, b, 1e-5)
    assert got.dtype == torch.bfloat16
    # at most one bf16 step (2^-8 relative) from the fp32 value: the fp32 sums may differ in their last bits
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()
    for t in (0, 33, 69):                      # a token's bits are its own
        assert torch.equal(kernels.layer_norm_bf16(x[t:t + 1], w, b, 1e-5)[0], got[t:t + 1])


def test_the_build_is_cached_keyed_and_can_be_switched_off(monkeypatch, tmp_path):
    path = kernels.build()
    assert path.exists() and kernels.build() == path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels._library_path() != path and kernels._library_path().parent == tmp_path / "pagoda" / "kernels"
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        kernels.build()                        # no compiler: an error, which `available()` turns into False
    kernels._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no-such-compiler"):
            assert not kernels.available()
        assert "not built" in kernels.unavailable_reason()
        monkeypatch.delenv("CC")
        monkeypatch.setenv(kernels.ENV, "0")
        kernels._library.cache_clear()
        assert not kernels.available() and "PAGODA_KERNELS=0" in kernels.unavailable_reason()
        monkeypatch.delenv(kernels.ENV)
        kernels._library.cache_clear()
        assert kernels.available() and kernels._library_path().exists()     # built into the new cache
    finally:
        monkeypatch.undo()
        kernels._library.cache_clear()


@pytest.mark.parametrize("arch", ["modernbert", "bert"])
def test_the_bf16_engine_with_and_without_kernels(monkeypatch, laya_tiny_modernbert, laya_tiny_bert, arch):
    """The packed engine says which attention it runs; with the kernels and without them a row's answer is the
    same model's, deterministic and independent of its batch mates either way."""
    from laya.testing import packed_bf16_agent

    path = laya_tiny_modernbert if arch == "modernbert" else laya_tiny_bert
    state, questions = scenario("billing")
    fused = packed_bf16_agent(path)
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = packed_bf16_agent(path)
    assert "compiled kernel" in fused.engine.describe()["attention"]
    assert plain.engine.describe()["attention"].startswith("torch ops")
    exact = laya.load(path)
    rows = fused.prepare(state, questions).rows
    crowd = [r for s in ("the server is down", ["user: hi", "user: cancel"]) for r in fused.prepare(s, questions).rows]
    for agent in (fused, plain):
        alone = [agent.forward([r])[0] for r in rows]
        mixed = agent.forward(crowd + rows)[len(crowd):]
        for a, b, e in zip(alone, mixed, exact.forward(rows)):
            assert np.array_equal(a.logits, b.logits)
            assert np.abs(a.logits - e.logits).max() < 0.3


def test_rows_linear_rows_are_their_own():
    g = torch.Generator().manual_seed(3)
    for width in (16, 775):                     # 775: the act head's input, [CLS] plus the answer features
        w, b, x = torch.randn(40, width, generator=g), torch.randn(40, generator=g), torch.randn(9, width, generator=g)
        got = kernels.rows_linear(x, w, b)
        torch.testing.assert_close(got, x @ w.T + b, atol=1e-4, rtol=1e-5)
        for r in (0, 4, 8):
            assert torch.equal(kernels.rows_linear(x[r:r + 1], w, b), got[r:r + 1])
        torch.testing.assert_close(kernels.rows_linear(x, w, None) + b, got)


def test_layer_norm_of_a_sum_is_the_add_then_the_norm():
    """The residual add fused into the next norm: the sum has torch.add's bits, the norm is the sum's norm."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(33, 768, generator=g) * 3, (torch.randn(33, 768, generator=g) * 2).bfloat16()
    w = torch.randn(768, generator=g)
    a, total = kernels.layer_norm_bf16(x, w, None, 1e-5, add=y)
    assert torch.equal(total, torch.add(x, y))
    assert torch.equal(a, kernels.layer_norm_bf16(total, w, None, 1e-5)[0])


def test_attention_of_selected_queries_over_each_rows_keys():
    """The last head layer's form: a few queries per row (its [CLS] and markers) over all of that row's keys,
    from separate q and k|v GEMM results; a row without keys gets zeros."""
    heads, hd = 12, 64
    g = torch.Generator().manual_seed(5)
    kv_starts, q_starts = [0, 62, 113, 170, 170], [0, 4, 8, 11, 12]
    kv = torch.randn(180, 2 * heads * hd, generator=g).bfloat16()
    q = torch.randn(14, heads * hd, generator=g).bfloat16()
    got = kernels.attention(q, heads, torch.tensor(q_starts, dtype=torch.int32), kv=kv,
                            kv_starts=torch.tensor(kv_starts, dtype=torch.int32))
    d = heads * hd
    want = _attention(_heads(q.float(), heads), _heads(kv[:, :d].float(), heads), _heads(kv[:, d:].float(), heads),
                      q_starts[:-1], kv_starts[:-1])
    torch.testing.assert_close(got[:11].float(), want[:11], atol=2e-2, rtol=1e-2)
    assert got[11:].eq(0).all()                 # the keyless row's query, then padding
    for r in range(3):
        alone = kernels.attention(q[q_starts[r]:q_starts[r + 1]].contiguous(), heads,
                                  torch.tensor([0, q_starts[r + 1] - q_starts[r]], dtype=torch.int32),
                                  kv=kv[kv_starts[r]:kv_starts[r + 1]].contiguous(),
                                  kv_starts=torch.tensor([0, kv_starts[r + 1] - kv_starts[r]], dtype=torch.int32))
        assert torch.equal(alone, got[q_starts[r]:q_starts[r + 1]])
