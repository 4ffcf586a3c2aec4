"""The reference rehearsal's stages (docs/reference_case.md, "What the rehearsal proves"):
configs/kimi_k25_agentic_100k.json as shipped, with only the declared sizes and locations of
tests/rehearsal_configs.py overridden, on the tiny Kimi-K2.5 target of tests/kimi_rehearsal.py, run stage by stage
by the stages' own functions: prompts (the reference mix's ten sources from local files in their hub fields, the
two kept Kimi sources included), generation through the SGLang token-API stand-in (reasoning, tool calls, cut-off
answers, both end tokens), tokenize, features (`ep_int4` on 2 gloo ranks, fp8), vocab, train and export, replay
evaluation (the stand-in then answers as SGLang serving the target would: its greedy output), deploy-sglang against
stand-in servers by URL; and a rank of `ep_int4` killed mid-run, then the rerun."""
import json
import time

import pyarrow.parquet as pq
import pytest

from eagle3_core.contract.layout import RunLayout
from eagle3_core.data import prompt_set as prompts_mod
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
from rehearsal_configs import DECLARED, overridden_fields, rehearsal_config, shipped
from test_engine_aux_ids import sglang_capture  # noqa: F401  (the pinned wheel's capture rule, a fixture)

# every test reads the module's run (minutes: two torchrun extractions, training, replay), and the kill test starts
# two more torchruns
pytestmark = pytest.mark.slow
NUM_TRAIN, NUM_EVAL, MAX_NEW = 12, 3, 48
# 320 optimizer steps (40 epochs of 12 samples, 256 tokens a batch) at the shipped lr 1e-4: Adam moves each weight
# by about lr a step, so the draft needs a few hundred steps to learn anything; the learning check needs them
TRAIN_EPOCHS = 40


def agentic_config(root, target, url: str, deploy: dict[str, str]):
    """configs/kimi_k25_agentic_100k.json at toy size: the declared overrides, and nothing else."""
    sources = local_sources(root)
    overrides = {
        "run_dir": str(root / "run"), "target.model": str(target), "target.revision": None,
        "prompts.num_train": NUM_TRAIN, "prompts.num_eval": NUM_EVAL,
        "server.kind": "external", "server.url": url,
        "generation.max_new_tokens": MAX_NEW, "generation.concurrency": 1, "generation.shard_size": 8,
        "features.max_length": 512, "features.shard_samples": 4, "features.batch_tokens": 1024,
        "features.tp_size": 2, "draft.draft_vocab_size": 512, "train.epochs": TRAIN_EPOCHS, "train.batch_tokens": 256,
        "train.window_context": 64,
        "eval.max_new_tokens": 32,
        "deploy_sglang.baseline_url": deploy["baseline"], "deploy_sglang.eagle3_url": deploy["eagle3"],
    }
    cfg = rehearsal_config("kimi_k25_agentic_100k", overrides, sources)
    assert overridden_fields("kimi_k25_agentic_100k", cfg.model_dump(mode="json", exclude_unset=True)) <= DECLARED
    return cfg


@pytest.fixture(scope="module")
def agentic(kimi_rehearsal_target, tmp_path_factory):
    """The agentic config through prompts, generation (the stand-in answering) and tokenize; returns (config,
    {stage: manifest}, the stand-in server, log lines)."""
    root = tmp_path_factory.mktemp("agentic")
    tok = tokenizer()
    m = target_markers(tok)
    lines, out = [], {}
    with KimiStandIn(tok, answers(NUM_TRAIN * 2), m.eot, m.stops) as server, DeployStandIn(24) as base, \
            DeployStandIn(24, "EAGLE3", verify_ct=10) as spec:
        cfg = agentic_config(root, kimi_rehearsal_target, server.url, {"baseline": base.url, "eagle3": spec.url})
        out["prompts"] = run_prompts(cfg, log=lines.append)
        out["generation"] = run_generation(cfg, log=lines.append)
        out["tokenize"] = run_tokenize(cfg, log=lines.append)
        generated = (list(server.received), list(server.returned))
        for stage, run in (("features", run_features), ("vocab", run_vocab), ("train", run_train)):
            t0 = time.monotonic()
            out[stage] = run(cfg, log=lines.append)
            lines.append(f"rehearsal: {stage} {time.monotonic() - t0:.1f} s")
        server.answer_greedily(kimi_rehearsal_target)
        out["evaluate"] = run_evaluate(cfg, log=lines.append)
        out["deploy_sglang"] = run_deploy_sglang(cfg, log=lines.append)
    server.received[:], server.returned[:] = generated
    return cfg, out, server, lines


