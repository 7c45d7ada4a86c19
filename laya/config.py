"""`rl_agent_config.json` as a dataclass.

The checkpoint config is the contract between whoever trained a model and whoever serves it, so
unknown keys (training provenance, calibration extras) are kept verbatim in `extra` and written
back by `to_dict`: a load/save round trip must never lose what another tool put there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LEN = 512
DEFAULT_HEAD_MAX_LEN = 192


@dataclass
class LayaConfig:
    encoder: str = "answerdotai/ModernBERT-base"
    head_layers: int = 2
    act_costs: dict[str, float] = field(default_factory=dict)
    max_len: int = DEFAULT_MAX_LEN
    head_max_len: int = DEFAULT_HEAD_MAX_LEN
    # Raw values as shipped; `laya.calibration` clamps them at inference, the file keeps what was fitted.
    temperature: list[Any] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    temperature_by_options: dict[str, Any] = field(default_factory=dict)
    option_layout: str = "sequential"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_act(self) -> int:
        """The act head has one output per costed action plus "answer now" at index 0."""
        return len(self.act_costs) + 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayaConfig:
        if not isinstance(data, dict):
            raise ValueError(f"rl_agent_config.json: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("head_layers", "max_len", "head_max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"rl_agent_config.json: {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.act_costs, dict):
            raise ValueError(f"rl_agent_config.json: act_costs must be an object, got {self.act_costs!r}")
        if not isinstance(self.temperature, (list, tuple)) or len(self.temperature) != 3:
            raise ValueError(f"rl_agent_config.json: temperature must be a list of 3 numbers, got {self.temperature!r}")
        if not isinstance(self.temperature_by_options, dict):
            raise ValueError(f"rl_agent_config.json: temperature_by_options must be an object, got {self.temperature_by_options!r}")
        if self.option_layout != "sequential":
            raise ValueError(f"rl_agent_config.json: option_layout {self.option_layout!r} is not supported (only 'sequential')")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["temperature"] = list(self.temperature)
        return {**out, **self.extra}
