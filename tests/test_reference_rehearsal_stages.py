"""The reference rehearsal's stages (docs/reference_case.md, "What the rehearsal proves"):
configs/kimi_k25_agentic_100k.json as shipped, with only the declared sizes and locations of
tests/rehearsal_configs.py overridden, on the tiny Kimi-K2.5 target of tests/kimi_rehearsal.py, run stage by stage
by the stages' own functions: prompts (the reference mix's ten sources from local files in their hub fields, the
two kept Kimi sources included), generation through the SGLang token-API stand-in (reasoning, tool calls, cut-off
answers, both end tokens), tokenize."""
import json

import pyarrow.parquet as pq
import pytest

from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.markers import target_markers
from eagle3_core.pipeline.generation_stage import run_generation
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from kimi_rehearsal import KimiStandIn, answers, local_sources, tokenizer
from rehearsal_configs import DECLARED, overridden_fields, rehearsal_config

NUM_TRAIN, NUM_EVAL, MAX_NEW = 12, 3, 48


def agentic_config(root, target, url: str):
    """configs/kimi_k25_agentic_100k.json at toy size: the declared overrides, and nothing else."""
    sources = local_sources(root)
    overrides = {
        "run_dir": str(root / "run"), "target.model": str(target), "target.revision": None,
        "prompts.num_train": NUM_TRAIN, "prompts.num_eval": NUM_EVAL,
        "server.kind": "external", "server.url": url,
        "generation.max_new_tokens": MAX_NEW, "generation.concurrency": 1, "generation.shard_size": 8,
        "features.max_length": 512, "features.shard_samples": 4, "features.batch_tokens": 1024,
        "features.tp_size": 2, "draft.draft_vocab_size": 2048, "train.epochs": 2, "train.batch_tokens": 1024, "train.window_context": 256,
        "eval.max_new_tokens": 32,
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
    with KimiStandIn(tok, answers(NUM_TRAIN * 2), m.eot, m.stops) as server:
        cfg = agentic_config(root, kimi_rehearsal_target, server.url)
        out["prompts"] = run_prompts(cfg, log=lines.append)
        out["generation"] = run_generation(cfg, log=lines.append)
    out["tokenize"] = run_tokenize(cfg, log=lines.append)
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
