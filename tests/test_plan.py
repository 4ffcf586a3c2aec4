"""`plan CONFIG`: the reference team's hand arithmetic (docs/reference_case.md) reproduced from their given rates,
what fp8 and online features change, refused rates files, and the measured rates of a finished run planning it back."""
import json

import pytest
from conftest import ROOT

from eagle3_core.config import load_config
from eagle3_core.contract.layout import RunLayout
from eagle3_core.features.store_formats import bytes_per_token
from eagle3_core.plan import (
    STAGE_RATES,
    compare,
    fill_rates,
    fits_table,
    load_rates,
    main,
    markdown,
    measured_rates,
    missing_rates,
    parse_size,
    plan_run,
)

RATES = ROOT / "configs" / "rates.json"
KIMI = ROOT / "configs" / "kimi_k25_agentic_100k.json"
# the team's own arithmetic (max length 2048, ~2,000 tokens a sample): docs/reference_case.md
TEAM = ROOT / "configs" / "kimi_k25_team_10k_to_100k.json"
KIMI_CONFIGS = [KIMI, TEAM, ROOT / "configs" / "kimi_k25_smoke.json"]
PROFILES = sorted(json.loads(RATES.read_text())["profiles"])
# the Kimi-K2.5-sized draft's own train rate (profile kimi_k25_draft, measured by benchmarks/train_throughput.py
# --shape kimi), which kimi_k25_agentic plans its train stage with (train_from)
DRAFT_TOK_S = json.loads(RATES.read_text())["profiles"]["kimi_k25_draft"]["rates"]["train_tok_s_per_gpu"]["value"]


def _stage(p, name):
    return next(r for r in p["stages"] if r["stage"] == name)


def test_the_reference_plan_reproduces_9_2_tb_24_h_and_18_8_h_within_10_percent():
    cfg = load_config(TEAM)
    rates = load_rates(RATES, "reference_kimi_k25")
    bf16 = plan_run(cfg.model_copy(update={"features": cfg.features.model_copy(update={"format": "bf16"})}),
                    rates, gpus=8)
    # the team: 200M tokens at 2,300 tok/s; 100K samples at 1.48 samples/s. Disk by the store's rule (check's too):
    # 57,353 B/token x 2,000 tokens = 114.7 MB a sample, 11.36 TB, where the team gave ~92 MB a sample (9.2 TB)
    assert bf16["disk_bytes"] == 99000 * 2000 * bytes_per_token("bf16", 7168) == pytest.approx(11.356e12, rel=1e-3)
    assert rates["feature_bytes_per_sample"]["value"] / (bf16["disk_bytes"] / 99000) == pytest.approx(0.802, rel=1e-3)
    assert _stage(bf16, "generation")["hours"] == pytest.approx(200e6 / 2300 / 3600, rel=0.10)
    assert _stage(bf16, "features")["hours"] == pytest.approx(18.8, rel=0.10)
    # exactly what the config changes: 99K train prompts (1K held out), of which the kept trajectories (deepswe
    # 2,800 + kimi-k2.5-2000x 2,000 of the mix's 100K) need no request
    assert bf16["workload"] == {"samples": 99000, "rows": 99000, "regenerated": 99000 - 4752, "unrouted": 4752,
                                "answer_tokens": 2000, "tokens": 2000}
    assert _stage(bf16, "generation")["hours"] == pytest.approx(94248 * 2000 / 2300 / 3600)
    assert all(r["rate"] is None or r["rate"]["status"] in ("measured", "given", "scaled") for r in bf16["stages"])

    fp8 = plan_run(cfg, rates, gpus=8)                                   # the config's own format
    assert cfg.features.format == "fp8" and fp8["disk_bytes"] == 99000 * 2000 * (4 * 7168 + 17)   # 0.500 of bf16
    online = plan_run(cfg.model_copy(update={"features": cfg.features.model_copy(update={"format": "online"})}),
                      rates, gpus=8)
    assert online["disk_bytes"] < 1e-3 * bf16["disk_bytes"] and _stage(online, "features")["hours"] == 0
    assert _stage(online, "train")["hours"] == pytest.approx(_stage(bf16, "train")["hours"]
                                                             + 4 * _stage(bf16, "features")["hours"])
    four_nodes = plan_run(cfg, rates, gpus=32)
    assert _stage(four_nodes, "generation")["hours"] == pytest.approx(_stage(fp8, "generation")["hours"] / 4)


