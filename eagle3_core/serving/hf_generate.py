"""In-process batched generation with transformers: regeneration for small targets without a server.

`server.kind: "transformers"`: the generation stage loads the target in its own process (fp32, CUDA when available)
and answers prompts in batches of up to `generation.concurrency` rows with `model.generate` (left padding, greedy
or sampled). Meant for targets that fit one GPU (the embedded default and the scaling study's thousands of prompts
on the GPU machine); a served model (SGLang, llama.cpp) stays the path for large targets. Answers carry the same
fields as the HTTP clients' (`client.parse_response`), so shards, resume and the quality gate are unchanged.

Batching changes nothing but numerics: a row's greedy answer equals its unbatched greedy decoding except where two
logits are within float rounding of each other (checked in tests/test_hf_generate.py on the embedded target).
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

LINGER_S = 0.05       # wait this long for more requests before running a batch that is not full


class BatchedGenerator:
    """Collects `complete()` calls of concurrent asyncio tasks into batches and runs them through `model.generate` in
    one worker thread (the event loop keeps flushing and reporting meanwhile).

    model: a HF causal LM in eval mode; tokenizer: its tokenizer (decoding, pad id); max_batch: rows per batch;
    max_new_tokens, temperature: as GenerationConfig (temperature 0 = greedy). stop_ids: every id the target stops on
    (data.markers.stop_ids: the generation config's EOS list, the tokenizer's EOS and the chat template's end of
    turn; given by the caller, which knows the template: serving sits below data in the layer order)."""

    def __init__(self, model, tokenizer, max_batch: int, max_new_tokens: int, temperature: float = 0.0,
                 name: str = "transformers", *, stop_ids):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.max_new_tokens, self.temperature, self.name = max_new_tokens, temperature, name
        self.eos = set(stop_ids)
        if not self.eos:
            raise ValueError("the target has no eos_token_id (generation config or tokenizer): answers could not stop")
        pad = tokenizer.pad_token_id
        self.pad = int(pad if pad is not None else min(self.eos))
        self.batches = 0
        self._pending: list[tuple[list[int], asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hf-generate")

    async def complete(self, prompt_ids: list[int]) -> dict:
        """Answer one prompt (token ids, chat template applied). Returns {response, reasoning '', finish_reason
        'stop' | 'length', prompt_tokens, completion_tokens (EOS included), output_ids (EOS excluded), model,
        timings (JSON: batch rows and seconds), stop_id (the stop id it ended on, None when cut)}. Raises what
        `model.generate` raised (e.g. CUDA out of memory)."""
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition the answer on")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), fut))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            if len(self._pending) < self.max_batch:
                await asyncio.sleep(LINGER_S)
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            try:
                answers = await loop.run_in_executor(self._thread, self.generate_batch, [p for p, _ in batch])
            except Exception as e:  # noqa: BLE001 -- every request of the batch fails with the cause
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, f), a in zip(batch, answers, strict=True):
                if not f.done():
                    f.set_result(a)

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]]) -> list[dict]:
        """One `generate` call over `prompts` (left-padded to the longest). Returns one answer dict per prompt."""
        t0 = time.perf_counter()
        dev = self.model.device
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        sampling = ({"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else
                    {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                  max_new_tokens=self.max_new_tokens, pad_token_id=self.pad,
                                  eos_token_id=sorted(self.eos), **sampling)[:, L:].tolist()
        seconds = time.perf_counter() - t0
        self.batches += 1
        answers = []
        for p, gen in zip(prompts, out, strict=True):
            stop = next((j for j, t in enumerate(gen) if t in self.eos), None)
            toks = gen if stop is None else gen[:stop]
            answers.append({
                "response": self.tokenizer.decode(toks, skip_special_tokens=True), "reasoning": "",
                "finish_reason": "length" if stop is None else "stop", "prompt_tokens": len(p),
                "completion_tokens": len(toks) + (stop is not None), "output_ids": toks,
                "model": str(getattr(self.model.config, "_name_or_path", "") or ""),
                "timings": json.dumps({"batch_rows": len(prompts), "batch_s": seconds}),
                "stop_id": None if stop is None else int(gen[stop])})
        return answers

    def close(self) -> None:
        self._thread.shutdown(wait=True)
