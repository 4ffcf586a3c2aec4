"""A night's work (eagle3_pipeline(nightly=True), what the nightly schedule runs) under the Prefect harness with the
real llama-server: with prompts.num_train above what a local source holds, the first night trains on every prompt
of it; after rows were appended the second night regenerates only those rows, keeps the held-out set, warm-starts
from the first night's draft and reports both nights' tau; a third night with nothing new runs no stage again. A
night on a run finished without nights keeps its num_train and its export (its draft becomes night 0, the one to
beat)."""
import json
import shutil

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
    cfg.prompts.num_train = 1000                      # above what the source holds: each night takes every new row
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
    assert nights[1]["promoted"] == (nights[1]["tau"] > nights[0]["tau"])       # only a higher tau replaces
    report = (run / "report.md").read_text()
    assert "## Nights" in report
    for n in nights:
        assert f"| {n['night']} | {n['num_train']} | {n['new_prompts']:+d} | {n['generated']} | {n['tau']:.2f} (" in report

    stamps = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and "shard_" in p.name}
    eagle3_pipeline(cfg, nightly=True)                             # nothing appended: nothing redone
    third = json.loads((run / "nights.json").read_text())["nights"][-1]
    assert (third["new_prompts"], third["generated"], third["new"], third["promoted"]) == (0, 0, False, False)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.slow
def test_a_night_on_a_finished_run_keeps_its_num_train_and_its_export(e2e_run, tmp_path):
    """The nightly schedule switched on over a finished debug_tiny run (a copy of the session's): the night takes
    the config's num_train (not every prompt of the sources), its export becomes night 0 in promoted/, nothing is
    new so no stage runs again, and the export stays the run's."""
    from flows.pipeline import eagle3_pipeline
    done, _ = e2e_run
    run = tmp_path / "debug_tiny"
    shutil.copytree(done.run_dir, run)
    cfg = done.model_copy(update={"run_dir": run}, deep=True)
    export = {p.name: p.read_bytes() for p in (run / "draft" / "export").iterdir()}
    stages = {p: p.stat().st_mtime_ns for p in run.rglob("manifest.json")}
    prompts = json.loads((run / "prompts" / "manifest.json").read_text())

    eagle3_pipeline(cfg, nightly=True)
    nights = json.loads((run / "nights.json").read_text())["nights"]
    tau = json.loads((run / "eval" / "manifest.json").read_text())["summary"]["trained"]["tau"]
    assert [(n["night"], n["num_train"], n["new"], n["promoted"], n["promoted_night"]) for n in nights] == [
        (0, cfg.prompts.num_train, True, True, 0), (1, cfg.prompts.num_train, False, False, 0)]
    assert nights[0]["tau"] == tau and nights[0]["before_nights"]
    assert json.loads((run / "prompts" / "manifest.json").read_text())["train_ids"] == prompts["train_ids"]
    assert {p.name: p.read_bytes() for p in (run / "draft" / "export").iterdir()} == export
    assert {p.name: p.read_bytes() for p in (run / "promoted").iterdir()} == export
    assert {p: p.stat().st_mtime_ns for p in stages} == stages                # no stage ran again
    assert f"| 0 | {cfg.prompts.num_train} | +{cfg.prompts.num_train} | 0 |" in (run / "report.md").read_text()


def test_a_night_on_a_re_chosen_held_out_set_is_promoted_as_the_first_on_it(tmp_path):
    """finish_night compares tonight's tau with the promoted night's only on the same held-out set (the prompts
    manifest's eval_set): a lower tau on the same set is not promoted; on a set the prompts stage re-chose it is,
    and the log says why."""
    from eagle3_core.pipeline.nightly import finish_night
    run = tmp_path / "run"
    cfg = preset("debug_tiny", run_dir=run)
    (run / "draft" / "export").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "prompts").mkdir()

    def night(n, tau, eval_set, lines):
        (run / "draft" / "export" / "config.json").write_text(json.dumps({"night": n}))
        (run / "eval" / "manifest.json").write_text(json.dumps({"summary": {"trained": {"tau": tau,
                                                                                         "tau_ci95": [tau, tau]}}}))
        (run / "prompts" / "manifest.json").write_text(json.dumps({"eval_set": eval_set}))
        return finish_night(cfg, {"night": n, "num_train": 10 + n, "new": True, "init_from": None,
                                  "started_at": 0.0}, log=lines.append)
    lines = []
    assert night(0, 1.5, "aaaa", lines)["promoted"]
    assert not night(1, 1.4, "aaaa", lines)["promoted"]                   # worse on the same prompts
    rec = night(2, 1.3, "bbbb", lines)                                      # other prompts: no comparison
    assert rec["promoted"] and rec["eval_set"] == "bbbb"
    assert json.loads((run / "promoted" / "config.json").read_text()) == {"night": 2}
    assert "the held-out set changed since night 0" in lines[-1]
    assert not night(3, 1.2, "bbbb", lines)["promoted"]
