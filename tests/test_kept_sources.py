"""Kept sources (SourceSpec.kept 'auto', the default): the prompts stage renders each mode 'keep' source's first row
with the target's chat template before any generation; where the template would not train the kept turns as the
target writes them, the source's rows are regenerated instead, the reason logged and in prompts/manifest.json.

The two Kimi sources of the reference mix (mix_presets: kimi-k2.5-2000x, prompt/thinking/solution fields;
deepswe-kimi-k2, OpenAI messages with inline <function=...> calls and tool output in user turns) as local rows in
their hub fields (tests/fixtures/kept_sources), read through the presets' own specs. The targets are the stand-in
tokenizers of tests/chat_templates.py with the real templates (K2.5-style, Qwen3); regeneration goes through
`generation.regenerate` against the SGLang token-API stand-in and the tokenize stage's `run_tokenize`."""
import asyncio
import json
from pathlib import Path

import pytest

from chat_templates import stand_in
from eagle3_core.config import GenerationConfig, PipelineConfig, PromptConfig, ServerConfig, TargetConfig
from eagle3_core.config.mix import DataMix
from eagle3_core.config.mix_presets import MIXES
from eagle3_core.contract.manifest import write_manifest
from eagle3_core.data import prompt_set as prompts_mod
from eagle3_core.data.history import RoundTripError
from eagle3_core.data.markers import target_markers
from eagle3_core.data.samples import row_samples
from eagle3_core.generation.regenerate import regenerate
from eagle3_core.pipeline.prompts_stage import prompts_key, run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize
from sglang_stand_in import SGLangTokenStandIn

FIXTURES = Path(__file__).parent / "fixtures" / "kept_sources"
FILES = {"kimi-k2.5-2000x": "kimi_k25_2000x.jsonl", "deepswe-kimi-k2": "deepswe_kimi_k2.jsonl"}


def kimi_mix(kept: str | None = None) -> DataMix:
    """The reference mix's two Kimi sources as the preset names them, read from the fixture files (3 rows each)."""
    specs = {s.label: s for s in MIXES["reference_agentic_100k"].sources}
    update = {"hf": "json", "revision": None, "count": 3, **({"kept": kept} if kept else {})}
    return DataMix(name="kimi", sources=[specs[name].model_copy(update={**update, "data_files": str(FIXTURES / f)})
                                         for name, f in FILES.items()])


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Stand-in tokenizers saved as local target directories (what the stages load)."""
    out = {}
    for name in ("kimi_k25", "qwen3"):
        out[name] = tmp_path_factory.mktemp(name)
        stand_in(name).save_pretrained(out[name])
    return out


def pipeline(tmp_path, target, kwargs, kept=None) -> PipelineConfig:
    return PipelineConfig(run_dir=tmp_path / "run", target=TargetConfig(model=str(target)),
                          prompts=PromptConfig(mix=kimi_mix(kept), num_train=4, num_eval=2),
                          generation=GenerationConfig(api="sglang", chat_template_kwargs=kwargs or {}, concurrency=1,
                                                      flush_rows=1, max_new_tokens=64, progress_interval_s=60))


def trained_text(tok, sample) -> str:
    return tok.decode([t for t, w in zip(sample["input_ids"], sample["loss_mask"]) if w])


def test_kimi_sources_under_k25_thinking_are_regenerated_not_refused(targets, tmp_path):
    """K2.5-style template, thinking on (its default): kept as they are, every row of both Kimi sources is refused
    at tokenize (the 2000x answers for cause 'reasoning': the template renders the last answer's think block
    empty; the K2 trajectories for 'empty_thinking'). With kept 'auto' the prompts stage probes the first row of
    each, logs and records the cause, and makes the rows prompt rows; regenerated through the token API they all
    train (no row refused), each trained span the server's ids plus the end of turn."""
    cfg, lines = pipeline(tmp_path, targets["kimi_k25"], None), []
    m = run_prompts(cfg, log=lines.append)
    routes = m["kept_routes"]
    assert {k: (v["route"], v["cause"]) for k, v in routes.items()} == {
        "kimi-k2.5-2000x": ("regenerate", "reasoning"), "deepswe-kimi-k2": ("regenerate", "empty_thinking")}
    assert routes["kimi-k2.5-2000x"]["probed_row"] == "kimi-k2.5-2000x/kimi_0001"
    assert "renders the turn's reasoning differently" in routes["kimi-k2.5-2000x"]["reason"]
    for source, route in routes.items():
        assert any(f"kept source {source}: its rows are regenerated" in x and route["reason"] in x for x in lines)
    train = prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet")
    assert len(train) == 4 and {r["source"] for r in train} == set(FILES)
    assert all(r["mode"] == "prompt" and json.loads(r["meta"])["kept"] == "regenerate" for r in train)
    # the same rows kept as they are (kept 'train': what every kept row did before) are each refused
    tok = stand_in("kimi_k25")
    for r in train:
        with pytest.raises(RoundTripError) as e:
            row_samples(tok, {**r, "mode": "keep"}, 4096, "truncate")
        assert e.value.cause == routes[r["source"]]["cause"]
    answers = [f"Thinking about row {i}.</think>Answer {i}.<|im_end|>" for i in range(len(train))]
    gen = cfg.run_dir / "generations"
    markers = target_markers(tok)
    with SGLangTokenStandIn(tok, answers, markers.eot, markers.stops) as server:
        asyncio.run(regenerate(cfg.run_dir / "prompts" / "train.parquet", gen, [0], "k", cfg.generation,
                               ServerConfig(kind="external"), [server.url], tok, log=lambda *_: None))
    write_manifest(gen / "manifest.json", {"inputs_key": "hand-made", "shards": ["shard_00000.parquet"]})
    t = run_tokenize(cfg, log=lambda *_: None)
    assert t["rejected_per_source"] == {name: 0 for name in FILES} and t["samples"] == 4
    import pyarrow.parquet as pq
    samples = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").to_pylist()
    trained = sorted([t for t, w in zip(s["input_ids"], s["loss_mask"]) if w] for s in samples)
    assert trained == sorted(server.returned)          # the stop id <|im_end|> is the server's own here
    assert sorted(trained_text(tok, s) for s in samples) == sorted(answers)


