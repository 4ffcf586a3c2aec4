"""The shipped Kimi-K2.5 configs (configs/kimi_k25_*.json) as the reference rehearsal runs them: read as shipped,
with only a DECLARED list of fields overridden, each a size (counts, lengths, shard sizes, epochs) or a location
(the target path, each source's local fixture file, the stand-in server's URL and `sglang_python`). `rehearsal_config`
refuses any other field and `overridden_fields` lists what differs from the shipped file, so a test can assert that
everything else stays as shipped."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from conftest import ROOT
from eagle3_core.config import PipelineConfig
from eagle3_core.config.mix_presets import MIXES

CONFIGS = ROOT / "configs"

# dotted field paths (a `*` matches a list index) -> why the rehearsal may change them
SIZES = {
    "prompts.num_train", "prompts.num_eval", "prompts.mix.sources.*.count", "prompts.mix.sources.*.max_rows",
    "generation.max_new_tokens", "generation.concurrency", "generation.shard_size", "generation.gate_after",
    "features.max_length", "features.shard_samples", "features.batch_tokens", "features.tp_size",
    "server.extra_args", "draft.draft_vocab_size", "train.epochs", "train.batch_tokens", "train.window_context", "train.eval_frac",
    "eval.max_new_tokens", "deploy_sglang.tp_size", "deploy_sglang.concurrency",
}
LOCATIONS = {
    "run_dir", "sglang_python", "target.model", "target.revision", "target.trust_remote_code",
    "prompts.mix.sources.*.hf", "prompts.mix.sources.*.revision", "prompts.mix.sources.*.data_files",
    "prompts.mix.sources.*.split", "prompts.mix.sources.*.config", "server.kind", "server.url",
    "deploy_sglang.baseline_url", "deploy_sglang.eagle3_url",
}
DECLARED = SIZES | LOCATIONS


def shipped(name: str) -> dict:
    """The config file configs/<name>.json as a dict, as shipped."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _expanded(cfg: dict) -> dict:
    """`cfg` with a preset mix named by prompts.mix (a string) written out as its sources (the same mix)."""
    cfg = copy.deepcopy(cfg)
    if isinstance(cfg.get("prompts", {}).get("mix"), str):
        cfg["prompts"]["mix"] = MIXES[cfg["prompts"]["mix"]].model_dump(mode="json", exclude_defaults=True)
    return cfg


def _flat(d, prefix: str = "") -> dict[str, object]:
    """{dotted path: leaf value}; a list of dicts is indexed, any other list is one leaf."""
    if isinstance(d, dict):
        return {k: v for key, val in d.items() for k, v in _flat(val, f"{prefix}{key}.").items()} or {prefix[:-1]: d}
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        return {k: v for i, x in enumerate(d) for k, v in _flat(x, f"{prefix}{i}.").items()}
    return {prefix[:-1]: d}


def _pattern(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def overridden_fields(name: str, cfg: dict) -> set[str]:
    """The declared-pattern paths (`prompts.mix.sources.*.count`) where `cfg` differs from configs/<name>.json."""
    a, b = _flat(_expanded(shipped(name))), _flat(_expanded(cfg))
    paths = {p for p in a.keys() | b.keys() if a.get(p, None) != b.get(p, None)}
    # a list leaf (server.extra_args) and the dict leaves below it are one field
    return {_pattern(p) for p in paths}


def rehearsal_config(name: str, overrides: dict[str, object],
                     sources: dict[str, dict] | None = None) -> PipelineConfig:
    """configs/<name>.json with `overrides` ({dotted path: value}) and, per mix source label, `sources` ({label:
    {field: value}}) applied. Raises AssertionError naming a field that is not DECLARED (a size or a location)."""
    cfg = _expanded(shipped(name)) if sources else copy.deepcopy(shipped(name))
    for path, value in overrides.items():
        assert _pattern(path) in DECLARED, f"{path} is neither a size nor a location: the rehearsal keeps it shipped"
        *head, leaf = path.split(".")
        node = cfg
        for key in head:
            node = node.setdefault(key, {})
        node[leaf] = value
    assert not set(sources or {}) - {s["name"] for s in cfg["prompts"]["mix"]["sources"]}, "unknown source"
    for spec in cfg["prompts"]["mix"]["sources"] if sources else []:
        for field, value in sources.get(spec["name"], {}).items():
            assert f"prompts.mix.sources.*.{field}" in DECLARED, f"source field {field} is not declared"
            spec[field] = value
    changed = overridden_fields(name, cfg)
    assert changed <= DECLARED, f"fields changed beyond the declared list: {sorted(changed - DECLARED)}"
    return PipelineConfig.model_validate(cfg)


def config_path(name: str) -> Path:
    return CONFIGS / f"{name}.json"
