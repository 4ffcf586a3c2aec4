"""Result-only stage keys (docs/architecture.md, "A stage field"): every field of the config flipped one at a time,
each stage's key function changes exactly for the fields that change that stage's result, and for each of its
upstream stages' keys. No stage runs: key functions are pure functions of the config and the upstream keys."""
from __future__ import annotations

import pytest

from eagle3_core.config import PipelineConfig
from eagle3_core.pipeline.keys import UPSTREAM
from eagle3_core.pipeline.table import STAGES

TARGET = ("target.model", "target.gguf_file", "target.revision", "target.trust_remote_code")
EVAL = ("eval.evaluator", "eval.num_draft_steps", "eval.max_new_tokens", "eval.tie_gap", "eval.tree_topk",
        "eval.tree_num_draft_tokens", "eval.tree_prompts", "eval.untrained_prompts", "eval.sampling")
DRAFT = ("draft.draft_vocab_size", "draft.seed", "draft.num_attention_heads", "draft.num_key_value_heads",
         "draft.head_dim", "draft.intermediate_size", "draft.rope_theta", "draft.rope_scaling",
         "draft.max_position_embeddings", "draft.num_hidden_layers", "draft.variant")

# the fields each stage's key hashes, at the base config below (fields that count only in some settings, e.g.
# train.window_context for packed rows, are tested on their own further down)
IN_KEY = {
    "prompts": {"prompts.sources", "prompts.mix", "prompts.num_train", "prompts.num_eval", "prompts.eval_ids",
                "prompts.seed", "prompts.max_reject_frac", "prompts.over_budget", *TARGET, "features.max_length",
                "generation.max_new_tokens", "generation.chat_template_kwargs"},
    "generation": {"generation.api", "generation.max_new_tokens", "generation.temperature", "generation.top_p",
                   "generation.chat_template_kwargs", "generation.turns", "generation.max_turns",
                   "generation.shard_size", "generation.max_failed_frac", "generation.max_empty_frac",
                   "generation.max_truncated_frac", "generation.max_degenerate_frac", "server.kind", *TARGET},
    # generation.turns 'all' (and a keep source's kept choice): the history rule (tokenize_stage.history_rule)
    "tokenize": {"features.max_length", "prompts.overlong", "generation.turns", *TARGET},
    "features": {"features.aux_layer_ids", "features.max_length", "features.shard_samples", "features.format",
                 "features.import_from", *TARGET},
    "vocab": {"draft.draft_vocab_size", "train.init_from"},
    "train": {"train.epochs", "train.lr", "train.warmup_frac", "train.batch_tokens", "train.grad_accum",
              "train.grad_clip", "train.ttt_length", "train.step_weight", "train.eval_frac", "train.seed",
              "train.batching", "train.init_from", "train.init_vocab", "train.max_epochs", "train.max_train_s", "train.loss",
              *DRAFT},
    "evaluate": {*EVAL, "eval.serving"},                  # a declared serving setting is measured too
    "deploy-llama-cpp": {"eval.num_draft_steps", "eval.max_new_tokens", "eval.sampling", "eval.serving"},
    "deploy-sglang": {*TARGET, "eval.num_draft_steps", "eval.sampling", "deploy_sglang.enabled", "deploy_sglang.baseline_url",
                      "deploy_sglang.eagle3_url", "deploy_sglang.tp_size", "deploy_sglang.ep_size",
                      "deploy_sglang.extra_args", "deploy_sglang.num_steps", "deploy_sglang.topk",
                      "deploy_sglang.num_draft_tokens", "deploy_sglang.concurrency",
                      "deploy_sglang.max_running_requests", "deploy_sglang.cuda_graph_max_bs",
                      "deploy_sglang.max_new_tokens", "deploy_sglang.per_category"},
}