def test_a_rate_without_a_source_or_status_is_refused_naming_it(tmp_path):
    bad = json.loads(RATES.read_text())
    bad["profiles"]["reference_kimi_k25"]["rates"]["gpus_per_server"]["status"] = "guessed"
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"rates\.json: profile 'reference_kimi_k25' rate 'gpus_per_server'"):
        load_rates(path, "reference_kimi_k25")
    with pytest.raises(ValueError, match=r"no profile 'nope'; profiles: \['demo_cpu', 'kimi_k25_agentic', "
                                         r"'kimi_k25_draft', 'kimi_k25_ep_int4_h200', 'reference_kimi_k25'\]"):
        load_rates(path, "nope")


@pytest.mark.slow                 # the session's end-to-end run
def test_a_finished_runs_measured_rates_plan_it_back(e2e_run, tmp_path, capsys):
    """The session's end-to-end run measured its own rates; planning the same config with them gives each stage's
    measured time back (the arithmetic is consistent), and the CLI writes and reads the profile."""
    cfg, _ = e2e_run
    rates = measured_rates(cfg.run_dir, "the test session's debug_tiny run")
    assert all(r["status"] in ("measured", "given") and r["source"] for r in rates.values())
    ratios = compare(plan_run(cfg, rates, gpus=1), cfg.run_dir)
    assert set(ratios) == {"generation", "features", "train", "evaluate"}
    assert all(r == pytest.approx(1.0, rel=0.02) for r in ratios.values()), ratios
    path = tmp_path / "rates.json"
    assert main([str(KIMI), "--profile", "tiny", "--rates", str(path), "--measure", str(cfg.run_dir),
                 "--where", "test"]) == 0
    assert load_rates(path, "tiny")["generation_tok_s_per_server"]["status"] == "measured"
    capsys.readouterr()
    assert main(["debug_tiny", "--profile", "tiny", "--rates", str(path), "--against", str(cfg.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "| generation |" in out and "measured / planned: generation 1.00x" in out
    assert "With features.format 'online':" in out


def test_check_reads_the_reference_config_offline_and_names_what_one_node_cannot_hold():
    """The reference case as a file, checked against a config-only Kimi-K2.5 fixture whose experts are bf16
    (tests/test_check.py: the published dimensions, no quantization_config): the family recipe's geometry and
    SGLang's [2, 30, 58] capture, and the refusal of 'ep_int4' on experts that are not quantized, naming the
    field. Against the offline config with the checkpoint's INT4 experts it passes (tests/test_parallel_fit.py)."""
    import test_check

    from eagle3_core.check import check_run
    cfg = load_config(KIMI)
    facts, problems = check_run(cfg, target_config=test_check.kimi_k25.__wrapped__(),
                                memory=(8 * 141 << 30, "8 x H200"), gpus=(8, 141 << 30))
    assert facts["family"] == "mla" and facts["aux_layer_ids"]["sglang"]["captures_inputs_of"] == [2, 30, 58]
    assert facts["draft_geometry"]["num_attention_heads"] == 64 and facts["draft_geometry"]["head_dim"] == 128
    assert [f for f, _ in problems] == ["features.backend"], problems
    assert "experts are not quantized" in problems[0][1] and facts["backends"]["evaluate"]["evaluator"] == "replay"


@pytest.mark.slow
def test_check_cli_reads_the_reference_config_offline_from_a_config_json(tmp_path, capsys):
    """`check CONFIG --target-config config.json`: the reference config checked with only the target's config.json
    on disk (written here from the config-only Kimi-K2.5 fixture); the same facts and refusals as check_run with
    the fixture object. Without it and without network, a message naming the target and the way out, exit 2."""
    import test_check

    from eagle3_core.check import main, target_config_file
    path = tmp_path / "config.json"
    path.write_text(test_check.kimi_k25.__wrapped__().to_json_string())
    read = target_config_file(path)
    assert type(read).__name__ == "Kimi_K25Config" and read.text_config.hidden_size == 7168
    assert read.text_config.num_hidden_layers == 61 and read.text_config.kv_lora_rank == 512
    assert main([str(KIMI), "--target-config", str(path)]) == 1          # bf16 experts: ep_int4 refused
    out, err = capsys.readouterr()
    assert "config_class: Kimi_K25Config" in out and "family: mla" in out and "layers: 61" in out
    assert "- features.backend: 'ep_int4' keeps routed experts as the checkpoint stores them" in err
    assert main([str(KIMI)]) == 2                                          # no network, nothing cached
    assert "cannot read the config of target 'moonshotai/Kimi-K2.5'" in capsys.readouterr().err


def test_plan_prints_the_ep_int4_projection_beside_the_given_features_rate(capsys):
    """configs/rates.json's kimi_k25_ep_int4_h200 (benchmarks/int4_ep_throughput.py on one H200) is planned beside
    the team's 1.48 samples/s: its node rate is the stated formula over its measured per-layer times, with the
    unmeasured communication as a range."""
    r = {k: v["value"] for k, v in load_rates(RATES, "kimi_k25_ep_int4_h200").items()}
    comm = (r["comm_ms_per_layer_low"] + r["comm_ms_per_layer_high"]) / 2
    t_ms = (60 * (r["experts_int4_ms"] + r["mla_8_heads_ms"] + r["moe_rest_ms"]) + r["mla_8_heads_ms"]
            + r["dense_mlp_ms"] + r["lm_head_ms"] + 61 * comm)
    # the profile's ms are rounded to 3 decimals: the rate recomputed from them agrees to 1e-4
    assert r["extraction_tok_s_per_replica"] == pytest.approx(min(16384 / t_ms * 1e3, r["writer_tok_s"]), rel=1e-4)
    assert r["extraction_tok_s_per_replica_slow"] < r["extraction_tok_s_per_replica"] \
        < r["extraction_tok_s_per_replica_fast"]
    main([str(TEAM), "--profile", "reference_kimi_k25", "--gpus", "8"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("features beside the given rate"))
    hours = 99000 * 2000 / r["extraction_tok_s_per_replica"] / 3600
    assert "18.58 h at 1.48 samples/s (reference_kimi_k25, given)" in line
    assert f"; {hours:.2f} h (" in line and "kimi_k25_ep_int4_h200, scaled" in line and "not measured" in line


def test_plan_counts_the_samples_after_the_history_split():
    """A row whose template rewrites its history gives several samples (eagle3_core.data.history): with a measured
    samples_per_row of 1.5, extraction, disk and training plan for 1.5x the samples of the prompt rows."""
    cfg = load_config(KIMI)
    rates = load_rates(RATES, "reference_kimi_k25")
    one = plan_run(cfg, rates, gpus=8)
    split = plan_run(cfg, {**rates, "samples_per_row": {"value": 1.5, "unit": "samples per row",
                                                        "status": "measured", "source": "a test"}}, gpus=8)
    assert split["workload"]["samples"] == round(1.5 * one["workload"]["samples"]) == 148500
    assert split["workload"]["rows"] == one["workload"]["rows"] == 99000
    assert split["disk_bytes"] == pytest.approx(1.5 * one["disk_bytes"])
    assert _stage(split, "features")["hours"] == pytest.approx(1.5 * _stage(one, "features")["hours"])
    assert _stage(split, "generation")["hours"] == _stage(one, "generation")["hours"]      # requests per row
    # a keep source told to regenerate (SourceSpec.kept) is answered: its rows are requests again
    mix = cfg.prompts.mix.model_copy(update={"sources": [s.model_copy(update={"kept": "regenerate"})
                                                         if s.mode == "keep" else s for s in cfg.prompts.mix.sources]})
    regen = plan_run(cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"mix": mix})}), rates, gpus=8)
    assert one["workload"]["regenerated"] == 99000 - 4752 and regen["workload"]["regenerated"] == 99000