def test_the_mix_reads_every_source_and_routes_the_kept_kimi_sources_to_regeneration(agentic):
    cfg, out, _, _ = agentic
    m = out["prompts"]
    per = m["stats"]["per_source"]
    counts = {s.label: s.count for s in cfg.prompts.mix.sources}
    assert {k: v.get("train", 0) + v.get("eval", 0) for k, v in per.items()} == counts
    assert all(v["rejected"] == v["duplicates"] == v["length_filtered"] == 0 for v in per.values()), per
    assert {k: v["route"] for k, v in m["kept_routes"].items()} == {"kimi-k2.5-2000x": "regenerate",
                                                                     "deepswe-kimi-k2": "regenerate"}
    train = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")
    assert len(train) == NUM_TRAIN and all(r["mode"] == "prompt" for r in train)


def test_every_trained_span_is_the_stand_in_servers_ids_and_no_source_is_refused(agentic):
    cfg, out, server, _ = agentic
    tok = tokenizer()
    eos, im_end = tok.convert_tokens_to_ids("[EOS]"), tok.convert_tokens_to_ids("<|im_end|>")
    assert len(server.returned) == NUM_TRAIN
    ends = [ids[-1] for ids in server.returned]
    assert eos in ends and im_end in ends and any(len(ids) == MAX_NEW and ids[-1] not in (eos, im_end)
                                                  for ids in server.returned)
    calls = [ids for ids in server.returned if tok.convert_tokens_to_ids("<|tool_calls_section_begin|>") in ids]
    assert len(calls) == server.tool_calls >= 1
    t = out["tokenize"]
    assert set(t["rejected_per_source"].values()) == {0}, t["rejected_per_source"]
    samples = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    trained = sorted([t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] for s in samples)
    assert trained == sorted(server.returned)
    for s in samples:                     # the context is what the server was sent
        first = s["loss_mask"].index(1)
        assert s["input_ids"][:first] in server.received
    print(json.dumps({k: v for k, v in t.items() if k in ("samples", "rejected_per_source")}))


# fp8 e4m3 (store_formats: per-row scale s = amax / 448): a normal value rounds within 2^-4 of itself (3 mantissa
# bits, half an ulp), a subnormal within 2^-10 s; the rank's final state is bf16 before it is stored (2^-8, on both
# the stored and the one-process side: 2^-7)
FP8_REL, FP8_SUB, BF16_REL = 2.0 ** -4, 2.0 ** -10, 2.0 ** -7


def test_the_fp8_teacher_agrees_with_the_stored_top1_beyond_the_formats_rounding_bound(agentic,
                                                                                     kimi_rehearsal_target):
    """The teacher the trainer reads (fp8 final state @ lm_head) against the stored target_top1 (the rank's argmax
    before rounding). Per position, the target's logits z = f @ W^T (f: a one-process forward of the same INT4
    checkpoint, transformers' dequantizing load) differ from the teacher's by at most b_v = sum_h |W_vh| e_h with
    e_h = (2^-4 + 2^-7) |f_h| + 2^-10 s; wherever the top-2 gap of z exceeds b_top1 + max_v b_v, the teacher's
    argmax must be the stored top1 (and so must z's). Most positions are beyond the bound (asserted: not vacuous)."""
    import torch

    from eagle3_core.config import TargetConfig
    from eagle3_core.features.reader import load_head, load_samples
    from eagle3_core.target.loading import decoder, load_target
    cfg = agentic[0]
    assert cfg.features.format == "fp8"
    store = cfg.run_dir / "features"
    W = load_head(store)[1]
    model = load_target(TargetConfig(model=str(kimi_rehearsal_target)), "cpu").eval()
    beyond = total = 0
    for s in load_samples(store):
        with torch.no_grad():
            f = decoder(model)(input_ids=s["input_ids"][None]).last_hidden_state[0].float()
        z, teacher = f @ W.T, s["final"] @ W.T
        scale = f.abs().amax(-1, keepdim=True) / 448
        b = W.abs() @ ((FP8_REL + BF16_REL) * f.abs() + FP8_SUB * scale).T              # [V, T]
        top = z.topk(2, -1)
        b_top = b.gather(0, top.indices[:, :1].T)[0]
        sure = top.values[:, 0] - top.values[:, 1] > b_top + b.max(0).values
        assert torch.equal(teacher.argmax(-1)[sure], s["target_top1"][sure]), s["id"]
        assert torch.equal(top.indices[:, 0][sure], s["target_top1"][sure]), s["id"]
        beyond, total = beyond + int(sure.sum()), total + len(sure)
    assert beyond >= 0.9 * total, (beyond, total)


def test_the_evaluate_report_replays_both_drafts_on_the_stand_ins_answers_with_ep_int4_features(agentic):
    """eval/report.json: both drafts replayed on the held-out prompts against what the stand-in answered (as SGLang
    serving the target would: its greedy output), aux states from the ep_int4 ranks, with their numbers."""
    cfg, out, server, _ = agentic
    ev = out["evaluate"]["summary"]
    assert ev["evaluator"] == "replay" and ev["recording"]["features_backend"] == "ep_int4"
    assert ev["recording"]["prompts"] == NUM_EVAL and ev["recording"]["server"] == "external"
    for name in ("trained", "untrained"):
        r = ev[name]
        assert 1.0 <= r["tau"] <= cfg.eval.num_draft_steps + 1 and r["verify_steps"] > 0
        assert r["tokens_from_verify"] == round(r["tau"] * r["verify_steps"])
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    assert report["trained"]["tau"] == ev["trained"]["tau"] and report["preflight"] == "passed"
    assert report["aux_layer_ids"] == out["features"]["aux_layer_ids"]


