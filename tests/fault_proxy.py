"""A FAKE, for fault injection only: an HTTP proxy in front of the real llama-server that makes every `every`-th
generation request (POST) fail in one of the ways a real server cannot be made to fail on demand: answer 503, stall
until the client gives up, close the connection before answering, or close it halfway through the body. Every
other request (and every GET, e.g. /health) is forwarded to the real server unchanged."""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import httpx

KINDS = ("503", "stall", "drop", "drop_mid")


class LoopbackProxy:
    """A proxy on 127.0.0.1 (a free port) in front of `upstream`, run by an asyncio loop in a thread for the
    duration of a `with` block; subclasses define `_handle(reader, writer)`."""

    url = ""

    def __enter__(self) -> LoopbackProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def start():
            self._client = httpx.AsyncClient(timeout=None)
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self._loop)
        assert ready.wait(10), f"{type(self).__name__} did not start"
        return self

    def __exit__(self, *exc) -> None:
        async def shutdown():
            self._server.close()
            await self._client.aclose()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @staticmethod
    async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict, bytes] | None:
        """The next HTTP/1.1 request on the connection: (method, path, lower-cased headers, body); None when the
        client hung up."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        return method, path, headers, await reader.readexactly(int(headers.get("content-length", 0)))

    async def forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[httpx.Response, bytes]:
        """The request sent on to the upstream server: its response and the HTTP/1.1 status line and headers to
        write back before `response.content`."""
        resp = await self._client.request(method, f"{self.upstream}{path}", content=body,
                                          headers={"content-type": headers.get("content-type", "")})
        return resp, (f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}\r\nContent-Type: "
                      f"{resp.headers.get('content-type', 'application/json')}\r\nContent-Length: "
                      f"{len(resp.content)}\r\n\r\n").encode()


class FaultProxy(LoopbackProxy):
    def __init__(self, upstream: str, every: int = 5, kinds: tuple[str, ...] = KINDS):
        self.upstream, self.every, self.kinds = upstream, every, kinds
        self.posts = 0
        self.injected: Counter = Counter()
        self.url = ""

    def _fault(self, method: str) -> str | None:
        if method != "POST":
            return None
        self.posts += 1
        if self.posts % self.every != 1:
            return None
        kind = self.kinds[sum(self.injected.values()) % len(self.kinds)]
        self.injected[kind] += 1
        return kind

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await self.read_request(reader)) is not None:
                method = request[0]
                fault = self._fault(method)
                if fault == "503":
                    msg = b'{"error": {"message": "injected 503"}}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(msg), msg))
                    await writer.drain()
                    continue
                if fault == "stall":                           # until the client times out and hangs up
                    await asyncio.wait_for(reader.read(), timeout=600)
                    return
                if fault == "drop":
                    return
                resp, head = await self.forward(*request)
                data = resp.content
                if fault == "drop_mid":
                    writer.write(head + data[:len(data) // 2])
                    await writer.drain()
                    return
                writer.write(head + data)
                await writer.drain()
        finally:
            writer.close()
