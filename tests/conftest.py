"""Shared fixtures: tiny draft shapes, the embedded target loaded once, one Prefect test server per session, and
one end-to-end run of the pipeline (debug_tiny preset) whose trained draft later tests reuse."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# task retry backoff base (tasks/retry.py), read when the tasks are defined: short in tests
os.environ.setdefault("EAGLE3_RETRY_DELAY_S", "0.2")

ROOT = Path(__file__).resolve().parents[1]
# real data sets beside the checkout (CI lays shared/ next to the clone); EAGLE3_SHARED_DATA overrides
SHARED_DATA = Path(os.environ.get("EAGLE3_SHARED_DATA", ROOT.parent / "shared" / "data"))


def tiny_shape(**kw):
    from eagle3_core.draft_model import DraftShape
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=100, draft_vocab_size=50, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=256, aux_layer_ids=[1, 2, 3])
    base.update(kw)
    return DraftShape(**base)


def tiny_draft(seed: int = 0, **kw):
    from eagle3_core.draft_model import Eagle3Draft
    torch.manual_seed(seed)
    d = Eagle3Draft(tiny_shape(**kw))
    d.init_weights(seed)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        # random non-trivial weights everywhere so that tests see every term
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
        d.d2t.copy_(torch.arange(0, 100, 2) - torch.arange(50))       # draft id i -> target id 2i
        d.t2d.zero_()
        d.t2d[::2] = True
    return d


@pytest.fixture(scope="session")
def target_cfg():
    from eagle3_core.config import TargetConfig
    return TargetConfig()


@pytest.fixture(scope="session")
def tokenizer(target_cfg):
    from eagle3_core.target import load_tokenizer
    return load_tokenizer(target_cfg)


@pytest.fixture(scope="session")
def target_model(target_cfg):
    from eagle3_core.target import load_target
    return load_target(target_cfg)


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def e2e_run(prefect_server, tmp_path_factory):
    """The end-to-end flow on a handful of prompts, with the real llama.cpp server, under the Prefect harness."""
    from eagle3_core.config import preset
    from flows.pipeline import eagle3_pipeline
    cfg = preset("debug_tiny", tmp_path_factory.mktemp("run") / "debug_tiny")
    summary = eagle3_pipeline(cfg)
    return cfg, summary


@pytest.fixture(scope="session")
def tiny_target_dirs(tmp_path_factory):
    """{family: directory} of tiny random-weight targets of every family in tiny_targets.FAMILIES."""
    from tiny_targets import FAMILIES, build
    root = tmp_path_factory.mktemp("tiny_targets")
    return {f: build(f, root / f) for f in FAMILIES}