def test_plan_counts_the_kept_rows_the_prompts_stage_rerouted_as_requests(tmp_path):
    """Both keep sources of the agentic config are kept 'auto': before the prompts stage has probed them, plan
    counts their 4,752 rows as kept and says so on its first line; once prompts/manifest.json routes
    deepswe-kimi-k2 to 'regenerate' (a history the target would not write) and kimi-k2.5-2000x to 'train', the
    deepswe rows (2,800 of the 100K counted, 2,772 of 99K) are requests again and the line is gone."""
    cfg = load_config(KIMI).model_copy(update={"run_dir": tmp_path})
    rates = load_rates(RATES, "kimi_k25_agentic")
    before = plan_run(cfg, rates, gpus=8)
    assert (before["workload"]["regenerated"], before["workload"]["unrouted"]) == (94248, 4752)
    assert "4752 rows of kept 'auto' sources counted as kept until the prompts stage routes them" in \
        markdown(before)
    manifest = RunLayout(tmp_path).manifest("prompts")
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"kept_routes": {
        "deepswe-kimi-k2": {"route": "regenerate", "probed_row": 0, "cause": "template", "reason": "a test"},
        "kimi-k2.5-2000x": {"route": "train", "probed_row": 0, "cause": None, "reason": ""}}}))
    after = plan_run(cfg, rates, gpus=8)
    assert (after["workload"]["regenerated"], after["workload"]["unrouted"]) == (94248 + 2772, 0)
    assert _stage(after, "generation")["hours"] == pytest.approx(97020 * 2600 / 2300 / 3600)
    assert "counted as kept until" not in markdown(after)


