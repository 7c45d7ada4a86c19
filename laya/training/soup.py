"""A uniform model soup of laya-mini fine-tunes: one run of a recipe per seed, their weights averaged
(`pagoda laya-mini finetune --seeds 6,7,8`).

Why average rather than pick a seed: on the 6-layer recipe (docs/laya-mini-log.md, Dec 5) one seed's run moves the
summed ticket log loss between 1.38 and 1.47 and seed 8 loses acceptance sentence 2, so a single run is partly a
draw. The members start from one checkpoint and train the same recipe, so their weights stay close enough that
the average is itself a good model (Wortsman et al., "Model soups", 2022) and keeps what the seeds agree on: the
soup of seeds 6, 7 and 8 keeps all four acceptance sentences, which seed 8 alone loses, and answers each held-out
intent set above its members' mean.

Why the temperatures are fitted on the members' calib files pooled (unique rows): each member draws its own 300
intent calibration decisions from the data sets' validation split (never training rows, whatever the seed), so
the soup has three draws to fit on, and the `choice:2` bucket, which one draw fills with ~12 rows, gets enough.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from laya.training.finetune import FinetuneConfig


def member_config(cfg: FinetuneConfig, seed: int) -> FinetuneConfig:
    """The run a soup trains for `seed`: the recipe as given, its own folder under `out`, no head of its own."""
    return replace(cfg, seed=seed, out=str(Path(cfg.out) / "members" / f"seed-{seed}"), head_dir="")


def check_seeds(cfg: FinetuneConfig, seeds: list[int]) -> None:
    if len(seeds) < 2 or len(set(seeds)) != len(seeds) or any(isinstance(s, bool) or not isinstance(s, int)
                                                               for s in seeds):
        raise ValueError(f"--seeds: give two or more distinct integer seeds, got {seeds!r}")
    if cfg.steps == 0:
        raise ValueError("--seeds: a soup averages trained runs; --steps 0 trains none")
    member_config(cfg, seeds[0]).validate()
    if cfg.init and Path(cfg.out).resolve() in Path(cfg.init).resolve().parents:
        raise ValueError("--out: must not hold --init (the soup writes its members there)")


def average_weights(members: list[Path], out: Path) -> None:
    """`out`'s weights become the element-wise mean of the members' (in float64, stored in each tensor's own
    dtype, F16 as shipped); the encoder config and tokenizer are the first member's, which all share."""
    import torch
    from safetensors.torch import load_file, save_file

    states = [load_file(str(m / "model.safetensors")) for m in members]
    if any(s.keys() != states[0].keys() for s in states):
        raise ValueError("soup: the members' checkpoints hold different tensors")
    mean = {}
    for k, v in states[0].items():
        mean[k] = (torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype) if v.is_floating_point()
                   else v).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("encoder", "tokenizer"):
        shutil.copytree(members[0] / name, out / name, dirs_exist_ok=True)
    save_file(mean, str(out / "model.safetensors"))
    shutil.copy(members[0] / "rl_agent_config.json", out / "rl_agent_config.json")


