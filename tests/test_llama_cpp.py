"""Deploying drafts on llama.cpp's EAGLE-3 server (an engine nobody here wrote): conversion, layer-id convention in
the GGUF, acceptance of a trained draft vs an untrained one, greedy output equal to the server without a draft."""
import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from conftest import SHARED_DATA
from eagle3_core.data.prompt_set import read_rows
from eagle3_core.evaluation.llama_cpp_deploy import (
    LLAMA_CPP_TIE_GAP,
    convert_draft,
    engine_aux_hidden_states,
    run_requests,
    run_sampled,
    sampling_fields,
    summarize,
    summarize_sampled,
)
from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.evaluation.acceptance import compare_outputs
from eagle3_core.pipeline.train_stage import draft_shape, fresh_draft
from eagle3_core.serving.launcher import llama_server
from eagle3_core.target.loading import embedded_gguf_path, local_model_dir
from eagle3_core.training.checkpoint import save_draft


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


@pytest.mark.slow
def test_conversion_writes_aux_ids_as_llama_cpp_layer_inputs(e2e_run, tmp_path):
    _, summary = e2e_run
    out = convert_draft(Path(summary["draft_dir"]), Path(local_model_dir(e2e_run[0].target)), tmp_path / "d.gguf")
    field = GGUFReader(str(out)).fields["eagle3.target_layers"]
    # our ids are layer outputs [1, 14, 26]; llama.cpp captures layer inputs: output of i == input of i + 1
    assert [int(field.parts[i][0]) for i in field.data] == [2, 15, 27]


def _rel_err(a, b):
    """Mean over tokens of ||a_t - b_t|| / ||b_t|| (per token: the first token's massive activation would dominate
    a norm over the whole matrix)."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()


@pytest.mark.slow
def test_llama_cpp_feeds_the_draft_the_layers_it_was_trained_on(target_model, tokenizer, tmp_path):
    """Measured, not assumed: the hidden states llama.cpp's EAGLE-3 code extracts for a converted draft (its own
    calls, through the layer probe) equal our training features (outputs of layers [1, 14, 26]) up to llama.cpp's
    quantized arithmetic (measured: 0.9-2.5% per token), and are far from the neighbouring layers an off-by-one
    would feed (measured: 24-104%). The draft's weights do not matter here, only its converted layer ids."""
    import torch

    from eagle3_core.config import preset
    from eagle3_core.target.loading import capture
    from eagle3_core.training.draft_model import Eagle3Draft
    cfg = preset("debug_tiny", tmp_path)
    draft = Eagle3Draft(draft_shape(cfg))
    draft.init_weights(0)
    ours_ids = draft.shape.aux_layer_ids
    assert ours_ids == [1, 14, 26]
    draft_gguf = convert_draft(save_draft(draft, tmp_path / "export"), Path(local_model_dir(cfg.target)),
                               tmp_path / "d.gguf")
    tokens = tokenizer("def fibonacci(n):\n    # return the n-th Fibonacci number\n    if n < 2:")["input_ids"]
    engine_ids, engine = engine_aux_hidden_states(embedded_gguf_path(), draft_gguf, tokens)
    assert engine_ids == [i + 1 for i in ours_ids] and engine.shape == (3, len(tokens), 576)

    def features(ids):
        with torch.no_grad(), capture(target_model, ids) as store:
            target_model(torch.tensor([tokens]))
        return [a[0].float() for a in store["aux"]]

    same, below, above = features(ours_ids), features([i - 1 for i in ours_ids]), features([i + 1 for i in ours_ids])
    for k in range(3):
        err = _rel_err(engine[k], same[k])
        off = min(_rel_err(engine[k], below[k]), _rel_err(engine[k], above[k]))
        assert err < 0.05 and off > 5 * err, (k, err, off)


@pytest.mark.slow
def test_trained_draft_is_accepted_and_lossless_on_llama_cpp(replay, tmp_path):
    cfg, summary, rows, base = replay
    draft_gguf = convert_draft(Path(summary["draft_dir"]), Path(local_model_dir(cfg.target)), tmp_path / "d.gguf")
    spec = _serve_draft(draft_gguf, rows, tmp_path / "eagle3.log")
    s = summarize(base, spec, LLAMA_CPP_TIE_GAP)
    assert s["tau"] >= 1.3, s
    assert s["draft_n"] > 0 and s["lossless"]["mismatch"] == 0, s
    assert "draft acceptance" in (tmp_path / "eagle3.log").read_text()


@pytest.mark.slow
def test_untrained_draft_gives_tau_one_on_llama_cpp(replay, tmp_path):
    cfg, _, rows, base = replay
    untrained, _ = fresh_draft(cfg)
    export = save_draft(untrained, tmp_path / "untrained")
    draft_gguf = convert_draft(export, Path(local_model_dir(cfg.target)), tmp_path / "u.gguf")
    s = summarize(base, _serve_draft(draft_gguf, rows, tmp_path / "u.log"), LLAMA_CPP_TIE_GAP)
    assert s["tau"] < 1.1 and s["draft_n"] > 0, s


@pytest.mark.slow
def test_llama_cpp_samples_at_the_evaluation_settings(tmp_path):
    """llama-server with a draft at temperature 0.7 through llama_cpp_deploy.sampling_fields (two seeds, two GSM8K
    questions): it samples (answers differ from the greedy ones and between seeds) and reports its drafts (an
    untrained draft: tau about 1); without a draft it reads our top_k (top_k 1 at temperature 0.7 gives the greedy
    answers up to near-ties; its default top_k 40 would not). Needs no trained run (the trained draft's tau: the deploy stage)."""
    from eagle3_core.config import preset
    cfg = preset("debug_tiny", tmp_path / "run")
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": json.loads(line)["question"]}]}
            for i, line in enumerate((SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:2])]
    from eagle3_core.training.draft_model import Eagle3Draft
    untrained = Eagle3Draft(draft_shape(cfg))
    untrained.init_weights(0)
    draft_gguf = convert_draft(save_draft(untrained, tmp_path / "u"), Path(local_model_dir(cfg.target)),
                               tmp_path / "u.gguf")
    args = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "--spec-draft-n-min",
            "3"]
    hot = SamplingConfig(temperature=0.7)
    with llama_server(embedded_gguf_path(), tmp_path / "base.log", parallel=1) as url:     # the sampler itself
        greedy = run_requests(url, rows, 32)
        top1 = run_requests(url, rows, 32, sampling=sampling_fields(hot.model_copy(update={"top_k": 1})))
    verdicts = [compare_outputs(t["token_ids"], g["token_ids"], g["gaps"], LLAMA_CPP_TIE_GAP)
                for t, g in zip(top1, greedy)]
    assert "mismatch" not in verdicts, verdicts            # the same answers up to near-ties (quantized kernels)
    with llama_server(embedded_gguf_path(), tmp_path / "eagle3.log", parallel=1, extra_args=args) as url:
        spec = run_sampled(url, rows, 32, hot, [0, 1])
    s = summarize_sampled(greedy + greedy, spec)
    assert s["requests"] == 4 and s["prompts"] == 2 and s["draft_n"] > 0 and s["tau"] < 1.2, s
    by_seed = {seed: [r["token_ids"] for r in spec if r["seed"] == seed] for seed in (0, 1)}
    assert by_seed[0] != [g["token_ids"] for g in greedy] and by_seed[0] != by_seed[1]