def test_the_agentic_reference_config_plans_its_own_lengths_and_the_teams_config_is_refused_by_check(capsys):
    """configs/kimi_k25_agentic_100k.json (max_length 32,768, 8,192 new tokens; docs/reference_case.md) planned
    with the per-token profile kimi_k25_agentic: its tokens per sample, disk from Kimi-K2.5's hidden size and the
    fp8 format, hours from the team's rates per token (train: the draft's own profile). The team's 2048-token config is kept for its arithmetic,
    and check refuses it: 2,048 new tokens leave no room for a prompt in max_length 2,048."""
    from eagle3_core.check import check_run
    cfg = load_config(KIMI)
    rates = load_rates(RATES, "kimi_k25_agentic")
    p = plan_run(cfg, rates, gpus=8)
    assert {k: p["workload"][k] for k in ("samples", "regenerated", "answer_tokens", "tokens")} == \
        {"samples": 99000, "regenerated": 94248, "answer_tokens": 2600, "tokens": 5200}
    assert p["disk_bytes"] == 99000 * 5200 * bytes_per_token("fp8", 7168)                 # 14.8 TB of fp8
    assert _stage(p, "generation")["hours"] == pytest.approx(94248 * 2600 / 2300 / 3600)   # 29.6 h
    assert _stage(p, "features")["hours"] == pytest.approx(99000 * 5200 / (1.48 * 2000) / 3600)   # 48.3 h
    assert _stage(p, "train")["hours"] == pytest.approx(4 * 99000 * 5200 / (DRAFT_TOK_S * 8 * 0.9) / 3600)
    main([str(KIMI), "--profile", "kimi_k25_agentic", "--gpus", "8"])
    out = capsys.readouterr().out
    assert "99000 samples (94248 regenerated), 5200 tokens and 2600 answer tokens per sample" in out
    total = sum(r["hours"] for r in p["stages"])                  # generation + features + train (no eval rate)
    assert total == pytest.approx(94248 * 2600 / 2300 / 3600 + 99000 * 5200 / (1.48 * 2000) / 3600
                                  + _stage(p, "train")["hours"])
    total_row = f"| total (without evaluate: no rate) | {total:.2f} | |"       # an unknown stage is not 0 h
    assert f"{total_row} 14.77 TB |" in out and f"{total_row} 29.53 TB |" in out
    assert "| evaluate | - | - | 0.00 TB | - |" in out and "| evaluate | 0.00 |" not in out
    from eagle3_core.check import target_config_file
    kimi = target_config_file(ROOT / "tests" / "data" / "kimi_k25" / "config.json")
    facts, problems = check_run(load_config(TEAM), target_config=kimi, memory=(128 << 30, "head node"),
                                gpus=(8, 141 << 30))
    assert [f for f, _ in problems] == ["generation.max_new_tokens"], problems
    assert "2048 leaves no room for a prompt in features.max_length 2048" in problems[0][1]
    assert facts["token_budget"]["room_for_the_prompt"] == 0
    facts, problems = check_run(cfg, target_config=kimi, memory=(128 << 30, "head node"), gpus=(8, 141 << 30))
    assert problems == [] and facts["token_budget"]["server_context"] == 33792


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_plans_the_three_kimi_configs_alone_and_filled_from_another(profile, capsys):
    """Each profile of configs/rates.json plans each Kimi config: a stage whose rates it lacks is left unplanned
    (0 h, a note naming the rates and --fill-from), the others planned from its own rates; filled from every other
    profile, it keeps its own rates and takes only what it lacks, each taken rate's source naming the profile."""
    own = load_rates(RATES, profile)
    for path in KIMI_CONFIGS:
        cfg = load_config(path)
        p = plan_run(cfg, own, gpus=8)
        lacks = {st: missing_rates(own, st, cfg.features.format) for st in STAGE_RATES}
        assert p["unplanned"] == {st: m for st, m in lacks.items() if m}
        for st in STAGE_RATES:
            row = _stage(p, st)
            if st in p["unplanned"]:
                assert row["hours"] == 0 and row["rate"] is None and "NOT PLANNED" in row["note"]
                assert all(m in row["note"] for m in p["unplanned"][st]) and "--fill-from" in row["note"]
            else:
                assert row["hours"] > 0 and row["rate"]["source"] == own[row["rate"]["name"]]["source"]
        for other in [q for q in PROFILES if q != profile]:
            rates = fill_rates(own, load_rates(RATES, other), other)
            f = plan_run(cfg, rates, gpus=8)
            assert set(f["unplanned"]) <= set(p["unplanned"])
            for st in set(STAGE_RATES) - set(f["unplanned"]):
                r = _stage(f, st)["rate"]
                assert r["source"] == (own[r["name"]]["source"] if r["name"] in own
                                       else f"{load_rates(RATES, other)[r['name']]['source']} [taken from profile "
                                            f"{other}]")
            if "features" not in f["unplanned"]:          # the disk: one rule, store_formats.bytes_per_token
                w = f["workload"]
                assert f["disk_bytes"] == w["samples"] * w["tokens"] * bytes_per_token(
                    cfg.features.format, int(rates["target_hidden_size"]["value"]))
        assert main([str(path), "--profile", profile, "--gpus", "8", "--disk", "11TB"]) == 0
        out = capsys.readouterr().out
        assert (f"profile {profile!r} cannot plan" in out) == bool(p["unplanned"])


