"""In-process batched regeneration (server.kind 'transformers') on the embedded target, CPU, real GSM8K prompts:
batched answers equal unbatched greedy decoding, the shard contract holds, and EOS ends an answer."""
import asyncio
import json
import threading

import pyarrow.parquet as pq
import pytest
import torch

from conftest import SHARED_DATA
from eagle3_core.config import GenerationConfig, PipelineConfig, PromptConfig, ServerConfig, TargetConfig
from eagle3_core.data.chat import prompt_ids
from eagle3_core.evaluation.acceptance import compare_outputs
from eagle3_core.evaluation.speculate import TargetRunner, greedy_generate
from eagle3_core.pipeline.generation_stage import (_loaded_target, loaded_target, run_generation,
                                                   run_generation_shard)
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.serving.hf_generate import BatchedGenerator

GSM8K = str(SHARED_DATA / "gsm8k" / "train.jsonl")
NEW = 12


@pytest.mark.slow
def test_batched_in_process_answers_equal_unbatched_greedy(tmp_path, target_model, tokenizer):
    """6 prompts of different lengths in 2 shards, batches of up to 4 rows (left-padded): every answer equals the
    target's own one-prompt greedy decoding (or first differs at a near-tie, top-2 gap < 1e-3), the ids are the
    chat template's, the text decodes from the ids, and a rerun generates nothing."""
    cfg = PipelineConfig(run_dir=tmp_path, prompts=PromptConfig(sources=[GSM8K], num_train=6, num_eval=1),
                         server=ServerConfig(kind="transformers"),
                         generation=GenerationConfig(max_new_tokens=NEW, concurrency=4, shard_size=3,
                                                     max_truncated_frac=1.0))
    run_prompts(cfg, log=lambda *_: None)
    m = run_generation(cfg, log=lambda *_: None)
    assert m["samples"] == 6 and m["failed"] == 0 and m["server"].startswith("transformers in-process")
    rows = [r for f in m["shards"] for r in pq.read_table(tmp_path / "generations" / f).to_pylist()]
    assert len(rows) == 6 and len({len(r["prompt_ids"]) for r in rows}) > 1          # padding is exercised
    assert max(json.loads(r["timings"])["batch_rows"] for r in rows) > 1              # and batching
    runner = TargetRunner(target_model, [0])
    for r in rows:
        assert r["prompt_ids"] == prompt_ids(tokenizer, json.loads(r["messages"]))
        ref = greedy_generate(runner, r["prompt_ids"], NEW, {tokenizer.eos_token_id})
        assert compare_outputs(r["output_ids"], ref["tokens"], ref["gaps"], 1e-3) in ("equal", "near_tie"), r["id"]
        assert r["response"] == tokenizer.decode(r["output_ids"], skip_special_tokens=True)
        assert r["finish_reason"] == "length" and r["completion_tokens"] == NEW and r["api"] == "transformers"
    shas = [json.loads((tmp_path / "generations" / f"shard_{k:05d}.json").read_text())["sha256"] for k in (0, 1)]
    (tmp_path / "generations" / "manifest.json").unlink()
    again = run_generation(cfg, log=lambda *_: None)                           # shards finished: kept
    assert again["samples"] == 6 and [json.loads((tmp_path / "generations" / f"shard_{k:05d}.json").read_text())[
        "sha256"] for k in (0, 1)] == shas
    for f in (tmp_path / "generations").glob("shard_00001.*"):                       # the flow's shard-task path
        f.unlink()
    rec = run_generation_shard(cfg, 1, log=lambda *_: None)
    assert rec["generated"] == 3 and rec["sha256"] != "" and [r["output_ids"] for r in pq.read_table(
        tmp_path / "generations" / "shard_00001.parquet").to_pylist()] == [r["output_ids"] for r in rows[3:]]


def test_an_eos_token_ends_the_answer_before_it(target_model, tokenizer):
    """With the greedy answer's 4th token declared an end-of-sequence id, the answer is its first 3 tokens,
    finish_reason 'stop', 4 completion tokens (EOS counted, as servers count it)."""
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    free = greedy_generate(TargetRunner(target_model, [0]), prompt, 8, set())["tokens"]
    k = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 3)              # first new token at >= 3
    gen = BatchedGenerator(target_model, tokenizer, max_batch=2, max_new_tokens=8,
                           stop_ids=[tokenizer.eos_token_id])
    gen.eos = {free[k]}

    async def both():
        return await asyncio.gather(gen.complete(prompt), gen.complete(prompt[:-1] + prompt[-1:]))
    try:
        a, b = asyncio.run(both())
    finally:
        gen.close()
    assert a == b and gen.batches == 1
    assert a["output_ids"] == free[:k] and a["finish_reason"] == "stop" and a["completion_tokens"] == k + 1


def test_parallel_shard_tasks_share_one_loaded_target():
    """server.kind 'transformers' with two shard tasks at once (threads of one process): one load, one model; two
    unguarded loads raised (transformers' lazy import: "cannot import name 'AutoConfig'", or "Cannot copy out of meta
    tensor")."""
    _loaded_target.cache_clear()
    start, models, errors = threading.Barrier(2), [], []

    def shard_task():
        start.wait()
        try:
            models.append(loaded_target(TargetConfig().model_dump_json(), "cpu", torch.float32))
        except Exception as e:  # noqa: BLE001 -- the test reports what a thread raised
            errors.append(repr(e))
    threads = [threading.Thread(target=shard_task) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _loaded_target.cache_clear()
    assert errors == [] and len(models) == 2 and models[0] is models[1], (errors, len(models))
    assert next(models[0].parameters()).dtype == torch.float32