def test_the_trained_drafts_replay_tau_beats_the_untrained_drafts(agentic):
    """The learning check: on the stand-in's greedy answers to the held-out prompts (the tiny target's chains of
    the script's commonest bigrams, tests/kimi_rehearsal.py build_target), the draft trained at the shipped recipe
    (lr 1e-4; 40 epochs, a size) has a replay tau at least 0.3 above the untrained draft's (measured: 1.82
    against 1.00) and the paired bootstrap interval of the difference (acceptance.paired_bootstrap_diff_ci, the
    prompts resampled for both drafts) lies above 0; a draft whose training did not move it fails both."""
    from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
    cfg, out, _, lines = agentic
    assert cfg.train.lr == shipped("kimi_k25_agentic_100k")["train"]["lr"] == 1e-4 and cfg.train.epochs == TRAIN_EPOCHS
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    trained, untrained = report["trained"], report["untrained"]
    assert trained["tau"] >= untrained["tau"] + 0.3, (trained["tau"], untrained["tau"])
    low, high = paired_bootstrap_diff_ci(trained["per_prompt"], untrained["per_prompt"])
    assert 0 < low <= high, (low, high)
    assert trained["accept_per_position"][0] > untrained["accept_per_position"][0]
    print(f"learning check: replay tau trained {trained['tau']:.2f}, untrained {untrained['tau']:.2f}, "
          f"paired difference in [{low:.2f}, {high:.2f}]; " + next(x for x in reversed(lines) if "best epoch" in x))


def test_the_exported_ids_read_by_the_pinned_sglang_name_the_layers_extracted(agentic, sglang_capture):
    """The export's config.json read by the pinned SGLang wheel's own set_eagle3_layers_to_capture for Kimi-K2.5
    (its wrapper over the DeepSeek-V2 model: tests/test_engine_aux_ids.py) captures the inputs of the layers after
    the ones the ep_int4 ranks extracted (ids are layer outputs here, layer inputs there)."""
    from kimi_rehearsal import LAYERS
    cfg, out, _, _ = agentic
    saved = json.loads((RunLayout(cfg.run_dir).stored(out["train"]["export_dir"]) / "config.json").read_text())
    served = sglang_capture("kimi_k25", saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"], LAYERS)
    extracted = out["features"]["aux_layer_ids"]
    assert [i - 1 for i in served] == extracted and len(extracted) == 3


def test_a_killed_ep_int4_rank_leaves_intact_shards_and_the_rerun_extracts_only_the_rest(agentic, tmp_path):
    """The agentic run's tokenized samples extracted again by ep_int4 on 2 gloo ranks into 4 shards (a shard size
    override), rank 1 SIGKILLed at its 3rd forward (tests/kill_worker.py): the shards listed pass their sha256, and
    the rerun keeps them and extracts only the rest (tests/feature_stores.py kill_a_rank_then_rerun)."""
    import shutil

    from feature_stores import kill_a_rank_then_rerun
    cfg = agentic[0]
    shutil.copytree(cfg.run_dir / "tokenized", tmp_path / "run" / "tokenized")
    kill = cfg.model_copy(update={"run_dir": tmp_path / "run", "features": cfg.features.model_copy(
        update={"shard_samples": NUM_TRAIN // 4})})
    assert kill.features.backend == "ep_int4" and kill.features.tp_size == 2
    manifest = kill_a_rank_then_rerun(kill, "hf")
    assert manifest["samples"] == agentic[1]["features"]["samples"] and manifest["format"] == "fp8"


def test_deploy_sglang_through_the_stand_in_writes_the_summary_with_tau_and_speedup(agentic):
    """deploy-sglang against two stand-in servers given by URL (baseline; EAGLE3 at the config's 5 steps, topk 1,
    6 draft tokens): 24 tokens an answer in 10 verify steps, so tau 2.4 at every concurrency of the config."""
    cfg, out, _, _ = agentic
    d = out["deploy_sglang"]
    v = d["verdict"]
    assert v["tau"] == pytest.approx(2.4) and d["prompts"] > 0
    assert [p["concurrency"] for p in v["per_level"]] == cfg.deploy_sglang.concurrency == [1, 8, 32]
    assert all(p["tau"] == pytest.approx(2.4) and p["speedup"] > 0 for p in v["per_level"])
    md = (cfg.run_dir / "deploy_sglang" / "sglang_bench.md").read_text()
    assert "| break-even tau |" in md


def test_zz_print_the_stage_times(agentic):
    print("\n".join(x for x in agentic[3] if x.startswith("rehearsal:") or x.startswith("eval")
                     or x.startswith("train")))