def test_the_ep_int4_profile_plans_features_only_until_filled_and_keeps_its_own_extraction_rate(capsys):
    """kimi_k25_ep_int4_h200 holds features rates only: alone it says so; filled from kimi_k25_agentic every stage
    is planned with its projected 18,552 tok/s (not the team's rate) and the team's generation and train rates."""
    main([str(KIMI), "--profile", "kimi_k25_ep_int4_h200", "--gpus", "8"])
    out = capsys.readouterr().out
    assert ("profile 'kimi_k25_ep_int4_h200' cannot plan generation (lacks gpus_per_server, "
            "generation_tok_s_per_server, output_tokens_per_sample), features (lacks tokens_per_sample, "
            "target_hidden_size), train (lacks train_tok_s_per_gpu, tokens_per_sample)") in out
    rates = fill_rates(load_rates(RATES, "kimi_k25_ep_int4_h200"), load_rates(RATES, "kimi_k25_agentic"),
                       "kimi_k25_agentic")
    p = plan_run(load_config(KIMI), rates, gpus=8)
    assert p["unplanned"] == {}
    assert _stage(p, "features")["rate"]["value"] == 18552
    assert _stage(p, "features")["hours"] == pytest.approx(99000 * 5200 / 18552 / 3600)          # 7.71 h
    assert "[taken from profile kimi_k25_agentic]" in _stage(p, "generation")["rate"]["source"]


