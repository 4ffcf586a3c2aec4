"""Phase 6 on SGLang as a pipeline stage: the servers' arguments for a big target (tensor and expert parallel,
remote code, revision), tau from SGLang's own spec_verify_ct, speed-up and break-even tau per concurrency, the
report; and the stage skipping cleanly, saying why, where SGLang cannot run (every machine of ours: it needs CUDA).

The SGLang servers are the in-process stand-ins of tests/test_sglang_bench.py, whose responses carry exactly the
fields sglang 0.5.14 builds (that module's docstring names the files); the flags are sglang 0.5.14
`srt/server_args.py`'s: `tp_size` (--tp-size, alias --tensor-parallel-size), `ep_size` (--ep-size, aliases
--expert-parallel-size, --ep), `trust_remote_code`, `revision`, derived from field names (`attr.replace('_', '-')`).
"""
import json

import httpx
import pytest

from eagle3_core.config import PipelineConfig, SGLangDeployConfig, TargetConfig
from eagle3_core.evaluation.sglang_bench import SpecArgs, server_command, target_server_args
from eagle3_core.evaluation.sglang_deploy import markdown, run_benchmark
from eagle3_core.pipeline import report
from eagle3_core.pipeline.deploy_stage import deploy_sglang_skip
from test_sglang_bench import PLAN, PROMPTS, SGLangStandIn


def test_big_target_servers_get_tp_ep_remote_code_and_revision_and_eagle_is_refused():
    args = target_server_args(8, 8, True, "abc123", ["--mem-fraction-static", "0.85"])
    assert args == ["--tp-size", "8", "--ep-size", "8", "--trust-remote-code", "--revision", "abc123",
                    "--mem-fraction-static", "0.85"]
    assert target_server_args() == []                                   # one GPU, no remote code: nothing extra
    base = server_command("moonshotai/Kimi-K2.5", "127.0.0.1", 30000, 32, 32, None, args)
    spec = server_command("moonshotai/Kimi-K2.5", "127.0.0.1", 30000, 32, 32, SpecArgs("runs/k/draft/export"),
                          args)
    assert base[-len(args):] == spec[-len(args):] == args               # both servers: the same target arguments
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    with pytest.raises(ValueError, match="must be served with EAGLE3"):
        server_command("m", "127.0.0.1", 1, 8, 8, SpecArgs("d", algorithm="EAGLE"), args)
    with pytest.raises(ValueError, match="ep_size 3 must divide tp_size 8"):
        target_server_args(8, 3)


def test_running_servers_by_url_give_tau_speedup_and_break_even_per_concurrency(tmp_path):
    servers = {"base": SGLangStandIn(PLAN), "spec": SGLangStandIn(PLAN, "EAGLE3")}

    async def route(request: httpx.Request) -> httpx.Response:
        return await servers[request.url.host](request)
    result = run_benchmark("target", SpecArgs("draft", 5, 1, 6), PROMPTS, [1, 2], tmp_path, 64, 32, 32,
                           urls={"baseline": "http://base", "eagle3": "http://spec/"},
                           transport=httpx.MockTransport(route))
    v = result["verdict"]
    assert v["tau"] == pytest.approx(194 / 102) and v["warnings"] == []
    for p, b, e in zip(v["per_level"], result["baseline"]["levels"], result["eagle3"]["levels"]):
        speedup = e["output_tokens_per_s"] / b["output_tokens_per_s"]
        assert p["speedup"] == pytest.approx(speedup) and p["tau"] == pytest.approx(194 / 102)
        assert p["break_even_tau"] == pytest.approx((194 / 102) / speedup)
    assert len(servers["base"].bodies) == len(servers["spec"].bodies) == 1 + 2 * len(PROMPTS)
    assert json.loads((tmp_path / "sglang_bench.json").read_text())["verdict"] == v
    md = (tmp_path / "sglang_bench.md").read_text()
    assert md == markdown(result) and "| break-even tau |" in md and (tmp_path / "tok_s_vs_concurrency.png").exists()


def test_break_even_of_the_reference_case():
    """docs/reference_case.md, as given: baseline 90.0 tok/s, EAGLE-3 at tau 2.1 gave 82.3 tok/s: break-even tau 2.1 / (82.3 / 90)
    = 2.30, the team's 'break-even ~2.5' within their rounding."""
    from eagle3_core.evaluation.sglang_bench import verdict
    lv = {"concurrency": 1, "completion_tokens": 210, "spec_verify_ct": 100}
    v = verdict([{**lv, "output_tokens_per_s": 90.0}], [{**lv, "output_tokens_per_s": 82.3, "tau": 2.1}])
    assert v["per_level"][0]["break_even_tau"] == pytest.approx(2.1 * 90.0 / 82.3) == pytest.approx(2.2965, 1e-4)