def _flips(tmp_path) -> dict[str, object]:
    """Another valid value for every field of PipelineConfig (dotted path), against the base config."""
    draft = tmp_path / "warm"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"weights")
    imported = tmp_path / "specforge"
    imported.mkdir()
    (imported / "data_0.ckpt").write_bytes(b"features")
    return {
        "target.model": "org/other-target", "target.gguf_file": "target.gguf", "target.revision": "abc123",
        "target.trust_remote_code": True,
        "prompts.sources": [str(tmp_path / "other.jsonl")], "prompts.num_train": 121, "prompts.num_eval": 17,
        "prompts.mix": {"name": "m", "sources": [{"path": str(tmp_path / "m.jsonl"), "count": 136}]},
        "prompts.eval_ids": [f"p{i}" for i in range(16)], "prompts.seed": 1, "prompts.max_reject_frac": 0.5,
        "prompts.overlong": "drop", "prompts.over_budget": "long",
        "server.kind": "sglang", "server.url": "http://127.0.0.1:30000", "server.urls": ["http://127.0.0.1:30001"],
        "server.host": "0.0.0.0", "server.port": 8080, "server.parallel": 8, "server.ctx_per_slot": 4096,
        "server.extra_args": ["--x"], "server.startup_timeout_s": 60.0, "server.probe_interval_s": 1.0,
        "server.down_timeout_s": 60.0,
        "generation.api": "sglang", "generation.max_new_tokens": 64, "generation.temperature": 0.7,
        "generation.concurrency": 8, "generation.max_retries": 2, "generation.retry_backoff_s": 2.0,
        "generation.request_timeout_s": 60.0, "generation.shard_size": 512, "generation.flush_rows": 8,
        "generation.flush_s": 5.0, "generation.progress_interval_s": 5.0, "generation.max_failed_frac": 0.1,
        "generation.max_empty_frac": 0.1, "generation.max_truncated_frac": 0.5, "generation.max_degenerate_frac": 0.1,
        "generation.gate_after": 8, "generation.top_p": 0.9, "generation.chat_template_kwargs": {"enable_thinking": 0},
        "generation.turns": "all", "generation.max_turns": 3, "generation.top_k": 20, "generation.seed": 3,
        "features.aux_layer_ids": [1, 2, 3], "features.max_length": 1024, "features.shard_samples": 32,
        "features.batch_tokens": 8192, "features.format": "fp8", "features.writer_threads": 4,
        "features.import_from": str(imported), "features.backend": "ep_int4", "features.mix_backends": True,
        "features.tp_size": 4, "features.expert_parallel": True, "features.shard_attention": False,
        "features.mem_fraction_static": 0.7, "features.min_on_policy": 0.5,
        "draft.draft_vocab_size": 16000, "draft.seed": 1, "draft.num_attention_heads": 8,
        "draft.num_key_value_heads": 2, "draft.head_dim": 64, "draft.intermediate_size": 1024,
        "draft.rope_theta": 1e6, "draft.rope_scaling": "none", "draft.max_position_embeddings": 4096,
        "draft.num_hidden_layers": 2, "draft.variant": "eagle3.1",
        "train.epochs": 3, "train.max_epochs": 12, "train.max_train_s": 600.0, "train.lr": 2e-3, "train.warmup_frac": 0.1, "train.batch_tokens": 2048,
        "train.grad_accum": 2, "train.grad_clip": 1.0, "train.ttt_length": 5, "train.step_weight": 0.9,
        "train.eval_frac": 0.1, "train.seed": 1, "train.checkpoint_every": 7, "train.keep_checkpoints": 1,
        "train.device": "cuda:1", "train.attention": "eager", "train.compile": True, "train.batching": "packed",
        "train.graph": "row", "train.window_context": 64, "train.init_from": str(draft), "train.init_vocab": "rebuild",
        "train.loss": "tv",
        "eval.evaluator": "decode", "eval.num_draft_steps": 3, "eval.max_new_tokens": 64, "eval.tie_gap": 0.01,
        "eval.tree_topk": 2, "eval.tree_num_draft_tokens": 4, "eval.tree_prompts": 3, "eval.untrained_prompts": 3,
        "eval.sampling": {"temperature": 0.7, "top_p": 0.95}, "eval.sampled_seeds": 2,
        "eval.serving": {"temperature": 1.0, "top_p": 0.95},
        "deploy_sglang.enabled": "off", "deploy_sglang.baseline_url": "http://127.0.0.1:1",
        "deploy_sglang.eagle3_url": "http://127.0.0.1:2", "deploy_sglang.tp_size": 2, "deploy_sglang.ep_size": 2,
        "deploy_sglang.extra_args": ["--y"], "deploy_sglang.num_steps": 3, "deploy_sglang.topk": 2,
        "deploy_sglang.num_draft_tokens": 4, "deploy_sglang.concurrency": [1], "deploy_sglang.max_running_requests": 8,
        "deploy_sglang.cuda_graph_max_bs": 8, "deploy_sglang.max_new_tokens": 64, "deploy_sglang.per_category": 2,
        "deploy_sglang.startup_timeout_s": 60.0,
    }


