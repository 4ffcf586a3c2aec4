"""The reference rehearsal's pieces (tests/test_reference_rehearsal*.py): the tiny Kimi-K2.5-shaped target, each
mix source's local fixture file, and what the SGLang token-API stand-in answers.

The target: transformers' `Kimi_K25Config` wrapper around an 8-layer DeepSeek-V3 text model (MLA, routed experts
packed INT4 by compressed-tensors as the published checkpoint packs them: tests/int4_targets.py) whose vocabulary is
the stand-in tokenizer's: the embedded tokenizer with Kimi's marker tokens as single ids and the K2.5-style
template, thinking on by default (tests/chat_templates.py), and Kimi-K2.5's two end tokens, the tokenizer's EOS
`[EOS]` and the end of turn `<|im_end|>`, both in generation_config.json's `eos_token_id` as in the published
checkpoint (tests/test_history.py `kimi_with_eos`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from chat_templates import stand_in
from int4_targets import build_int4
from sglang_stand_in import SGLangTokenStandIn

FIX = Path(__file__).parent / "fixtures"
LAYERS = 8
MAX_POSITIONS = 1024
SCRIPT = 24                   # scripted answers whose commonest bigrams the target follows
# the published checkpoint's class name, which SGLang serves (sglang 0.5.14 srt/configs/model_config.py matches it
# in `architectures`; srt/models/kimi_k25.py); transformers saves its own Kimi_K25ForConditionalGeneration
PUBLISHED_ARCHITECTURE = "KimiK25ForConditionalGeneration"
EMBED, HEAD = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"   # published key names


def tokenizer():
    tok = stand_in("kimi_k25")
    tok.add_special_tokens({"eos_token": "[EOS]"})
    return tok


def successors(tok, texts: list[str]) -> dict[int, int]:
    """{token id: the token that most often follows it} over `texts` tokenized alone (ties: the lower id), the end
    tokens never a successor (so a greedy chain runs to max_new_tokens), and the generation prompt's last token
    `<think>` followed by an answer's first."""
    from collections import Counter
    stops = {tok.convert_tokens_to_ids(t) for t in ("[EOS]", "<|im_end|>")}
    think = tok.convert_tokens_to_ids("<think>")
    pairs: dict[int, Counter] = {}
    for text in texts:
        ids = [think] + tok(text, add_special_tokens=False)["input_ids"]
        for a, b in zip(ids, ids[1:]):
            if b not in stops:
                pairs.setdefault(a, Counter())[b] += 1
    return {a: min(c, key=lambda b: (-c[b], b)) for a, c in pairs.items()}


