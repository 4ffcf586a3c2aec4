"""Bad input never silently runs or aborts a stage: unknown config fields are refused naming the field and the
nearest valid name; bad rows are rejected with file, row and reason and counted while good rows go through; a
failed rerun leaves a finished run's rejects.jsonl byte-identical."""
import json

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from eagle3_core.config import PipelineConfig, PromptConfig
from eagle3_core.contract.manifest import write_manifest
from eagle3_core.data.prompt_set import write_rows
from eagle3_core.data.rejects import RejectError
from eagle3_core.pipeline.prompts_stage import run_prompts
from eagle3_core.pipeline.tokenize_stage import run_tokenize

# (config dict with one mistyped field, the field, the suggested name): one per section of PipelineConfig
MISTYPED = [
    ({"run_dri": "runs/x"}, "run_dri", "run_dir"),
    ({"target": {"trust_remote_cod": True}}, "trust_remote_cod", "trust_remote_code"),
    ({"prompts": {"num_trian": 3}}, "num_trian", "num_train"),
    ({"prompts": {"mix": {"sources": [{"path": "a.jsonl", "cout": 3}]}}}, "cout", "count"),
    ({"prompts": {"mix": {"sourcs": [{"path": "a.jsonl"}]}}}, "sourcs", "sources"),
    ({"server": {"prot": 8080}}, "prot", "port"),
    ({"generation": {"max_new_token": 8}}, "max_new_token", "max_new_tokens"),
    ({"features": {"aux_layer_id": [1, 2, 3]}}, "aux_layer_id", "aux_layer_ids"),
    ({"draft": {"draft_vocab": 100}}, "draft_vocab", "draft_vocab_size"),
    ({"train": {"epoch": 3}}, "epoch", "epochs"),
    ({"eval": {"num_draft_step": 2}}, "num_draft_step", "num_draft_steps"),
]


@pytest.mark.parametrize("data,field,near", MISTYPED, ids=[m[1] for m in MISTYPED])
def test_unknown_field_in_every_section_is_refused_naming_it_and_the_nearest_name(data, field, near):
    with pytest.raises(ValidationError) as e:
        PipelineConfig.model_validate(data)
    msg = str(e.value)
    assert f"unknown field {field!r}" in msg and f"did you mean {near!r}?" in msg, msg


def test_unknown_field_without_a_near_name_lists_the_valid_ones():
    with pytest.raises(ValidationError, match=r"unknown field 'zzz' in TrainConfig: valid fields: .*epochs"):
        PipelineConfig.model_validate({"train": {"zzz": 1}})


def test_a_stale_flow_parameter_fails_naming_the_field():
    """What a scheduled run with parameters stored before a field was renamed meets: Prefect validates the flow's
    parameters with the same model, so the run fails at once, naming the field (not after hours of work)."""
    from prefect.exceptions import ParameterTypeError

    from flows.pipeline import eagle3_pipeline
    config = PipelineConfig().model_dump(mode="json")
    config["train"]["epoch"] = 3
    with pytest.raises(ParameterTypeError, match=r"unknown field 'epoch' in TrainConfig: did you mean 'epochs'"):
        eagle3_pipeline.validate_parameters({"config": config})


def _sharegpt(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _prompt_file(tmp_path, n_good: int = 8):
    """A ShareGPT file: n_good good conversations, one that opens with the bot's greeting, one empty."""
    rows = [_sharegpt(i, [("human", f"What is {i} plus {i}?"), ("gpt", f"It is {2 * i}.")]) for i in range(n_good)]
    rows.append(_sharegpt(100, [("gpt", "Hello! How can I help?"), ("human", "Name a fruit."), ("gpt", "Apple.")]))
    rows.append(_sharegpt(101, []))
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(rows))
    return path


def test_assistant_first_and_empty_conversations_are_rejected_and_counted_good_rows_go_through(tmp_path):
    src = _prompt_file(tmp_path)
    cfg = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(sources=[str(src)], num_train=6, num_eval=2,
                                                                       max_reject_frac=0.25))
    m = run_prompts(cfg, log=lambda *_: None)
    rejects = [json.loads(x) for x in (cfg.run_dir / "prompts" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["source"], r["row"]) for r in rejects] == [("chats", 8), ("chats", 9)]
    assert "starts with a assistant turn (message 0)" in rejects[0]["reason"] and str(src) in rejects[0]["reason"]
    assert "empty conversation" in rejects[1]["reason"]
    st = m["stats"]["per_source"]["chats"]
    assert st["read"] == 10 and st["rejected"] == 2 and m["stats"]["train"] == 6 and m["stats"]["eval"] == 2
    assert not (cfg.run_dir / "prompts" / "rejects.failed.jsonl").exists()


