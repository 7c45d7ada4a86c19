"""Server configuration: the process settings here, each API's own settings as a section of them.

Every limit the server enforces is a field of `ServeConfig` or of an API's section, so an operator finds
all of them in `pagoda serve --help` and an error names the flag and the variable that set a bad value
(`serving.flags` generates both from the fields). An API adds its settings by adding a section here.

The request threads are the core's, so their split between the APIs is too: a generation stream holds a
thread for as long as it streams, and without a budget per API 64 slow streams would leave `/decide`
nothing to run on (and a flood of decisions would queue streams behind it).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.decide.config import DecideConfig
from serving.flags import Settings, option, section
from serving.generate.config import GenerateConfig

# Each worker loads its own models (laya-mini and SmolLM2: about 1.6 GB before sharing), so a count in the
# thousands forked until the machine ran out of memory; no box this serves on runs 256 such processes well.
MAX_WORKERS = 256


@dataclass
class FrontSettings(Settings):
    """What each worker's HTTP front enforces before a request thread sees a request (`serving.server`):
    shared by every server built on it (`pagoda serve`, `pagoda gateway`), so both take the same flags."""

    max_connections: int = option(1000, "open connections per worker; past it the longest-idle one is closed for "
                                        "a new one, or with none idle the new one gets 503", minimum=1)
    keepalive_s: float = option(5.0, "an idle connection (before its first request or between two) closes after "
                                     "this", positive=True)
    header_timeout_s: float = option(10.0, "a request's line and headers must arrive within this of their first "
                                           "byte; past it 408", positive=True)
    body_timeout_s: float = option(30.0, "a request's whole body must arrive within this of its headers; past it "
                                         "408", positive=True)
    write_timeout_s: float = option(30.0, "a client that takes none of its response for this long is dropped "
                                          "(its stream aborted)", positive=True)
    max_header_bytes: int = option(16384, "largest request line plus headers; past it 431", minimum=256)


@dataclass
class ServeConfig(FrontSettings):
    host: str = option("127.0.0.1", "bind address")
    port: int = option(8000, "bind port (0 picks a free one)", minimum=0, maximum=65535)
    workers: int = option(1, f"gunicorn worker processes, 1-{MAX_WORKERS}; each holds its own models and "
                             "model-worker threads (a copy of the models each: more than a machine holds is a typo)",
                          minimum=1, maximum=MAX_WORKERS)
    threads: int = option(128, "request threads per worker, shared by the APIs (see --decide-threads, "
                               "--generate-threads); beyond them connections queue in the kernel", minimum=1)
    decide_threads: int | None = option(None, "most request threads the decision routes hold at once; past it "
                                              "503 (default: all of --threads, or half when generation is on)",
                                        minimum=1)
    generate_threads: int | None = option(None, "most request threads the generation routes hold at once, "
                                                "one per open stream; past it 503 (default: all of --threads, "
                                                "or half when decisions are on)", minimum=1)
    api_key: str | None = option(None, "require `Authorization: Bearer <key>` (environment only)", env_only=True)
    request_timeout_s: float = option(30.0, "deadline per request; past it the request gets 504", positive=True)
    max_body_bytes: int = option(1 << 20, "largest request body; past it 413", minimum=1)
    graceful_timeout_s: float = option(30.0, "on SIGTERM, how long in-flight requests get to finish", minimum=0)
    preload: bool = option(True, "import the model code in the master before forking, so a replacement worker "
                                 "only loads weights")
    access_log: bool = option(True, "one JSON line per request on stderr")
    decide: DecideConfig = section(DecideConfig)
    generate: GenerateConfig = section(GenerateConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("decide_threads", "generate_threads"):
            value = getattr(self, name)
            if value is not None and value > self.threads:
                raise ValueError(f"{self.where(name)} ({value}) must be at most {self.where('threads')} "
                                 f"({self.threads})")

    def thread_budgets(self, apis: list[str]) -> dict[str, int]:
        """Request threads each mounted API may hold: its flag, else an even share of `threads`."""
        share = max(1, self.threads // max(1, len(apis)))
        return {name: getattr(self, f"{name}_threads", None) or share for name in apis}