def _base(tmp_path) -> dict:
    """The base config as a dict: a local target directory (a GGUF file of 4 bytes beside it), padded batches
    (so that the device cannot change how 'auto' resolves on whatever machine runs the test), explicit aux layers
    (an import needs them) and the hf_tp backend on 2 ranks (so that the parallel fields can flip)."""
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "target.gguf").write_bytes(b"GGUF")
    cfg = PipelineConfig(run_dir=tmp_path / "run", target={"model": str(tmp_path / "target")},
                         train={"batching": "padded"},
                         features={"aux_layer_ids": [1, 14, 26], "backend": "hf_tp", "tp_size": 2})
    return cfg.model_dump(mode="json")


def _with(base: dict, path: str, value) -> PipelineConfig:
    section, field = path.split(".")
    data = {**base, section: {**base[section], field: value}}
    return PipelineConfig.model_validate(data)


def _up(stage: str, **changed) -> dict:
    return {u: changed.get(u, f"key of {u}") for u in UPSTREAM[stage]}


def test_every_field_is_classified_and_each_key_changes_exactly_for_the_fields_in_it(tmp_path):
    base, flips = _base(tmp_path), _flips(tmp_path)
    leaves = {f"{s}.{f}" for s, v in base.items() if isinstance(v, dict) for f in v}
    assert set(flips) == leaves, f"new config fields: give them a value here and a stage: {leaves ^ set(flips)}"
    cfg0 = PipelineConfig.model_validate(base)
    keys0 = {name: s.key(cfg0, _up(name)) for name, s in STAGES.items()}
    changed = {name: set() for name in STAGES}
    for path, value in flips.items():
        cfg = _with(base, path, value)
        for name, s in STAGES.items():
            if s.key(cfg, _up(name)) != keys0[name]:
                changed[name].add(path)
    for name in STAGES:
        assert changed[name] == IN_KEY[name], (name, "in the key but expected out:", changed[name] - IN_KEY[name],
                                               "expected in the key:", IN_KEY[name] - changed[name])
        for u in UPSTREAM[name]:                                   # keys chain: each upstream key counts
            assert STAGES[name].key(cfg0, _up(name, **{u: "another key"})) != keys0[name], (name, u)


def test_the_train_key_hashes_the_batching_asked_for_not_the_host(tmp_path, monkeypatch):
    """'auto' is padded batches on a CPU and packed rows on CUDA (setup.resolved_batching): the key hashes what the
    user asked for, so that it is the same on every host (a run moved from a GPU node to a CPU box keeps its
    work); the window context counts unless the rows are padded. The keys 'auto' had when it was hashed as resolved
    (packed on CUDA, padded on a CPU) stay accepted (Stage.older)."""
    base, up = _base(tmp_path), _up("train")

    def cfg(**train):
        return PipelineConfig.model_validate({**base, "train": {**base["train"], **train}})

    def key(**train):
        return STAGES["train"].key(cfg(**train), up)
    on_cpu = key(batching="auto", device="cpu")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert on_cpu == key(batching="auto", device="cuda:1") == key(batching="auto") != key(batching="padded")
    assert key(batching="padded") == key(batching="padded", device="cuda") != key(batching="packed")
    assert key(batching="packed", window_context=64) != key(batching="packed")
    assert key(batching="auto", window_context=64) != key(batching="auto")
    assert key(batching="padded", window_context=64) == key(batching="padded")
    assert key(batching="packed", device="cpu", keep_checkpoints=1, checkpoint_every=3, attention="eager",
               compile=True, graph="row") == key(batching="packed")
    older = STAGES["train"].older(cfg(batching="auto"), up)
    assert {key(batching="packed"), key(batching="padded")} < set(older)
    assert STAGES["train"].older(cfg(batching="packed"), up) == STAGES["train"].older(cfg(batching="packed"), up)[-1:]