def pooled_calib(members: list[Path], path: Path) -> Path:
    lines = dict.fromkeys(line for m in members
                          for line in (m / "calib.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def average_and_fit(members: list[Path], out: Path, recipe: dict[str, Any], calib_members: list[Path]):
    """The part both soups share: `out` = the members' mean with `recipe` recorded in its config, temperatures
    fitted on `calib_members`' calib rows pooled. Returns the fit, its evaluation and the summary's calib entry."""
    from laya.training import calibrate as cal

    average_weights(members, out)
    config = json.loads((out / "rl_agent_config.json").read_text())
    config.setdefault("laya_mini", {})["fine_tune"] = recipe
    (out / "rl_agent_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    fit, ev = cal.calibrate(str(out), str(pooled_calib(calib_members, out / "calib.jsonl")))
    return fit, ev, {"ece15_before": ev["all"]["before"]["ece15"], "ece15_after": ev["all"]["after"]["ece15"],
                     "n": ev["all"]["after"]["n"]}


def soup(cfg: FinetuneConfig, seeds: list[int], progress: bool = True) -> dict[str, Any]:
    """Train `cfg` once per seed into `out/members/seed-N`, average them into `out`, refit the temperatures on
    the pooled calib rows; `cfg.head_dir` publishes the soup, not a member. Returns a summary."""
    from laya.corpus.build import CorpusConfig, build
    from laya.training.finetune import finetune, publish

    check_seeds(cfg, seeds)
    t0 = time.time()
    out = Path(cfg.out)
    runs = []
    for seed in seeds:
        runs.append(finetune(member_config(cfg, seed), progress=progress))
    members = [Path(member_config(cfg, s).out) for s in seeds]
    t = time.time()
    recipe = {**{k: v for k, v in asdict(cfg).items() if k != "seed"}, "seeds": list(seeds)}
    fit, ev, calib = average_and_fit(members, out, recipe, members)
    times = {"train": sum(r["times_s"]["train"] for r in runs), "calibrate": time.time() - t,   # train: all members
             "total": time.time() - t0}
    summary = {"steps": cfg.steps, "seeds": list(seeds), "times_s": times, "threads": runs[0]["threads"],
               "members": {str(s): {"final_loss": r["final_loss"], "temperature_by_options": r["temperature_by_options"]}
                           for s, r in zip(seeds, runs)},
               "temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options, "calib": calib}
    (out / "finetune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.head_dir:
        corpus = build(CorpusConfig(seed=seeds[0], **cfg.corpus))   # the first member's test split
        publish(cfg, out, corpus, fit, ev, summary, recipe={**recipe, "head_dir": cfg.head_dir},
                how="pagoda laya-mini finetune --seeds")
    return summary


def soup_checkpoints(members: list[Path], out: Path, head_dir: str = "") -> dict[str, Any]:
    """Average finished laya-mini checkpoints into `out` and refit its temperatures (`pagoda laya-mini soup`).

    Why a second way in: round 6 was the mean of two soups from one parent, round 5's mix and the same recipe
    with the natural training tickets in the mix (docs/laya-mini-log.md, round 6; round 7 is made the same way). Each alone lost something the other
    kept (acceptance sentence 1; 10 points of department on natural text); both are already trained, so this
    averages checkpoints rather than training members. The temperatures are fitted on the calib rows of the
    members that carry them (a fine-tune writes `calib.jsonl`; an assembled checkpoint has none), pooled."""
    from laya.corpus.build import CorpusConfig, build
    from laya.training.finetune import publish

    members = [Path(m) for m in members]
    if len(members) < 2 or len({m.resolve() for m in members}) != len(members):
        raise ValueError(f"--members: give two or more distinct checkpoint folders, got {[str(m) for m in members]}")
    for m in members:
        if not (m / "rl_agent_config.json").is_file() or not (m / "model.safetensors").is_file():
            raise FileNotFoundError(f"--members: {m} is not a laya-mini checkpoint folder "
                                    "(no rl_agent_config.json / model.safetensors)")
    if Path(out).resolve() in {m.resolve() for m in members}:
        raise ValueError("--out: must not be one of --members (they are read while it is written)")
    with_calib = [m for m in members if (m / "calib.jsonl").is_file()]
    if not with_calib:
        raise FileNotFoundError("--members: none carries calib.jsonl (a fine-tune's output does), so there are "
                                "no calibration rows to fit the soup's temperatures on")
    t0 = time.time()
    out = Path(out)
    recipes = [json.loads((m / "rl_agent_config.json").read_text()).get("laya_mini", {}).get("fine_tune")
               for m in members]
    recipe = {"soup_of": [str(m) for m in members], "recipes": recipes}
    fit, ev, calib = average_and_fit(members, out, recipe, with_calib)
    summary = {"members": [str(m) for m in members], "times_s": {"train": 0.0, "total": time.time() - t0},
               "temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options, "calib": calib}
    (out / "finetune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if head_dir:
        first = next((r for r in recipes if r and r.get("corpus")), None)   # the test split the metrics read
        seed = (first.get("seeds") or [first.get("seed", 0)])[0] if first else 0
        corpus = build(CorpusConfig(seed=seed, **(first["corpus"] if first else {})))
        publish(FinetuneConfig(head_dir=head_dir), out, corpus, fit, ev, summary,
                recipe={**recipe, "head_dir": head_dir}, how="pagoda laya-mini soup")
    return summary
