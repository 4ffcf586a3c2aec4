"""Regeneration settings: the inference server the stage starts or uses, and the requests it sends."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3_core.config.sampling_config import SamplingConfig
from eagle3_core.config.strict import StrictModel


class ServerConfig(StrictModel):
    kind: Literal["llama.cpp", "sglang", "external", "transformers"] = Field(
        "llama.cpp", description="'llama.cpp': the stage starts llama-server on the target's GGUF; 'sglang': the "
        "stage starts `python -m sglang.launch_server` on the target; 'external': use running servers (`urls`); "
        "'transformers': no server, the stage runs the target in its own process with batched `generate` "
        "(generation.concurrency rows a batch; small targets on one GPU)")
    url: str | None = Field(None, description="base URL of one running server (kind 'external')")
    urls: list[str] = Field([], description="base URLs of several running servers (kind 'external'); requests "
                                            "go to the reachable one with the fewest in flight")
    host: str = Field("127.0.0.1", description="bind address of a server the stage starts")
    port: int = Field(0, ge=0, description="port of a server the stage starts; 0 picks a free one")
    parallel: int = Field(4, ge=1, description="llama-server parallel slots (-np)")
    ctx_per_slot: int = Field(2048, ge=256, description="context tokens per slot")
    extra_args: list[str] = Field([], description="more command-line arguments for a server the stage starts "
                                                  "(e.g. ['--tp', '8'] for SGLang)")
    startup_timeout_s: float = Field(120.0, description="seconds to wait for /health (SGLang loading a large "
                                                        "model needs far more, e.g. 1800)")
    probe_interval_s: float = Field(5.0, gt=0, description="seconds between /health probes of a server that "
                                                           "stopped answering")
    down_timeout_s: float = Field(1800.0, gt=0, description="fail the stage (finished work kept) when no server "
                                                            "has answered for this long")

    def base_urls(self) -> list[str]:
        """The external servers' base URLs, without trailing slashes (`url` first, then `urls`)."""
        return [u.rstrip("/") for u in ([self.url] if self.url else []) + self.urls]


class GenerationConfig(SamplingConfig):
    """Regeneration: its sampling settings are SamplingConfig's (temperature, top_p, top_k, seed: the same shape
    as eval.sampling), then the requests' other settings."""
    api: Literal["auto", "openai", "sglang", "llama.cpp", "vllm"] = Field(
        "auto", description="'auto': the token-id API of the server the stage starts (server.kind 'sglang' -> "
        "'sglang', 'llama.cpp' -> 'llama.cpp'), else 'openai'; 'openai': /v1/chat/completions, the server applies the "
        "chat template (SGLang, vLLM, llama.cpp) and answers in text; 'sglang': SGLang's /generate with token ids; "
        "'llama.cpp': llama-server's /completion with token ids; 'vllm': vLLM's /v1/completions with token ids and "
        "return_token_ids (vLLM >= 0.10.2). Token-id APIs render the prompt with the target's chat template here "
        "and train the exact output ids")
    max_new_tokens: int = Field(256, ge=1, description="always sent: servers default to 128 or unlimited")
    concurrency: int = Field(4, ge=1, description="requests in flight over all servers")
    max_retries: int = Field(6, ge=0, description="retries per request on connection errors, timeouts, 429, 5xx")
    retry_backoff_s: float = Field(1.0, gt=0, description="first retry wait; doubles each retry (max 60 s), "
                                                          "plus up to this much random jitter")
    request_timeout_s: float = Field(300.0, gt=0, description="seconds one request may take; must exceed the "
                                                              "slowest full answer (max_new_tokens / per-stream tok/s)")
    shard_size: int = Field(1024, ge=1, description="prompts per output shard (one Parquet file, one task)")
    flush_rows: int = Field(64, ge=1, description="answers buffered before they are written to disk")
    flush_s: float = Field(30.0, gt=0, description="seconds an answer may wait in the buffer")
    progress_interval_s: float = Field(30.0, gt=0, description="seconds between progress log lines")
    max_failed_frac: float = Field(0.01, ge=0, le=1, description="quality gate: prompts without an answer")
    max_empty_frac: float = Field(0.02, ge=0, le=1, description="quality gate: empty answers")
    max_truncated_frac: float = Field(0.2, ge=0, le=1, description="quality gate: answers cut at max_new_tokens")
    max_degenerate_frac: float = Field(0.05, ge=0, le=1, description="quality gate: answers ending in a "
                                                                     "runaway repetition")
    gate_after: int = Field(64, ge=1, description="early quality gate: checked once on the first this many "
                                                  "answers of a generation call, so a degenerate start fails fast")
    chat_template_kwargs: dict = Field({}, description="chat-template arguments, e.g. {'enable_thinking': False} "
                                       "(Qwen3) or {'thinking': True} (Kimi-K2.5): sent with each request (OpenAI "
                                       "API `chat_template_kwargs`) and used by every local rendering")
    turns: Literal["final", "all"] = Field(
        "final", description="'final': regenerate the final assistant turn after the data's earlier turns; 'all': "
        "turn by turn, each user turn answered after the target's own earlier answers (eagle3_core.generation.turns)")
    max_turns: int | None = Field(None, ge=1, description="turns='all': regenerate at most this many turns per row "
                                                          "(the row ends after the last one); None: every turn")

    def api_for(self, server_kind: str) -> str:
        """The API requests use with a server of `server_kind` (ServerConfig.kind): `api`, or for 'auto' the
        token-id API of a server the stage starts ('sglang', 'llama.cpp': token in, token out), else 'openai'
        (an external server's kind is not known)."""
        if self.api != "auto":
            return self.api
        return server_kind if server_kind in ("sglang", "llama.cpp") else "openai"