def test_the_stage_skips_saying_why_and_runs_where_it_can(tmp_path, tiny_target_dirs):
    gguf = PipelineConfig(run_dir=tmp_path / "a")                           # the embedded GGUF target
    assert "llama.cpp deployment stage serves it" in deploy_sglang_skip(gguf)
    hf = PipelineConfig(run_dir=tmp_path / "b", target=TargetConfig(model=str(tiny_target_dirs["llama"])))
    why = deploy_sglang_skip(hf)
    assert "SGLang is not installed here" in why and "deploy_sglang.baseline_url" in why
    off = hf.model_copy(update={"deploy_sglang": SGLangDeployConfig(enabled="off")})
    assert deploy_sglang_skip(off) == "deploy_sglang.enabled is 'off'"
    with pytest.raises(RuntimeError, match="install SGLang or give both URLs"):
        deploy_sglang_skip(hf.model_copy(update={"deploy_sglang": SGLangDeployConfig(enabled="on")}))
    urls = hf.model_copy(update={"deploy_sglang": SGLangDeployConfig(baseline_url="http://a:1",
                                                                     eagle3_url="http://b:2")})
    assert deploy_sglang_skip(urls) is None


@pytest.mark.slow
def test_the_report_shows_the_sglang_deployment(e2e_run):
    """The session's end-to-end run (a GGUF target) skipped the stage with a manifest saying so; a run whose
    deploy_sglang manifest holds a verdict shows its table."""
    cfg, _ = e2e_run
    m = json.loads((cfg.run_dir / "deploy_sglang" / "manifest.json").read_text())
    assert "llama.cpp deployment stage serves it" in m["skipped"]
    r = report.collect(cfg.run_dir)
    assert r["sglang"] is None and "Deployed on SGLang" not in report.markdown(r)
    per = [{"concurrency": 1, "baseline_tok_s": 90.0, "eagle3_tok_s": 82.3, "speedup": 82.3 / 90.0, "tau": 2.1,
            "break_even_tau": 2.1 * 90.0 / 82.3}]
    r["sglang"] = {"per_level": per, "tau": 2.1, "summary": "EAGLE3 is slower at every concurrency: 0.91x at "
                   "concurrency 1", "warnings": []}
    md = report.markdown(r)
    assert "## Deployed on SGLang" in md and "| 1 | 90.0 | 82.3 | 0.91x | 2.10 | 2.30 |" in md


def test_the_sglang_benchmark_sends_the_evaluation_sampling_settings(tmp_path):
    """Both servers get eval.sampling's temperature, top_p, top_k and seed (as sglang 0.5.14's SamplingParams names
    them: sampling_seed; the stand-in refuses unknown fields and values SGLang refuses); greedy stays temperature 0
    without top_k/top_p. Only the request is tested: SGLang's tau at temperature > 0 is not measured here (no GPU)."""
    from eagle3_core.config.sampling_config import SamplingConfig
    servers = {"base": SGLangStandIn(PLAN), "spec": SGLangStandIn(PLAN, "EAGLE3")}

    async def route(request: httpx.Request) -> httpx.Response:
        return await servers[request.url.host](request)
    s = SamplingConfig(temperature=0.7, top_p=0.95, top_k=20, seed=3)
    result = run_benchmark("target", SpecArgs("draft", 5, 1, 6), PROMPTS, [1], tmp_path, 64, 32, 32,
                           urls={"baseline": "http://base", "eagle3": "http://spec"},
                           transport=httpx.MockTransport(route), sampling=s)
    for server in servers.values():
        assert [b["sampling_params"] for b in server.bodies[1:]] == [
            {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "sampling_seed": 3}] * len(PROMPTS)
    assert result["args"]["sampling"]["temperature"] == 0.7
    servers = {"base": SGLangStandIn(PLAN), "spec": SGLangStandIn(PLAN, "EAGLE3")}
    run_benchmark("target", SpecArgs("draft", 5, 1, 6), PROMPTS, [1], tmp_path, 64, 32, 32,
                  urls={"baseline": "http://base", "eagle3": "http://spec"}, transport=httpx.MockTransport(route),
                  sampling=SamplingConfig(temperature=1.0, top_k=0))
    assert servers["spec"].bodies[-1]["sampling_params"] == {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0,
                                                             "sampling_seed": 0}       # top_k off: SGLang's -1