# template, chat-template kwargs, the source whose kept turns render as the target writes them in that mode, the one
# that does not (and its cause), the first kept turn's trained text
ROUND_TRIP = {
    "qwen3_thinking": ("qwen3", None, "kimi-k2.5-2000x", ("deepswe-kimi-k2", "empty_thinking"),
                       "<think>\n91 = 7 * 13.\n</think>\n\nNo: 91 = 7 x 13.<|im_end|>"),
    "k25_no_thinking": ("kimi_k25", {"thinking": False}, "deepswe-kimi-k2", ("kimi-k2.5-2000x", "reasoning"),
                        "Let me look.\n<function=execute_bash>\n<parameter=cmd>grep -n 'def add' calc.py"
                        "</parameter>\n</function><|im_end|>"),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIP))
def test_kept_rows_stay_kept_where_the_template_round_trips(targets, tmp_path, case):
    """Where the template renders the kept turns as the target writes them (Qwen3 thinking: the 2000x answers with
    their reasoning; K2.5 thinking off: the K2 trajectories without), the source's rows stay kept (route 'train')
    and train every assistant turn as the template renders it after its generation prompt; the other source is
    re-routed with its cause. The prompts key is the one of a run before kept sources were probed ('auto' and the
    old default 'train' hash alike); a manifest without routes (written before) makes the stage run again."""
    name, kwargs, kept, (other, cause), first = ROUND_TRIP[case]
    cfg = pipeline(tmp_path, targets[name], kwargs)
    m = run_prompts(cfg, log=lambda *_: None)
    assert m["kept_routes"][kept] == {"route": "train", "probed_row": m["kept_routes"][kept]["probed_row"]}
    assert (m["kept_routes"][other]["route"], m["kept_routes"][other]["cause"]) == ("regenerate", cause)
    assert prompts_key(cfg) == prompts_key(pipeline(tmp_path, targets[name], kwargs, kept="train"))
    tok = stand_in(name)
    rows = [r for r in prompts_mod.read_rows(cfg.run_dir / "prompts" / "train.parquet") if r["source"] == kept]
    assert rows and all(r["mode"] == "keep" and "kept" not in json.loads(r["meta"]) for r in rows)
    for r in rows:
        samples, source = row_samples(tok, r, 4096, "truncate", kwargs)
        msgs = r["messages"]
        want = []
        for i in (i for i, x in enumerate(msgs) if x["role"] == "assistant"):
            before = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True, **(kwargs or {}))
            full = tok.apply_chat_template(msgs[:i + 1], tokenize=False, **(kwargs or {}))
            assert full.startswith(before)
            want.append(full[len(before):full.index("<|im_end|>", len(before)) + len("<|im_end|>")])
        assert source == "template" and "".join(trained_text(tok, s) for s in samples) == "".join(want)
    first_row = next(r for r in rows if r["id"] == m["kept_routes"][kept]["probed_row"])
    assert trained_text(tok, row_samples(tok, first_row, 4096, "truncate", kwargs)[0][0]).startswith(first)
    manifest = cfg.run_dir / "prompts" / "manifest.json"
    old = json.loads(manifest.read_text())
    del old["kept_routes"]
    manifest.write_text(json.dumps(old))
    lines = []
    assert run_prompts(cfg, log=lines.append)["kept_routes"] == m["kept_routes"]
    assert any("['kept_routes'] missing or changed" in x for x in lines)