def build_target(out: Path, embed_std: float = 16.0, share: float = 0.98) -> Path:
    """The tiny INT4 Kimi-K2.5 target with its tokenizer at `out`; returns `out`.

    Its next token after x is s(x): the token that most often follows x in the stand-in's scripted answers
    (`successors` of `answers(SCRIPT)`), x itself for a token the script never continues. Built so: lm_head row y
    is 16 c_y, c [V, H] standard normal, and the embedding of x is 16 (0.98 c_{s(x)} + 0.2 r_x), r standard
    normal (|e| ~ 128, against layer outputs of a few units: every layer reads its input through an RMS norm, so
    the final state stays near the current token's embedding, whose largest product with a row is s(x)'s). So, as
    a real target's, its teacher agrees with the scripted data the draft trains on wherever the script's bigram
    is the commonest, its features carry its prediction, and its greedy answers are chains of the script's
    commonest bigrams, tokens the draft trained on: what the learning check (trained replay tau above untrained)
    needs (measured: its greedy answers run 'Thinking about request 1 word 1 word ...'). (A lm_head row summing the
    embeddings of every token with that successor drowns in their noise at hidden size 64; a copying target, the
    lm_head the embedding, answers `<think>` repeated, a transition the scripted data holds once a sample, and its
    teacher never agrees with that data.) Every layer still computes (MLA, routed INT4 experts): the features
    differ layer by layer. config.json names the published class (PUBLISHED_ARCHITECTURE)."""
    tok = tokenizer()
    eos, im_end = tok.convert_tokens_to_ids("[EOS]"), tok.convert_tokens_to_ids("<|im_end|>")
    build_int4("kimi_k25", out, layers=LAYERS, vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS,
               eos_token_id=eos, bos_token_id=None)
    state = load_file(out / "model.safetensors")
    V, H = state[EMBED].shape
    g = torch.Generator().manual_seed(1)
    c, r = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    s = torch.arange(V)
    succ = successors(tok, answers(SCRIPT))
    s[list(succ)] = torch.tensor(list(succ.values()))
    state[EMBED] = (embed_std * (share * c[s] + (1 - share ** 2) ** 0.5 * r)).to(torch.bfloat16)
    state[HEAD] = (embed_std * c).to(torch.bfloat16)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_end]}))
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [PUBLISHED_ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _hermes_variant(tmp: Path, name: str, tag: str) -> str:
    """The hermes-function-calling fixture row (func-calling.json's fields) with its texts tagged, standing for
    another file of the same repository (func-calling-singleturn.json, glaive-function-calling-5k.json)."""
    rows = json.loads((FIX / "prompt_formats" / "hermes_function_calling.json").read_text())
    for r in rows:
        r["id"] = f"{r['id']}-{tag}"
        for turn in r["conversations"]:
            if turn["from"] == "human":
                turn["value"] = f"({tag}) {turn['value']}"
    path = tmp / name
    path.write_text(json.dumps(rows))
    return str(path)


def local_sources(tmp: Path) -> dict[str, dict]:
    """{source label of the reference mix: the fields that point it at its local fixture file} (hub name, revision,
    data file, split and config: locations; count and max_rows: sizes). Each file holds rows in the fields of the
    hub data set it stands for (tests/fixtures/prompt_formats/README.md)."""
    pf, kept = FIX / "prompt_formats", FIX / "kept_sources"

    def src(path, count, hf="json"):
        return {"hf": hf, "revision": None, "data_files": str(path), "count": count, "max_rows": None}
    return {
        "swe-agent-trajectories": src(pf / "swe_agent_trajectories.parquet", 1, "parquet"),
        "deepswe-kimi-k2": src(kept / "deepswe_kimi_k2.jsonl", 3),
        "kimi-k2.5-2000x": src(kept / "kimi_k25_2000x.jsonl", 3),
        "hermes-function-calling": src(pf / "hermes_function_calling.json", 1),
        "hermes-function-calling-singleturn": src(_hermes_variant(tmp, "singleturn.json", "singleturn"), 1),
        "hermes-glaive-function-calling": src(_hermes_variant(tmp, "glaive.json", "glaive"), 1),
        "mixture-of-thoughts": {**src(pf / "mixture_of_thoughts.jsonl", 1), "config": None},
        "openthoughts-114k": src(pf / "openthoughts_114k.jsonl", 1),
        "ultrachat-200k": {**src(pf / "ultrachat_200k.jsonl", 1), "split": "train"},
        "sharegpt-vicuna": src(pf / "sharegpt_vicuna.json", 2),
    }


TOOL_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
             '{{}}<|tool_call_end|><|tool_calls_section_end|>')
DECLARED_NAME = re.compile(r'"name":\s*"([A-Za-z_][\w.-]*)"')


def answers(n: int, long_words: int = 200) -> list[str]:
    """What the target writes after its generation prompt (which opens `<think>`), for the i-th request: in turn a
    reasoning answer ending `<|im_end|>`, a tool call ending `<|im_end|>`, a reasoning answer ending `[EOS]`, and
    every sixth one an answer with no end that the server cuts at max_new_tokens."""
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 5:
            out.append(f"Step {i}: " + " ".join(f"word{k}" for k in range(long_words)))
        elif kind == 1:
            out.append(f"I should call a tool ({i}).</think>{TOOL_CALL}<|im_end|>")
        elif kind == 2:
            out.append(f"Two plus {i} is {i + 2}.</think>It is {i + 2}.[EOS]")
        else:
            out.append(f"Thinking about request {i}.</think>The answer to request {i} is {i * 7 % 13}.<|im_end|>")
    return out


