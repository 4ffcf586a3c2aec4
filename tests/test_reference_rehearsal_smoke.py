"""The reference rehearsal's smoke config (docs/reference_case.md, "What the rehearsal proves"):
configs/kimi_k25_smoke.json as shipped, with only the declared sizes and locations of tests/rehearsal_configs.py
overridden, on the tiny Kimi-K2.5 target of tests/kimi_rehearsal.py (the session's, shared with the agentic
rehearsal), run stage by stage by the stages' own functions: prompts, generation through the SGLang token-API
stand-in, tokenize, features by the `sglang` backend on 2 gloo ranks through the SGLang stand-in
(tests/sglang_standin: the pinned 0.5.14's ModelRunner surface and its Kimi-K2.5 wrapper; its python this one, the
stand-in on PYTHONPATH, as `sglang_python`), vocab, train and export, replay evaluation (the aux states of the
recordings by the same `sglang` ranks) and deploy-sglang against stand-in servers by URL."""
import json
import sys

import pytest

import sglang_names
from eagle3_core.contract.layout import RunLayout
from eagle3_core.data.markers import target_markers
from eagle3_core.pipeline.deploy_stage import run_deploy_sglang
from eagle3_core.pipeline.evaluate_stage import run_evaluate
from eagle3_core.pipeline.features_stage import run_features
from eagle3_core.pipeline.generation_stage import run_generation
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from eagle3_core.pipeline.train_stage import run_train
from eagle3_core.pipeline.vocab_stage import run_vocab
from kimi_rehearsal import DeployStandIn, KimiStandIn, answers, local_sources, tokenizer
from rehearsal_configs import DECLARED, overridden_fields, rehearsal_config
from test_engine_aux_ids import sglang_capture  # noqa: F401  (the pinned wheel's capture rule, a fixture)

# the module's run starts two torchruns of 2 ranks (features, the replay's recording)
pytestmark = pytest.mark.slow
NUM_TRAIN, NUM_EVAL, MAX_NEW = 12, 3, 48


def smoke_config(root, target, url: str, deploy: dict[str, str]):
    """configs/kimi_k25_smoke.json at toy size: the declared overrides, and nothing else."""
    overrides = {
        "run_dir": str(root / "run"), "sglang_python": sys.executable,
        "target.model": str(target), "target.revision": None,
        "prompts.num_train": NUM_TRAIN, "prompts.num_eval": NUM_EVAL,
        "server.kind": "external", "server.url": url,
        "generation.max_new_tokens": MAX_NEW, "generation.concurrency": 1, "generation.shard_size": 8,
        "features.max_length": 512, "features.shard_samples": 4, "features.batch_tokens": 1024,
        "features.tp_size": 2, "draft.draft_vocab_size": 512, "train.batch_tokens": 1024,
        "eval.max_new_tokens": 32,
        "deploy_sglang.baseline_url": deploy["baseline"], "deploy_sglang.eagle3_url": deploy["eagle3"],
    }
    cfg = rehearsal_config("kimi_k25_smoke", overrides, local_sources(root))
    assert overridden_fields("kimi_k25_smoke", cfg.model_dump(mode="json", exclude_unset=True)) <= DECLARED
    return cfg


@pytest.fixture(scope="module")
def smoke(kimi_rehearsal_target, tmp_path_factory):
    """The smoke config through every stage; returns (config, {stage: manifest}, the stand-in server, log lines)."""
    root = tmp_path_factory.mktemp("smoke")
    tok = tokenizer()
    m = target_markers(tok)
    lines, out = [], {}
    with KimiStandIn(tok, answers(NUM_TRAIN * 2), m.eot, m.stops) as server, DeployStandIn(24) as base, \
            DeployStandIn(24, "EAGLE3", verify_ct=10) as spec, pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(sglang_names.STANDIN))          # the sglang ranks import the stand-in
        cfg = smoke_config(root, kimi_rehearsal_target, server.url, {"baseline": base.url, "eagle3": spec.url})
        for stage, run in (("prompts", run_prompts), ("generation", run_generation), ("tokenize", run_tokenize),
                           ("features", run_features), ("vocab", run_vocab), ("train", run_train)):
            out[stage] = run(cfg, log=lines.append)
        generated = (list(server.received), list(server.returned))
        server.answer_greedily(kimi_rehearsal_target)
        out["evaluate"] = run_evaluate(cfg, log=lines.append)
        out["deploy_sglang"] = run_deploy_sglang(cfg, log=lines.append)
    server.received[:], server.returned[:] = generated
    return cfg, out, server, lines


def test_the_smoke_config_runs_its_stages_with_the_sglang_backend_through_the_stand_in(smoke):
    """As shipped but for the declared overrides: the `sglang` features backend in fp8 on 2 ranks, every sample
    of the tokenize stage in the store, the pinned layer-id rule logged by the ranks, the Kimi wrapper's decoder
    captured; nothing refused at tokenize; the trained spans are the stand-in's ids."""
    import pyarrow.parquet as pq
    cfg, out, server, lines = smoke
    assert cfg.features.backend == "sglang" and cfg.features.format == "fp8" and cfg.generation.api == "sglang"
    assert cfg.prompts.overlong == "truncate" and cfg.prompts.over_budget == "last_turns"      # the smoke's own
    f = out["features"]
    assert f["backend"] == "sglang" and f["tp_size"] == 2 and f["format"] == "fp8"
    assert f["samples"] == out["tokenize"]["samples"] == NUM_TRAIN
    assert any("rank 1/2 ran" in x for x in lines), lines[-20:]
    assert set(out["tokenize"]["rejected_per_source"].values()) == {0}
    samples = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    trained = sorted([t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] for s in samples)
    assert trained == sorted(server.returned)


def test_the_smoke_configs_export_is_read_by_the_pinned_sglang_as_the_layers_its_ranks_extracted(smoke,
                                                                                               sglang_capture):
    from kimi_rehearsal import LAYERS
    cfg, out, _, _ = smoke
    saved = json.loads((RunLayout(cfg.run_dir).stored(out["train"]["export_dir"]) / "config.json").read_text())
    served = sglang_capture("kimi_k25", saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"], LAYERS)
    assert [i - 1 for i in served] == out["features"]["aux_layer_ids"]


def test_the_smoke_configs_replay_report_and_deployment_summary_exist_with_their_numbers(smoke):
    """eval/report.json replays both drafts on the stand-in's greedy answers with aux states from the `sglang`
    ranks; deploy-sglang at the smoke config's concurrency levels 1 and 8 (tau 2.4: 24 tokens in 10 verify
    steps)."""
    cfg, out, _, _ = smoke
    ev = out["evaluate"]["summary"]
    assert ev["evaluator"] == "replay" and ev["recording"]["features_backend"] == "sglang"
    assert ev["recording"]["prompts"] == NUM_EVAL
    for name in ("trained", "untrained"):
        assert 1.0 <= ev[name]["tau"] <= cfg.eval.num_draft_steps + 1 and ev[name]["verify_steps"] > 0
    v = out["deploy_sglang"]["verdict"]
    assert [p["concurrency"] for p in v["per_level"]] == cfg.deploy_sglang.concurrency == [1, 8]
    assert v["tau"] == pytest.approx(2.4)
