"""Server configuration: the process settings here, each API's own settings as a section of them.

Every limit the server enforces is a field of `ServeConfig` or of an API's section, so an operator finds
all of them in `pagoda serve --help` and an error names the flag and the variable that set a bad value
(`serving.flags` generates both from the fields). An API adds its settings by adding a section here.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.decide.config import DecideConfig
from serving.flags import Settings, option, section


@dataclass
class ServeConfig(Settings):
    host: str = option("127.0.0.1", "bind address")
    port: int = option(8000, "bind port (0 picks a free one)", minimum=0, maximum=65535)
    workers: int = option(1, "gunicorn worker processes; each holds its own models and model-worker threads",
                          minimum=1)
    threads: int = option(64, "request threads per worker; concurrent requests beyond this queue in the kernel",
                          minimum=1)
    api_key: str | None = option(None, "require `Authorization: Bearer <key>` (environment only)", env_only=True)
    request_timeout_s: float = option(30.0, "deadline per request; past it the request gets 504", positive=True)
    max_body_bytes: int = option(1 << 20, "largest request body; past it 413", minimum=1)
    graceful_timeout_s: float = option(30.0, "on SIGTERM, how long in-flight requests get to finish", minimum=0)
    access_log: bool = option(True, "one JSON line per request on stderr")
    decide: DecideConfig = section(DecideConfig)