def test_disk_sizes_parse_in_tb_and_tib_and_refuse_the_rest():
    assert parse_size("11TB") == 11e12 and parse_size("11 tb") == 11e12 and parse_size("500GB") == 5e11
    assert parse_size("10TiB") == 10 * 2 ** 40 and parse_size("1e12") == 1e12
    with pytest.raises(ValueError, match=r"--disk '11 terabytes': give a number and a unit"):
        parse_size("11 terabytes")


def test_the_agentic_config_on_the_teams_node_fits_11_tb_only_online_and_nothing_in_2_5_days(capsys):
    """configs/kimi_k25_agentic_100k.json on 8 x H200 with the team's 11 TB (docs/reference_case.md): bf16 29.53 TB
    and fp8 14.77 TB do not fit; online does (nothing stored) but runs the target every epoch: 231 h at the team's
    given extraction rate, 68.6 h at ep_int4's projected (not measured) node rate, both over 2.5 days (60 h)."""
    cfg = load_config(KIMI)
    team = load_rates(RATES, "kimi_k25_agentic")
    rows = {r["format"]: r for r in fits_table(cfg, team, 8, 11e12, days=2.5)}
    assert [rows[f]["fits"] for f in ("bf16", "fp8", "online")] == [False, False, True]
    assert rows["fp8"]["disk_bytes"] == 99000 * 5200 * (4 * 7168 + 17)                           # 14.77 TB
    assert rows["fp8"]["max_samples"] == int(11e12 // (5200 * (4 * 7168 + 17))) == 73735
    E, gen, train = 4, 94248 * 2600 / 2300 / 3600, 4 * 99000 * 5200 / (DRAFT_TOK_S * 8 * 0.9) / 3600
    assert rows["online"]["hours"] == pytest.approx(gen + train + E * 99000 * 5200 / 2960 / 3600)   # 231.0 h
    assert not any(r["within"] for r in rows.values())
    ep = fill_rates(load_rates(RATES, "kimi_k25_ep_int4_h200"), team, "kimi_k25_agentic")
    rows = {r["format"]: r for r in fits_table(cfg, ep, 8, 11e12, days=2.5)}
    assert rows["online"]["hours"] == pytest.approx(gen + train + E * 99000 * 5200 / 18552 / 3600)  # 68.6 h
    assert rows["online"]["within"] is False and rows["fp8"]["within"] is True and rows["fp8"]["fits"] is False
    main([str(KIMI), "--profile", "kimi_k25_ep_int4_h200", "--fill-from", "kimi_k25_agentic", "--gpus", "8",
          "--disk", "11TB", "--days", "2.5"])
    out = capsys.readouterr().out
    assert "Fits 11.00 TB free (--disk; TB = 10^12 bytes) within 2.5 days (60 h):" in out
    fp8_h, online_h = gen + 99000 * 5200 / 18552 / 3600 + train, rows["online"]["hours"]     # 45.5 h, 68.6 h at 9,750
    assert f"| fp8 | 14.77 TB | no | {fp8_h:.1f} | yes | 73735 |" in out
    assert f"| online | 0.00 TB | yes | {online_h:.1f} | no | all |" in out
    assert ("No format fits: bf16 needs 29.53 TB > 11.00 TB; fp8 needs 14.77 TB > 11.00 TB; fp8_topk needs 14.90 TB "
            f"> 11.00 TB; online needs {online_h:.1f} h > 60 h.\nThe most train samples that fit both: "
            f"{rows['online']['samples_in_time']} in online") in out


def test_plan_fits_the_run_dirs_free_disk_by_default(tmp_path, capsys):
    import shutil
    cfg = json.loads(KIMI.read_text())
    cfg["run_dir"] = str(tmp_path / "not_yet" / "run")
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    main([str(path), "--profile", "kimi_k25_agentic", "--gpus", "8"])
    free = shutil.disk_usage(tmp_path).free
    assert f"Fits {free / 1e12:.2f} TB free ({tmp_path}; TB = 10^12 bytes):" in capsys.readouterr().out


def test_plan_names_the_plateau_rules_ceiling_and_expected_epochs_when_epochs_are_unset():
    """train.epochs unset: the train row plans the plateau rule's expected epochs (training.stopping.MEASURED: no
    plateau by 24 epochs at ~1.1M tokens an epoch, so the ceiling) and names the ceilings; epochs set plans those."""
    cfg = load_config(KIMI)
    rates = load_rates(RATES, "reference_kimi_k25")
    unset = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": None, "max_epochs": 10,
                                                                         "max_train_s": 7200.0})})
    fixed = plan_run(cfg, rates, gpus=8)
    rule = plan_run(unset, rates, gpus=8)
    note = _stage(rule, "train")["note"]
    assert "10 epochs expected until the plateau" in note and "ceiling 10 epochs and 7200 s of training" in note
    assert _stage(rule, "train")["hours"] == pytest.approx(_stage(fixed, "train")["hours"] * 10 / cfg.train.epochs)
    assert _stage(fixed, "train")["note"].startswith(f"{cfg.train.epochs} epochs, DDP")


