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
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
                headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                entry = {"path": path, "body": json.loads(body)} if method == "POST" else None
                if entry is not None:
                    self.posts.append(entry)                      # arrival order, before the answer
                try:
                    resp = await self._client.request(method, f"{self.upstream}{path}", content=body,
                                                      headers={"content-type": headers.get("content-type", "")})
                except httpx.HTTPError:                           # the client hung up (e.g. a cancelled request)
                    return
                if entry is not None:
                    entry["answer"] = resp.json()
                data = resp.content
                writer.write((f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}\r\nContent-Type: "
                              f"{resp.headers.get('content-type', 'application/json')}\r\nContent-Length: "
                              f"{len(data)}\r\n\r\n").encode() + data)
                await writer.drain()
        finally:
            writer.close()
