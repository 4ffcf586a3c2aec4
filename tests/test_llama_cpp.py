"""Deploying drafts on llama.cpp's EAGLE-3 server (an engine nobody here wrote): conversion, layer-id convention in
the GGUF, acceptance of a trained draft vs an untrained one, greedy output equal to the server without a draft."""
from pathlib import Path

import pytest
from gguf import GGUFReader

from eagle3_core import stages
from eagle3_core.checkpoint import save_draft
from eagle3_core.prompts import read_rows
from eagle3_core.serving.launcher import llama_server
from eagle3_core.serving.llama_cpp import LLAMA_CPP_TIE_GAP, convert_draft, run_requests, summarize
from eagle3_core.target import embedded_gguf_path, local_model_dir


@pytest.fixture(scope="module")
def replay(e2e_run, tmp_path_factory):
    """The debug_tiny draft memorised its 6 training answers; replaying those prompts makes acceptance high if,
    and only if, llama.cpp runs the draft as we trained it. Baseline = the same server without a draft."""
    cfg, summary = e2e_run
    rows = read_rows(cfg.run_dir / "prompts" / "train.parquet")
    with llama_server(embedded_gguf_path(), tmp_path_factory.mktemp("lc") / "base.log", parallel=1) as url:
        base = run_requests(url, rows, 64)
    return cfg, summary, rows, base


def _serve_draft(draft_gguf: Path, rows, log: Path):
    args = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
            "--spec-draft-n-min", "3"]
    with llama_server(embedded_gguf_path(), log, parallel=1, extra_args=args) as url:
        return run_requests(url, rows, 64)


def test_conversion_writes_aux_ids_as_llama_cpp_layer_inputs(e2e_run, tmp_path):
    _, summary = e2e_run
    out = convert_draft(Path(summary["draft_dir"]), Path(local_model_dir(e2e_run[0].target)), tmp_path / "d.gguf")
    field = GGUFReader(str(out)).fields["eagle3.target_layers"]
    # our ids are layer outputs [1, 14, 26]; llama.cpp captures layer inputs: output of i == input of i + 1
    assert [int(field.parts[i][0]) for i in field.data] == [2, 15, 27]


def test_trained_draft_is_accepted_and_lossless_on_llama_cpp(replay, tmp_path):
    cfg, summary, rows, base = replay
    draft_gguf = convert_draft(Path(summary["draft_dir"]), Path(local_model_dir(cfg.target)), tmp_path / "d.gguf")
    spec = _serve_draft(draft_gguf, rows, tmp_path / "eagle3.log")
    s = summarize(base, spec, LLAMA_CPP_TIE_GAP)
    assert s["tau"] >= 1.3, s
    assert s["draft_n"] > 0 and s["lossless"]["mismatch"] == 0, s
    assert "draft acceptance" in (tmp_path / "eagle3.log").read_text()


def test_untrained_draft_gives_tau_one_on_llama_cpp(replay, tmp_path):
    cfg, _, rows, base = replay
    untrained, _ = stages._fresh_draft(cfg)
    export = save_draft(untrained, tmp_path / "untrained")
    draft_gguf = convert_draft(export, Path(local_model_dir(cfg.target)), tmp_path / "u.gguf")
    s = summarize(base, _serve_draft(draft_gguf, rows, tmp_path / "u.log"), LLAMA_CPP_TIE_GAP)
    assert s["tau"] < 1.1 and s["draft_n"] > 0, s
