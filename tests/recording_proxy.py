"""A thin recording proxy, for tests that must read what a real llama-server received: every request is forwarded
unchanged to the real server and answered with the server's own response. Each POST's path, JSON body and JSON
answer are appended to `posts` in the order the requests arrived. Nothing is changed or injected; HoldingProxy
only delays chosen requests until the test releases them."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
from fault_proxy import LoopbackProxy


class RecordingProxy(LoopbackProxy):
    def __init__(self, upstream: str):
        self.upstream, self.url = upstream, ""
        self.posts: list[dict] = []

    def bodies(self, path: str) -> list[dict]:
        """The JSON bodies POSTed to `path`, in arrival order."""
        return [p["body"] for p in self.posts if p["path"] == path]

    async def posted(self, entry: dict) -> None:
        """Called with each POST's entry once it is recorded, before it is forwarded (HoldingProxy holds here)."""

    def answered(self, method: str, path: str, resp: httpx.Response) -> None:
        """Called with each upstream answer before the client gets it (HoldingProxy watches GET /health here)."""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await self.read_request(reader)) is not None:
                method, path, _, body = request
                entry = {"path": path, "body": json.loads(body)} if method == "POST" else None
                if entry is not None:
                    self.posts.append(entry)                      # arrival order, before the answer
                    await self.posted(entry)
                try:
                    resp, head = await self.forward(*request)
                except httpx.HTTPError:                           # upstream gone, or the client hung up
                    return
                self.answered(method, path, resp)
                if entry is not None:
                    entry["answer"] = resp.json()
                writer.write(head + resp.content)
                await writer.drain()
        finally:
            writer.close()


class HoldingProxy(RecordingProxy):
    """A RecordingProxy that holds back chosen POSTs, for tests that must act while a request is in flight or
    before some prompts are answered, on an event rather than after a sleep. `hold(n, body)` (n: the POST's
    1-based arrival number) says whether to hold it; a held POST is recorded, sets `held` (a threading.Event),
    and is forwarded only after `release()` (or when the proxy closes). A forward that fails (the upstream server
    is gone) closes the client's connection, as a dead server would. `health_ok` is set when a GET /health was
    answered below 500 (a pool's probe found the server up)."""

    def __init__(self, upstream: str, hold=lambda n, body: False):
        super().__init__(upstream)
        self.hold = hold
        self.held, self.health_ok = threading.Event(), threading.Event()
        self._release: asyncio.Event | None = None

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._released().set)

    def _released(self) -> asyncio.Event:
        if self._release is None:
            self._release = asyncio.Event()
        return self._release

    def __exit__(self, *exc) -> None:
        self.release()
        super().__exit__(*exc)

    async def posted(self, entry: dict) -> None:
        if self.hold(len(self.posts), entry["body"]):
            self.held.set()
            await self._released().wait()

    def answered(self, method: str, path: str, resp: httpx.Response) -> None:
        if method == "GET" and path == "/health" and resp.status_code < 500:
            self.health_ok.set()