def test_the_kimi_config_plans_training_with_the_kimi_drafts_own_profile(tmp_path):
    """kimi_k25_agentic's train rate is profile kimi_k25_draft's (the Kimi-sized draft measured, not the 8B-shaped
    draft's rate scaled): changing that profile's value changes the planned train hours; a train_from profile
    without the rate is refused naming both."""
    rates = load_rates(RATES, "kimi_k25_agentic")
    own = load_rates(RATES, "kimi_k25_draft")["train_tok_s_per_gpu"]
    assert rates["train_tok_s_per_gpu"]["value"] == own["value"] == DRAFT_TOK_S
    assert rates["train_tok_s_per_gpu"]["source"] == own["source"] + " [profile kimi_k25_draft]"
    data = json.loads(RATES.read_text())
    data["profiles"]["kimi_k25_draft"]["rates"]["train_tok_s_per_gpu"].update(value=12345, status="measured")
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    p = plan_run(load_config(KIMI), load_rates(path, "kimi_k25_agentic"), gpus=8)
    assert _stage(p, "train")["rate"]["status"] == "measured"
    assert _stage(p, "train")["hours"] == pytest.approx(4 * 99000 * 5200 / (12345 * 8 * 0.9) / 3600)
    data["profiles"]["kimi_k25_draft"]["rates"] = {}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"profile 'kimi_k25_agentic' has train_from 'kimi_k25_draft', which has no "
                                         r"train_tok_s_per_gpu"):
        load_rates(path, "kimi_k25_agentic")
