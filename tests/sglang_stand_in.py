"""A STAND-IN for SGLang's token API (no SGLang server can run here: it needs CUDA): an HTTP server on 127.0.0.1
answering `POST /generate` with token ids in and token ids out, and `GET /health`, in the shapes of sglang 0.5.14
(read, not run: `srt/managers/io_struct.py::GenerateReqInput` for the request's `input_ids`, `sampling_params`,
`stream`; `srt/managers/tokenizer_manager.py::_handle_batch_output` for the response `{"text", "output_ids",
"meta_info": {id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, ...}}`; `srt/managers/
schedule_batch.py` for the finish reasons `{"type": "stop", "matched": id}` and `{"type": "length", "length": n}`).

What the "target" writes is scripted: the i-th request is answered with `answers[i]`, the raw text the target
writes after its generation prompt (markers and end-of-turn token included), tokenized with the stand-in tokenizer;
the answer ends at its first stop id (`stops`: every id the target stops on, default the end of turn `eot`; the
finish reason then says which: `matched`, the stop token kept in `output_ids` as SGLang keeps it) or is cut at
`max_new_tokens`. Every request's input ids and the ids returned are recorded in order."""
from __future__ import annotations

import asyncio
import json

from fault_proxy import LoopbackProxy

GENERATE_REQ_FIELDS = {"text", "input_ids", "input_embeds", "image_data", "sampling_params", "rid", "return_logprob",
                       "logprob_start_len", "top_logprobs_num", "stream", "lora_path", "return_hidden_states"}


class SGLangTokenStandIn(LoopbackProxy):
    def __init__(self, tokenizer, answers: list[str], eot: int, stops: tuple[int, ...] = ()):
        self.tokenizer, self.answers, self.eot, self.stops = tokenizer, list(answers), eot, set(stops) or {eot}
        self.received: list[list[int]] = []
        self.returned: list[list[int]] = []
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await self.read_request(reader)) is not None:
                status, payload = self._respond(*request[:2], request[3])
                data = json.dumps(payload).encode()
                writer.write(f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: "
                             f"{len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        finally:
            writer.close()

    def _respond(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON payload) of one request: {} for a GET, else the scripted answer (`_generate`)."""
        return (200, {}) if method == "GET" else self._generate(path, json.loads(body))

    def _generate(self, path: str, body: dict) -> tuple[int, dict]:
        assert path == "/generate" and set(body) <= GENERATE_REQ_FIELDS, (path, set(body) - GENERATE_REQ_FIELDS)
        ids = [int(t) for t in body["input_ids"]]
        if len(self.received) >= len(self.answers):
            return 400, {"error": f"the script has {len(self.answers)} answers, request {len(self.received) + 1}"}
        out = self.tokenizer(self.answers[len(self.received)], add_special_tokens=False)["input_ids"]
        limit = body["sampling_params"]["max_new_tokens"]
        end = next((k for k, t in enumerate(out) if t in self.stops), None)
        out = out if end is None else out[:end + 1]
        finish = {"type": "stop", "matched": out[-1] if end is not None else self.eot} if len(out) <= limit else \
            {"type": "length", "length": limit}
        out = out[:limit]
        self.received.append(ids)
        self.returned.append(out)
        meta = {"id": f"r{len(self.received)}", "finish_reason": finish, "prompt_tokens": len(ids),
                "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                "completion_tokens": len(out), "cached_tokens": 0, "e2e_latency": 0.01}
        return 200, {"text": self.tokenizer.decode(out, skip_special_tokens=True), "output_ids": out,
                     "meta_info": meta}