def test_the_plateau_rules_ceilings_count_only_with_epochs_unset_and_away_from_their_defaults(tmp_path):
    """train.max_epochs / max_train_s change the draft only when train.epochs is unset (the plateau rule); at their
    defaults they are not hashed, so a run keyed before the rule had them keeps its key."""
    from eagle3_core.pipeline.train_stage import train_recipe_fields
    base, up = _base(tmp_path), _up("train")

    def key(**train):
        return STAGES["train"].key(PipelineConfig.model_validate({**base, "train": {**base["train"], **train}}), up)
    assert "max_epochs" not in train_recipe_fields(PipelineConfig.model_validate(base))
    assert key(max_epochs=24, max_train_s=None) == key() != key(max_epochs=12) != key(max_train_s=200.0)
    assert key(epochs=6, max_epochs=12, max_train_s=200.0) == key(epochs=6)


def test_the_draft_capacity_options_count_only_away_from_their_defaults(tmp_path):
    """draft.num_hidden_layers and draft.variant at their defaults are not hashed: the train key is the one that
    hashed the draft settings before they existed (every other draft field, as written)."""
    from eagle3_core.pipeline.keys import stage_key
    from eagle3_core.pipeline.train_stage import train_recipe_fields
    base, up = _base(tmp_path), _up("train")
    cfg = PipelineConfig.model_validate(base)
    before = {k: v for k, v in cfg.draft.model_dump(mode="json").items() if k not in ("num_hidden_layers", "variant")}
    assert STAGES["train"].key(cfg, up) == stage_key(up["features"], up["vocab"], train_recipe_fields(cfg), before)

    def key(**draft):
        return STAGES["train"].key(PipelineConfig.model_validate({**base, "draft": {**base.get("draft", {}),
                                                                                     **draft}}), up)
    assert key(num_hidden_layers=1, variant="eagle3") == key() != key(num_hidden_layers=2) != key(variant="eagle3.1")


def test_the_evaluate_key_hashes_the_resolved_evaluator(tmp_path):
    """eval.evaluator 'auto' is replay for a sharded features backend and decode for 'hf' (resolved_evaluator):
    the backend counts where it changes the evaluator, and an explicit evaluator equal to the resolution is the
    same key."""
    base, up = _base(tmp_path), _up("evaluate")

    def key(evaluator, **features):
        data = {**base, "eval": {**base["eval"], "evaluator": evaluator}, "features": {**base["features"], **features}}
        return STAGES["evaluate"].key(PipelineConfig.model_validate(data), up)
    hf = {"backend": "hf", "tp_size": 1}
    assert key("auto") == key("replay") == key("auto", backend="ep_int4") != key("auto", **hf)
    assert key("auto", **hf) == key("decode", **hf) == key("decode")


@pytest.mark.parametrize("stage", ["prompts", "train", "evaluate", "deploy-llama-cpp", "deploy-sglang"])
def test_stages_whose_key_formula_changed_accept_the_older_key_of_the_same_settings(tmp_path, stage):
    """An older formula's key is accepted only for the settings it was computed from (contract.compat): a run
    finished before the keys hashed results only stays done, and changing a field its older key hashed (but the
    new one does not) no longer matches it."""
    base = _base(tmp_path)
    cfg, up = PipelineConfig.model_validate(base), _up(stage)
    older = STAGES[stage].older(cfg, up)
    assert len(older) == 1 and older[0] != STAGES[stage].key(cfg, up)
    moved = {"prompts": ("prompts.overlong", "truncate" if base["prompts"]["overlong"] == "drop" else "drop"),
             "train": ("train.keep_checkpoints", 1), "evaluate": ("eval.evaluator", "replay"),
             "deploy-llama-cpp": ("server.host", "0.0.0.0"), "deploy-sglang": ("deploy_sglang.startup_timeout_s", 9.0)}
    other = _with(base, *moved[stage])
    assert STAGES[stage].key(other, up) == STAGES[stage].key(cfg, up)          # out of today's key
    assert STAGES[stage].older(other, up) != older                            # in the older one


