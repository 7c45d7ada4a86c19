"""`pagoda bench generate`: the engine against transformers `generate`, same weights, dtype and threads.

Three measurements, each printed as a ratio against the baseline run in the same process (timings on a
shared machine are noisy; ratios are what to compare across runs):
  (a) N requests sharing a long system prompt, batched: engine vs HF batched generate with left padding;
  (b) single-stream decode tokens/s;
  (c) time to first token of a repeated long prompt, warm (cached) vs cold;
  (d) the per-step logits processors a request can ask for (`logit_bias` on 50 and on 1000 token ids,
      `min_new_tokens`), each on the same batched greedy decode as a plain run, in alternating rounds;
  (e) a short request that comes while a long prompt (`--ttft-tokens`) is being prefilled: its latency and the
      long prompt's, with the scheduler's share for waiting requests against none (the policy before it), in
      alternating rounds.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

SYSTEM_SENTENCE = (
    "You are the support assistant of a company that rents bicycles in twelve cities. Answer briefly, "
    "politely and precisely, cite the relevant policy section, never invent prices, and ask one clarifying "
    "question when a request is ambiguous. "
)
QUESTIONS = [
    "How do I unlock a bike?", "Can I return a bike in another city?", "What happens if I lose the key?",
    "Is a helmet included?", "How are late returns charged?", "Can children ride?", "Do you have e-bikes?",
    "How do I report a flat tyre?", "Can I reserve a bike for tomorrow?", "What payment methods work?",
    "Is there a student discount?", "How long can I keep a bike?", "What if it rains?", "Are pets allowed?",
    "How do I cancel a reservation?", "Where is the nearest station?",
]


def hf_reference(model_path: Path, dtype: Any):
    """transformers' LlamaForCausalLM on the same weights (a GGUF is dequantised by transformers itself)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if model_path.is_dir():
        return LlamaForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    # transformers' own GGUF reader (needs `gguf`, not accelerate): an independent dequantisation
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = load_gguf_checkpoint(str(model_path), return_tensors=False)["config"]
    cfg.pop("model_type", None)
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**cfg))
    tensors = load_gguf_checkpoint(str(model_path), return_tensors=True, model_to_load=meta)["tensors"]
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run(model: str | None, *, requests: int = 32, prefix_tokens: int = 300, new_tokens: int = 32,
        decode_tokens: int = 128, ttft_tokens: int = 1000, threads: int | None = None, dtype: str = "float32",
        parts: str = "abc", device: str = "cpu", rounds: int = 5) -> dict[str, float]:
    import torch

    from generation.config import EngineConfig, SamplingParams
    from generation.engine import Engine
    from generation.weights import default_model_path

    if threads:
        torch.set_num_threads(threads)
    path = Path(model) if model else default_model_path()
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    print(f"model={path.name} dtype={dtype} threads={torch.get_num_threads()} device={device}")
    hf = None
    if "a" in parts or "b" in parts:  # (c) and (d) are the engine against itself
        hf = hf_reference(path, tdtype).to(device)
        hf.generation_config.eos_token_id = None

    def engine(**kw: Any) -> Engine:
        return Engine(EngineConfig(model=str(path), dtype=dtype, device=device, num_threads=threads, **kw))

    eng = engine(cache_backend="radix")
    tok = eng.tokenizer
    results: dict[str, float] = {}

    def fits(flag: str, tokens: int) -> None:
        """A run past the context would stop the engine early and time fewer tokens than it divides by."""
        if tokens >= eng.max_model_len:
            raise ValueError(f"{flag}: {tokens} tokens of prompt and answer do not fit in the model's "
                             f"{eng.max_model_len}-token context")

    if "a" in parts:  # before the system prompt is built up to prefix_tokens, one sentence at a time
        fits("--prefix-tokens / --new-tokens", prefix_tokens + new_tokens)
    if "c" in parts:
        fits("--ttft-tokens", ttft_tokens)
    if "d" in parts:
        fits("--new-tokens", new_tokens + 64)
    if "e" in parts:
        fits("--ttft-tokens", ttft_tokens + 1)

    def hf_generate(batch: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        width = max(len(b) for b in batch)
        ids = torch.tensor([[0] * (width - len(b)) + b for b in batch], device=device)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=device)
        with torch.inference_mode():
            out, secs = _timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0))
        return [row[width:].tolist() for row in out], secs

    greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    if "a" in parts:
        system = SYSTEM_SENTENCE
        while len(tok.encode(system)) < prefix_tokens:
            system += SYSTEM_SENTENCE
        prompts = [tok.encode(eng.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (ticket {i})"}]))
                   for i in range(requests)]
        fits("--prefix-tokens / --new-tokens", max(len(p) for p in prompts) + new_tokens)
        ref, hf_s = hf_generate(prompts, new_tokens)
        outs, eng_s = _timed(lambda: eng.generate(prompts, greedy))
        same = sum(o.token_ids == r for o, r in zip(outs, ref))
        st = eng.stats()
        print(f"(a) {requests} requests x {new_tokens} new tokens, shared prefix {len(prompts[0]) - 20}+ tokens: "
              f"HF {requests * new_tokens / hf_s:.1f} tok/s, engine {requests * new_tokens / eng_s:.1f} tok/s, "
              f"speedup x{hf_s / eng_s:.2f} (target >= 3); greedy identical {same}/{requests}; "
              f"prefill_skip_ratio {st['prefill_skip_ratio']:.2f}, decode_batch_factor {st['decode_batch_factor']:.1f}")
        results.update(shared_prefix_speedup=hf_s / eng_s, shared_prefix_identical=same / requests)
    if "b" in parts:
        # Alternate HF and engine in short rounds so load from other jobs hits both; report the median.
        prompt = tok.encode(eng.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}]))
        eng2 = engine(cache_backend="none")
        hf_generate([prompt], 4)  # warm both paths up
        eng2.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
        per_round = max(1, decode_tokens // rounds)
        fits("--decode-tokens", len(prompt) + per_round)
        single = SamplingParams(max_new_tokens=per_round, ignore_eos=True)
        ratios, hf_total, eng_total, same = [], 0.0, 0.0, True
        for _ in range(rounds):
            (ref,), hf_s = hf_generate([prompt], per_round)
            (out,), eng_s = _timed(lambda: eng2.generate([prompt], single))
            ratios.append(hf_s / eng_s)
            hf_total, eng_total, same = hf_total + hf_s, eng_total + eng_s, same and out.token_ids == ref
        median = sorted(ratios)[len(ratios) // 2]
        n = per_round * rounds
        print(f"(b) single stream, {rounds} alternating rounds x {per_round} tokens: HF {n / hf_total:.1f} tok/s, engine "
              f"{n / eng_total:.1f} tok/s; ratio per round {' '.join(f'x{r:.2f}' for r in ratios)}, "
              f"median x{median:.2f} (target >= 1.0); greedy identical {same}")
        results.update(single_stream_ratio=median)
    if "c" in parts:
        text = SYSTEM_SENTENCE
        while len(tok.encode(text)) < ttft_tokens:
            text += SYSTEM_SENTENCE + f"Rule {len(text) % 97}. "
        ids = tok.encode(text)[:ttft_tokens]
        eng3 = engine(cache_backend="radix")
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        eng3.generate([ids[:8]], one)  # warm-up outside the timed region
        _, cold = _timed(lambda: eng3.generate([ids], one))
        _, warm = _timed(lambda: eng3.generate([ids], one))
        print(f"(c) TTFT of a repeated {len(ids)}-token prompt: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms, "
              f"warm/cold {warm / cold:.3f} (target <= 0.10)")
        results.update(ttft_warm_over_cold=warm / cold)
    if "d" in parts:
        results.update(processor_ratios(eng, requests=requests, new_tokens=new_tokens, rounds=rounds))
    if "e" in parts:
        results.update(waiting_share_ratios(eng, ttft_tokens=ttft_tokens, rounds=rounds))
    return results


def _ended(events: list) -> dict[str, float]:
    from generation.engine import GenerationOutput

    return {e.request_id: time.perf_counter() for e in events if isinstance(e, GenerationOutput)}


def waiting_share_ratios(eng: Any, *, ttft_tokens: int, rounds: int) -> dict[str, float]:
    """(e): a `ttft_tokens` prompt is admitted and prefilled for two steps; then a one-line question comes. Each
    round runs it with the scheduler's `WAITING_SHARE` and with 0 (every step's budget to the long prefill, the
    policy before), on the same engine with its cache flushed; the medians' ratios say what the share buys the
    short request and costs the long one."""
    from generation import scheduler
    from generation.config import SamplingParams

    tok = eng.tokenizer
    text = SYSTEM_SENTENCE
    while len(tok.encode(text)) < ttft_tokens:
        text += SYSTEM_SENTENCE + f"Rule {len(text) % 97}. "
    long, short = tok.encode(text)[:ttft_tokens], tok.encode(QUESTIONS[0])
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    share = scheduler.WAITING_SHARE
    times: dict[float, list[tuple[float, float]]] = {share: [], 0.0: []}
    try:
        for _ in range(rounds):
            for value in (share, 0.0):
                scheduler.WAITING_SHARE = value
                eng.flush_cache()
                eng.add_request(long, one, request_id="long")
                done: dict[str, float] = {}
                start = time.perf_counter()
                for _ in range(2):  # a prompt shorter than two steps' budget has ended by now
                    done.update(_ended(eng.step()))
                came = time.perf_counter()
                eng.add_request(short, one, request_id="short")
                while len(done) < 2 and eng.num_unfinished:
                    done.update(_ended(eng.step()))
                times[value].append((done["short"] - came, done["long"] - start))
    finally:
        scheduler.WAITING_SHARE = share

    def median(value: float, k: int) -> float:
        return sorted(t[k] for t in times[value])[len(times[value]) // 2]

    short_ratio, long_ratio = median(share, 0) / median(0.0, 0), median(share, 1) / median(0.0, 1)
    print(f"(e) a {len(short)}-token question while a {len(long)}-token prompt is prefilled, {rounds} alternating "
          f"rounds (medians): its answer {median(share, 0):.2f} s with the waiting share {share:g}, "
          f"{median(0.0, 0):.2f} s without (x{short_ratio:.2f}); the long prompt {median(share, 1):.2f} s against "
          f"{median(0.0, 1):.2f} s (x{long_ratio:.2f})")
    return {"short_behind_long_prefill": short_ratio, "long_prefill_cost": long_ratio}


def processor_ratios(eng: Any, *, requests: int, new_tokens: int, rounds: int, steps: int = 200) -> dict[str, float]:
    """(d): `requests` short chat prompts decoded greedily together for `new_tokens` tokens each, plainly (the
    engine's argmax-only path) and with each per-step processor, on one engine, two ways:

    - whole decodes: every run writes exactly `new_tokens` tokens per request (plain and biased runs ignore EOS;
      the `min_new_tokens` run does not, its processor masks EOS for the whole answer instead), so the runs differ
      only by the processor. A warm-up run caches the prompts, so every timed run prefills the same one token per
      request. Variants alternate within each round so load from other jobs hits them alike; the ratio is the
      best run's time over plain's best, the per-round ratios show the spread;
    - the sampler step alone (`generation.sampler.sample`, where the processors run), `steps` times per variant
      on the same [requests, vocab] logits, for the same rows the engine would make: what a processor costs per
      decode step without the forward pass around it, which on a CPU is a thousand times larger and as noisy.
    """
    import torch

    from generation.config import SamplingParams
    from generation.sampler import sample

    tok = eng.tokenizer
    prompts = [tok.encode(eng.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                                                    + f" (ticket {i})"}])) for i in range(requests)]
    vocab = eng.model_config.vocab_size
    pick = random.Random(0)

    def bias(n: int) -> dict[int, float]:
        """`n` distinct ids across the vocabulary, small biases of both signs (they may change the answer,
        never its length: EOS is ignored)."""
        return {t: (0.5 if k % 2 else -0.5) for k, t in enumerate(pick.sample(range(vocab), min(n, vocab)))}

    variants = {
        "plain": SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
        "logit_bias 50 ids": SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logit_bias=bias(50)),
        "logit_bias 1000 ids": SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logit_bias=bias(1000)),
        f"min_new_tokens {new_tokens}": SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
    }
    for params in variants.values():  # warm-up: caches the prompts, and each path runs once untimed
        eng.generate(prompts, params)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, params in variants.items():
            outs, secs = _timed(lambda params=params: eng.generate(prompts, params))
            if any(len(o.token_ids) != new_tokens for o in outs):
                raise RuntimeError(f"(d) {name}: a request wrote {min(len(o.token_ids) for o in outs)} tokens, "
                                   f"not {new_tokens}: the runs would not compare")
            times[name].append(secs)

    # The sampler alone: the engine's own sequences for each variant (processors as add_request builds them),
    # each with a few output tokens so min_new_tokens is still masking; fresh logits each call, copied untimed.
    torch.manual_seed(0)
    logits = torch.randn(requests, vocab)
    rows = {name: [eng._new_sequence(p, params, None, 0, None, False) for p in prompts]
            for name, params in variants.items()}
    for seqs in rows.values():
        for seq in seqs:
            seq.output_ids.extend([1, 2])
    step_s: dict[str, float] = dict.fromkeys(variants, 0.0)
    for _ in range(steps):
        for name, seqs in rows.items():
            fresh = logits.clone()
            t = time.perf_counter()
            sample(fresh, seqs)
            step_s[name] += time.perf_counter() - t

    plain, plain_step = min(times["plain"]), step_s["plain"] / steps
    decode_steps = new_tokens
    print(f"(d) per-step processors, {requests} requests x {new_tokens} new tokens, greedy, {rounds} alternating "
          f"rounds; whole decodes (best run / plain's best; per-round ratios) and the sampler step alone "
          f"({steps} steps of [{requests}, {vocab}] logits each):")
    print(f"    plain                  {requests * new_tokens / plain:.1f} tok/s, {plain / decode_steps * 1000:.2f} "
          f"ms/step; sampler {plain_step * 1e6:.0f} us/step")
    out: dict[str, float] = {}
    for name, secs in times.items():
        if name == "plain":
            continue
        ratio = min(secs) / plain
        per_round = " ".join(f"x{v / p:.3f}" for v, p in zip(secs, times["plain"]))
        extra = step_s[name] / steps - plain_step
        print(f"    {name:<22} {requests * new_tokens / min(secs):.1f} tok/s, x{ratio:.3f} of plain ({per_round}); "
              f"sampler {step_s[name] / steps * 1e6:.0f} us/step, x{step_s[name] / step_s['plain']:.2f}, "
              f"{extra * 1e6:+.0f} us = {extra / (plain / decode_steps) * 100:+.2f}% of a decode step")
        out[f"processor_ratio[{name}]"] = ratio
        out[f"sampler_ratio[{name}]"] = step_s[name] / step_s["plain"]
    return out


def plot(results: dict[str, float], path: str) -> None:
    """Bar chart of the measured ratios against their targets (the figure in docs/benchmarks.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("(a) shared prefix\nthroughput vs HF", "shared_prefix_speedup", 3.0),
            ("(b) single stream\ntok/s vs HF", "single_stream_ratio", 1.0),
            ("(c) engine cold / warm\nTTFT, 1,000 tokens", "ttft_warm_over_cold", 10.0)]
    rows = [(label, (1 / results[key]) if key == "ttft_warm_over_cold" else results[key], target)
            for label, key, target in rows if key in results]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(range(len(rows)), [r[1] for r in rows], color="#4c72b0", label="measured")
    ax.scatter(range(len(rows)), [r[2] for r in rows], color="#c44e52", marker="_", s=900, linewidths=3, label="target")
    for i, (_, value, _) in enumerate(rows):
        ax.annotate(f"{value:.2f}x", (i, value), ha="center", va="bottom")
    ax.set_xticks(range(len(rows)), [r[0] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ratio, log scale (higher is better)")
    ax.set_title("pagoda generation engine vs transformers, SmolLM2-135M, same run")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