def test_a_failed_rerun_keeps_the_finished_rejects_byte_identical(tmp_path):
    src = _prompt_file(tmp_path)
    ok = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(sources=[str(src)], num_train=6, num_eval=2,
                                                                      max_reject_frac=0.25))
    run_prompts(ok, log=lambda *_: None)
    out = ok.run_dir / "prompts"
    finished = {p.name: p.read_bytes() for p in out.iterdir()}
    for bad in (ok.prompts.model_copy(update={"max_reject_frac": 0.1}),     # the reject limit fails the stage
                ok.prompts.model_copy(update={"num_train": 60})):           # too few rows left
        cfg = ok.model_copy(update={"prompts": bad})
        with pytest.raises(ValueError) as e:
            run_prompts(cfg, log=lambda *_: None)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "rejects.failed.jsonl"} == finished
        failed = [json.loads(x) for x in (out / "rejects.failed.jsonl").read_text().splitlines()]
        assert [r["row"] for r in failed] == [8, 9]
        if isinstance(e.value, RejectError):
            assert "rejects.failed.jsonl" in str(e.value) and "'chats'" in str(e.value)
    assert run_prompts(ok, log=lambda *_: None)["train_ids"] == json.loads(finished["manifest.json"])[
        "train_ids"]                                                        # the finished stage is still done
    ok.prompts.max_reject_frac = 0.3                                        # a successful rerun removes the file
    run_prompts(ok, log=lambda *_: None)
    assert not (out / "rejects.failed.jsonl").exists() and (out / "rejects.jsonl").read_bytes() == finished[
        "rejects.jsonl"]


def _generations(cfg: PipelineConfig, rows: list[dict]) -> None:
    """A generations stage output holding `rows` (as the regeneration engine writes them: prompt columns plus the
    answer). Bad rows reach it from runs made before the prompts stage refused them, or from hand-edited shards."""
    out = cfg.run_dir / "generations"
    out.mkdir(parents=True)
    write_rows(out / "shard_00000.parquet", rows)
    write_manifest(out / "manifest.json", {"inputs_key": "hand-made", "shards": ["shard_00000.parquet"]})


def _gen_row(i: int, source: str, messages: list[dict], mode: str = "prompt", response: str = "It is 4.") -> dict:
    return {"id": f"{source}/{i}", "source": source, "mode": mode, "messages": messages, "response": response,
            "reasoning": "", "finish_reason": "stop"}


def test_tokenize_rejects_bad_rows_with_file_row_and_reason_and_trains_the_rest(tmp_path):
    user = [{"role": "user", "content": "What is 2 plus 2?"}]
    rows = [_gen_row(i, "good", user) for i in range(6)]
    rows.insert(2, _gen_row(90, "dump", [{"role": "assistant", "content": "Hi!"}, *user,
                                         {"role": "assistant", "content": "4."}], mode="keep"))
    rows.insert(4, _gen_row(91, "dump", [], mode="keep"))
    rows += [_gen_row(92 + i, "dump", user) for i in range(6)]
    cfg = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(max_reject_frac=0.25))
    _generations(cfg, rows)
    m = run_tokenize(cfg, log=lambda *_: None)
    rejects = [json.loads(x) for x in (cfg.run_dir / "tokenized" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["row"], r["id"]) for r in rejects] == [("generations/shard_00000.parquet", 2, "dump/90"),
                                                                 ("generations/shard_00000.parquet", 4, "dump/91")]
    assert all(r["reason"] for r in rejects)
    assert m["samples"] == 12 and m["rejected"] == 2 and m["rejected_per_source"] == {"good": 0, "dump": 2}
    ids = pq.read_table(cfg.run_dir / "tokenized" / "train.parquet").column("id").to_pylist()
    assert ids == [r["id"] for r in rows if r["id"] not in ("dump/90", "dump/91")]


def test_tokenize_fails_above_the_reject_limit_naming_the_worst_source(tmp_path):
    user = [{"role": "user", "content": "What is 2 plus 2?"}]
    rows = [_gen_row(i, "good", user) for i in range(6)] + [_gen_row(90, "dump", [], mode="keep"),
                                                            _gen_row(91, "dump", user)]
    cfg = PipelineConfig(run_dir=tmp_path / "run", prompts=PromptConfig(max_reject_frac=0.25))
    _generations(cfg, rows)
    with pytest.raises(RejectError, match=r"source 'dump' rejected 1 of 2 rows \(50%\).*rejects\.failed\.jsonl"):
        run_tokenize(cfg, log=lambda *_: None)
    assert not (cfg.run_dir / "tokenized" / "manifest.json").exists()
    assert (cfg.run_dir / "tokenized" / "rejects.failed.jsonl").exists()


def test_a_config_file_with_mistyped_fields_names_the_file_and_every_field(tmp_path):
    from eagle3_core.config import ConfigFileError, load_config
    path = tmp_path / "my_run.json"
    path.write_text(json.dumps({"run_dir": "runs/x", "prompts": {"num_trian": 3}, "train": {"epoch": 3}}))
    with pytest.raises(ConfigFileError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"config file {path}: 2 bad field(s)")
    assert "prompts: Value error, unknown field 'num_trian' in PromptConfig: did you mean 'num_train'?" in msg
    assert "train: Value error, unknown field 'epoch' in TrainConfig: did you mean 'epochs'?" in msg
    path.write_text(json.dumps({"run_dir": "runs/x"}))
    assert load_config(path).run_dir.name == "x"
