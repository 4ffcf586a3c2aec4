"""A thin recording proxy, for tests that must read what a real llama-server received: every request is forwarded
unchanged to the real server and answered with the server's own response. Each POST's path, JSON body and JSON
answer are appended to `posts` in the order the requests arrived. Nothing is changed or injected."""
from __future__ import annotations

import asyncio
import json

import httpx
from fault_proxy import LoopbackProxy


class RecordingProxy(LoopbackProxy):
    def __init__(self, upstream: str):
        self.upstream, self.url = upstream, ""
        self.posts: list[dict] = []

    def bodies(self, path: str) -> list[dict]:
        """The JSON bodies POSTed to `path`, in arrival order."""
        return [p["body"] for p in self.posts if p["path"] == path]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await self.read_request(reader)) is not None:
                method, path, _, body = request
                entry = {"path": path, "body": json.loads(body)} if method == "POST" else None
                if entry is not None:
                    self.posts.append(entry)                      # arrival order, before the answer
                try:
                    resp, head = await self.forward(*request)
                except httpx.HTTPError:                           # the client hung up (e.g. a cancelled request)
                    return
                if entry is not None:
                    entry["answer"] = resp.json()
                writer.write(head + resp.content)
                await writer.drain()
        finally:
            writer.close()