class KimiStandIn(SGLangTokenStandIn):
    """The token-API stand-in answering the scripted `answers` in order, except that a request whose prompt declares
    a function (Kimi's template renders a row's tools as JSON in the prompt) is answered with a call of the first one
    it declares, and a scripted tool call sent to a prompt that declares none becomes a reasoning answer.
    `tool_calls` counts the tool calls answered."""

    def __init__(self, tok, script: list[str], eot: int, stops: tuple[int, ...]):
        super().__init__(tok, script, eot, stops)
        self.tool_calls, self.target = 0, None

    def answer_greedily(self, target_dir: Path) -> None:
        """From now on answer as SGLang serving the target would: its own greedy output (the tiny target loaded
        by transformers, experts dequantized), stopping on either end token (kept) or cut at max_new_tokens."""
        from eagle3_core.config import TargetConfig
        from eagle3_core.target.loading import load_target
        self.target = load_target(TargetConfig(model=str(target_dir)), "cpu").eval()

    def _greedy(self, body: dict) -> tuple[int, dict]:
        import torch
        ids, limit = [int(t) for t in body["input_ids"]], body["sampling_params"]["max_new_tokens"]
        assert body["sampling_params"].get("temperature", 0.0) == 0.0
        with torch.no_grad():
            out = self.target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=limit,
                                       eos_token_id=sorted(self.stops), pad_token_id=self.eot)[0, len(ids):].tolist()
        end = next((k for k, t in enumerate(out) if t in self.stops), None)
        out = out if end is None else out[:end + 1]
        self.received.append(ids)
        self.returned.append(out)
        finish = {"type": "stop", "matched": out[-1]} if end is not None else {"type": "length", "length": limit}
        return 200, {"text": self.tokenizer.decode(out, skip_special_tokens=True), "output_ids": out,
                     "meta_info": {"id": f"r{len(self.received)}", "finish_reason": finish,
                                   "prompt_tokens": len(ids), "completion_tokens": len(out)}}

    def _generate(self, path: str, body: dict) -> tuple[int, dict]:
        if self.target is not None:
            return self._greedy(body)
        i = len(self.received)
        if i < len(self.answers):
            found = DECLARED_NAME.search(self.tokenizer.decode(body["input_ids"]))
            if found:
                self.tool_calls += 1
                call = TOOL_CALL.format(name=found.group(1))
                self.answers[i] = f"I should call {found.group(1)} ({i}).</think>{call}<|im_end|>"
            elif "{name}" in self.answers[i]:
                self.answers[i] = f"No tool is declared ({i}).</think>Answer {i}.<|im_end|>"
        return super()._generate(path, body)


class DeployStandIn(SGLangTokenStandIn):
    """A stand-in for one SGLang server of the deployment benchmark, over HTTP on 127.0.0.1: `/server_info` and
    `/generate` in sglang 0.5.14's shapes (tests/test_sglang_bench.py's docstring names the files), every answer
    `n_new` tokens (cut at max_new_tokens); with `algorithm` 'EAGLE3', `verify_ct` verify steps an answer and the
    speculative fields SGLang adds (its `_calculate_spec_decoding_metrics`)."""

    def __init__(self, n_new: int, algorithm: str | None = None, verify_ct: int | None = None, steps: int = 5,
                 topk: int = 1, draft_tokens: int = 6):
        super().__init__(None, [], 0)
        from test_sglang_bench import SGLangStandIn
        self.n_new, self.verify_ct, self.T = n_new, verify_ct, draft_tokens
        self.info = SGLangStandIn({}, algorithm, T=draft_tokens).info
        self.info.update({"speculative_num_steps": steps if algorithm else None,
                          "speculative_eagle_topk": topk if algorithm else None})
        self.bodies = []

    def _respond(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        return (200, self.info) if path == "/server_info" else super()._respond(method, path, body)

    def _generate(self, path: str, body: dict) -> tuple[int, dict]:
        from test_sglang_bench import GENERATE_REQ_FIELDS, sglang_response
        assert set(body) <= GENERATE_REQ_FIELDS, set(body) - GENERATE_REQ_FIELDS
        self.bodies.append(body)
        limit = body["sampling_params"]["max_new_tokens"]
        n = min(self.n_new, limit)
        finish = {"type": "length", "length": n} if n == limit else {"type": "stop", "matched": 2}
        spec = (min(self.verify_ct, n), max(n - self.verify_ct, 0), self.T) if self.verify_ct else None
        return 200, sglang_response(f"r{len(self.bodies)}", n, len(body["input_ids"]), finish, spec)
