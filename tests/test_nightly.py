"""A night's work (eagle3_pipeline(nightly=True), what the nightly schedule runs) under the Prefect harness with the
real llama-server: the first night trains on every prompt of a local source; after rows were appended to it the
second night regenerates only those rows, keeps the held-out set, warm-starts from the first night's draft and
reports both nights' tau; a third night with nothing new runs no stage again."""
import json

import pytest

from conftest import SHARED_DATA
from eagle3_core.config import preset

GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"


@pytest.mark.slow
def test_a_nightly_run_after_appended_rows_does_only_those(prefect_server, tmp_path):
    from flows.pipeline import eagle3_pipeline
    lines = GSM8K.read_text().splitlines()
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(lines[:8]) + "\n")                # 2 held out + 6 train
    cfg = preset("debug_tiny", tmp_path / "run")
    cfg.prompts.sources, cfg.train.epochs = [str(source)], 4
    run = cfg.run_dir

    eagle3_pipeline(cfg, nightly=True)
    first = json.loads((run / "prompts" / "manifest.json").read_text())
    assert len(first["train_ids"]) == 6 and (run / "promoted" / "model.safetensors").exists()

    source.write_text("\n".join(lines[:12]) + "\n")               # 4 rows appended
    eagle3_pipeline(cfg, nightly=True)
    grown = json.loads((run / "prompts" / "manifest.json").read_text())
    assert grown["eval_ids"] == first["eval_ids"] and grown["train_ids"][:6] == first["train_ids"]
    nights = json.loads((run / "nights.json").read_text())["nights"]
    assert [(n["night"], n["num_train"], n["new_prompts"], n["generated"]) for n in nights] == [
        (0, 6, 6, 6), (1, 10, 4, 4)]
    assert nights[0]["init_from"] is None and nights[1]["init_from"] == str(run / "nights" / "night_001")
    assert nights[1]["promoted"] == (nights[1]["tau"] >= nights[0]["tau"])
    report = (run / "report.md").read_text()
    assert "## Nights" in report
    for n in nights:
        assert f"| {n['night']} | {n['num_train']} | {n['new_prompts']:+d} | {n['generated']} | {n['tau']:.2f} (" in report

    stamps = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and "shard_" in p.name}
    eagle3_pipeline(cfg, nightly=True)                             # nothing appended: nothing redone
    third = json.loads((run / "nights.json").read_text())["nights"][-1]
    assert (third["new_prompts"], third["generated"], third["new"], third["promoted"]) == (0, 0, False, False)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
