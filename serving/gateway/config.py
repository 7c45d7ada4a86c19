"""The gateway's settings: where the upstreams are, how they are watched, and what routes between them.

Declared once as `Settings` fields, like `pagoda serve`'s, so each is a flag and a `PAGODA_*` variable
(flags win). A config file (`--config FILE`, YAML or JSON, the same names as keys) is the layer under
the variables: its values go through the same parsing and bounds as a variable's, so a file cannot set
what a variable could not. `--upstream NAME=URL` repeats; a variable or a file holds the list joined by
commas (`PAGODA_UPSTREAM=edge=http://a:8000,frontier=http://b:8000`).

The process fields (host, port, threads, ...) have `pagoda serve`'s names and meanings, so the core's
app factory and gunicorn wrapper run the gateway unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from serving.config import MAX_WORKERS, FrontSettings
from serving.decide.config import DecideConfig
from serving.decide.mapping_file import read_mapping
from serving.flags import MAX_TORCH_THREADS, option

GROUP_NAME = re.compile(r"[A-Za-z_][\w-]*")  # a group is named by a routing rule, so it is a rule name


@dataclass(frozen=True)
class UpstreamSpec:
    group: str
    url: str       # scheme://host:port, no trailing slash
    base_path: str  # a path prefix the upstream is mounted under ("" for none)


@dataclass
class GatewayConfig(FrontSettings):
    upstream: str | None = option(None, "an upstream server as NAME=URL (repeat the flag; a variable or config file "
                                        "joins them with commas); upstreams sharing a NAME form a group of replicas")
    route: str | None = option(None, "rules file (YAML or JSON): Laya questions about each request and the rules "
                                     "that pick an upstream group from their answers (docs/gateway.md)")
    config: str | None = option(None, "YAML or JSON file of these settings by name, read under the variables")
    host: str = option("127.0.0.1", "bind address")
    port: int = option(8080, "bind port (0 picks a free one)", minimum=0, maximum=65535)
    workers: int = option(1, f"gunicorn worker processes, 1-{MAX_WORKERS}; each has its own connection pools, "
                             "health checks and decision model", minimum=1, maximum=MAX_WORKERS)
    threads: int = option(128, "request threads per worker: one per request in flight, a stream holds one until "
                               "its last event", minimum=1)
    api_key: str | None = option(None, "require `Authorization: Bearer <key>` (environment only)", env_only=True)
    max_body_bytes: int = option(1 << 20, "largest request body; past it 413", minimum=1)
    graceful_timeout_s: float = option(30.0, "on SIGTERM, how long in-flight requests get to finish", minimum=0)
    access_log: bool = option(True, "one JSON line per request on stderr")
    connect_timeout_s: float = option(2.0, "longest wait to connect to an upstream; past it 504", positive=True)
    upstream_timeout_s: float = option(600.0, "longest wait for the next byte from an upstream (the whole answer "
                                              "of a non-streamed request); past it 504, or an error event in "
                                              "a stream", positive=True)
    retry: bool = option(False, "retry a non-streamed request that could not reach its upstream (refused, reset, "
                                "invalid answer; never a timeout) on another upstream of the same group")
    health_path: str = option("/health", "GET path of an upstream's health check (2xx is healthy)")
    health_interval_s: float = option(2.0, "seconds between two health checks of one upstream", positive=True)
    health_timeout_s: float = option(1.0, "a health check not answered within this fails", positive=True)
    health_fails: int = option(2, "consecutive failures (checks, or requests that could not connect) that take "
                                  "an upstream out of rotation", minimum=1)
    health_passes: int = option(2, "consecutive passed checks that put it back", minimum=1)
    model: str | None = option(None, "Laya checkpoint that answers the rules' questions (default: the embedded "
                                     "laya-mini); loaded only when the rules ask questions")
    student: str | None = option(None, "a distilled student folder to answer them instead")
    device: str = option("cpu", "torch device for the Laya model")
    torch_threads: int = option(1, "torch intra-op threads for the decision model (0: torch's default; the "
                                   "gateway shares its cores with whatever it fronts)", minimum=0,
                                maximum=MAX_TORCH_THREADS)
    decision_timeout_s: float = option(5.0, "a routing decision not made within this takes the default route",
                                       positive=True)
    decision_max_wait_ms: float = option(2.0, "how long the decision batcher may wait for requests still being "
                                              "prepared to share a forward pass", minimum=0)
    decision_max_chars: int = option(50000, "the most characters of a request the rules' questions read: a longer "
                                            "text is cut to its first (a conversation to its last) this many, so "
                                            "a long prompt costs its decision no more than this (the routing "
                                            "model reads at most its max_len tokens of them)", minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model and self.student:
            raise ValueError(f"give either {self.where('model')} or {self.where('student')}, not both")
        if not self.health_path.startswith("/"):
            raise ValueError(f"{self.where('health_path')} must start with '/', got {self.health_path!r}")
        for name in ("route", "model", "student"):
            path = getattr(self, name)
            if path and not Path(path).exists():
                raise ValueError(f"{self.where(name)} {path}: no such file or folder")
        if self.model or self.student:  # a folder that holds no model: refused here, not where a worker loads it
            self.decide_config()
        self.upstreams = parse_upstreams(self.upstream, self.where("upstream"))

    @classmethod
    def load(cls, flags: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """Flags, then `PAGODA_*` variables, then the `--config` file, then the defaults."""
        flags = dict(flags or {})
        env = dict(os.environ if env is None else env)
        path = flags.get("config") or env.get("PAGODA_CONFIG")
        layered = {**(_file_as_variables(str(path)) if path else {}), **env}
        upstream = flags.get("upstream")
        if isinstance(upstream, list):  # the repeated flag
            flags["upstream"] = ",".join(upstream)
        return cls.from_sources(flags, layered)

    # What the core's app factory and gunicorn wrapper read, under `ServeConfig`'s names.

    @property
    def request_timeout_s(self) -> float:
        return self.decision_timeout_s

    def thread_budgets(self, apis: list[str]) -> dict[str, int]:
        return {name: self.threads for name in apis}

    def decide_config(self) -> DecideConfig:
        """The decision model's settings, for `serving.decide`'s service (its limits are HTTP ones: unused)."""
        return DecideConfig(model=self.model, student=self.student, device=self.device,
                            torch_threads=self.torch_threads, presets="", max_wait_ms=self.decision_max_wait_ms)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda gateway`'s flags, for its command and for a bench that checks a gateway's flags before starting
    it. `parser` must resolve conflicts: `--upstream` is declared again, as a flag that repeats."""
    GatewayConfig.add_arguments(parser)
    parser.add_argument("--upstream", action="append", default=None, metavar="NAME=URL",
                        help="an upstream server; repeat for more; the same NAME twice makes a group of replicas "
                             "[env PAGODA_UPSTREAM, comma-separated]")