def test_sampling_settings_count_only_when_sampled_and_a_greedy_key_is_the_key_before_them(tmp_path):
    """generation.top_k / seed and eval.sampled_seeds change the answers only when sampled, so they count only then
    (and top_k / seed only when set: a sampled run's key from before they existed stays its key); the declared
    serving settings count where they differ from eval.sampling (evaluate measures at them too), not where they
    are the same. A greedy evaluate key without serving settings is the formula before eval.sampling existed."""
    from eagle3_core.features.backends import resolved_evaluator
    from eagle3_core.pipeline.keys import stage_key
    base = _base(tmp_path)

    def key(stage, section, **fields):
        return STAGES[stage].key(PipelineConfig.model_validate({**base, section: {**base[section], **fields}}),
                                 _up(stage))
    assert key("generation", "generation", top_k=20) == key("generation", "generation", seed=3) \
        == key("generation", "generation")
    hot = {"temperature": 0.7}
    assert len({key("generation", "generation", **hot), key("generation", "generation", **hot, top_k=20),
                key("generation", "generation", **hot, seed=3)}) == 3
    assert key("evaluate", "eval", sampled_seeds=9) == key("evaluate", "eval", serving={"temperature": 0.0}) \
        == key("evaluate", "eval", sampling={"temperature": 0.0, "top_p": 0.5, "seed": 4}) == key("evaluate", "eval")
    assert key("evaluate", "eval", serving={"temperature": 1.0}) != key("evaluate", "eval")
    sampled = {"temperature": 0.7}
    assert len({key("evaluate", "eval", sampling=sampled), key("evaluate", "eval", sampling=sampled, sampled_seeds=9),
                key("evaluate", "eval", sampling={**sampled, "seed": 1}), key("evaluate", "eval")}) == 4
    assert key("evaluate", "eval", sampling=sampled, serving=sampled) == key("evaluate", "eval", sampling=sampled)
    assert key("evaluate", "eval", sampling=sampled, serving={"temperature": 1.0}) != key("evaluate", "eval",
                                                                                          sampling=sampled)
    cfg, up = PipelineConfig.model_validate(base), _up("evaluate")
    before = {**cfg.eval.model_dump(mode="json", include={f.split(".")[1] for f in EVAL if f != "eval.sampling"}),
              "evaluator": resolved_evaluator(cfg.eval.evaluator, cfg.features.backend)}
    assert STAGES["evaluate"].key(cfg, up) == stage_key(up["train"], before, up["prompts"])
    # older runs all trained with 'kl' and measured greedily: their keys never stand for 'tv' or sampled settings
    assert STAGES["train"].older(_with(base, "train.loss", "tv"), _up("train")) == ()
    assert STAGES["evaluate"].older(_with(base, "eval.sampling", sampled), up) == ()


def test_sampling_settings_count_in_the_keys_of_the_stages_that_measure_at_them(tmp_path):
    """eval.sampling changes what evaluate and both deployments measure, the declared eval.serving what evaluate
    and the llama.cpp deployment measure (eval.measured_samplings), not the SGLang benchmark's; greedy alone keeps
    the key (and the older one) a run had before."""
    base = _base(tmp_path)

    def keys(**ev):
        cfg = PipelineConfig.model_validate({**base, "eval": {**base["eval"], **ev}})
        return {st: (STAGES[st].key(cfg, _up(st)), STAGES[st].older(cfg, _up(st)))
                for st in ("evaluate", "deploy-llama-cpp", "deploy-sglang")}
    greedy, served = keys(), keys(serving={"temperature": 0.7})
    sampled = keys(sampling={"temperature": 0.7})
    assert keys(sampling={"temperature": 0.0, "top_p": 0.5}) == greedy     # greedy ignores top_p
    assert served["deploy-sglang"] == greedy["deploy-sglang"]
    for st in ("evaluate", "deploy-llama-cpp"):
        assert served[st][0] != greedy[st][0] and served[st][1] == () and len(greedy[st][1]) == 1
    for st in ("evaluate", "deploy-llama-cpp", "deploy-sglang"):
        assert sampled[st][0] not in (greedy[st][0], served[st][0]) and sampled[st][1] == ()