def parse_upstreams(text: str | None, where: str) -> list[UpstreamSpec]:
    if not text or not text.strip():
        raise ValueError(f"{where}: give at least one upstream as NAME=URL")
    specs: list[UpstreamSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not GROUP_NAME.fullmatch(name):
            raise ValueError(f"{where}: {item!r} is not NAME=URL with NAME an identifier (letters, digits, _ and -)")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"{where}: upstream {name!r}: {url!r} is not an http(s)://host[:port][/path] URL")
        try:
            _ = parts.port  # urllib parses the port only when asked for it
        except ValueError:
            raise ValueError(f"{where}: upstream {name!r}: {url!r} has a bad port") from None
        if any(s.url == f"{parts.scheme}://{parts.netloc}" and s.base_path == parts.path for s in specs):
            raise ValueError(f"{where}: upstream {url!r} is given twice")
        specs.append(UpstreamSpec(name, f"{parts.scheme}://{parts.netloc}", parts.path))
    if not specs:
        raise ValueError(f"{where}: give at least one upstream as NAME=URL")
    return specs


def _file_as_variables(path: str) -> dict[str, str]:
    """A config file's settings as the `PAGODA_*` variables they stand for."""
    data = read_mapping(path, "config")
    names = {f.name for f in dataclasses.fields(GatewayConfig) if f.metadata.get("flag", True)} - {"config"}
    out: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise ValueError(f"config file {path}: unknown setting {key!r}; settings: {', '.join(sorted(names))}")
        out["PAGODA_" + name.upper()] = _as_text(name, value, path)
    return out


def _as_text(name: str, value: Any, path: str) -> str:
    if name == "upstream" and isinstance(value, dict):  # {edge: URL, frontier: [URL, URL]}
        return ",".join(f"{group}={url}" for group, urls in value.items()
                        for url in (urls if isinstance(urls, list) else [urls]))
    if name == "upstream" and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict | list) or value is None:
        raise ValueError(f"config file {path}: {name} must be a single value, got {type(value).__name__}")
    return str(value)
