"""Several inference servers behind one client: spread the load, skip a server that stopped answering, take it
back when its /health answers again.

Each request goes to the reachable server with the fewest requests in flight (ties: the one used longest ago). A
server whose connection failed is marked down and probed (GET /health, any status below 500 counts as up: SGLang
and llama.cpp answer 503 while loading) every `probe_interval_s`. Requests wait while every server is down; after
`down_timeout_s` without any server they raise ServerError, so the stage fails and a rerun resumes.

A server this process started (launcher.launch) is watched: once it has exited, `check_exited` (called by the
regeneration loop every 0.2 s, by `_acquire` and on entering) raises launcher.ServerExited at once, naming the exit
code or signal and its log, instead of waiting `down_timeout_s` for it to come back. Error messages give advice
that fits the server: its log for one the stage started, `server.url` / `server.urls` for an external one.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from eagle3_core.serving.launcher import ServerError, exit_error, started_here


@dataclass
class ServerState:
    url: str
    up: bool = True
    in_flight: int = 0
    last_used: float = 0.0
    answered: int = 0
    errors: int = 0
    down_since: float | None = None
    last_error: str = ""
    probe: asyncio.Task | None = field(default=None, repr=False)


class ServerPool:
    """Use as `async with ServerPool(urls) as pool:`; entering probes every server and raises ServerError naming the
    URLs if none answers."""

    def __init__(self, urls: list[str], probe_interval_s: float = 5.0, down_timeout_s: float = 1800.0,
                 health_path: str = "/health"):
        if not urls:
            raise ValueError("no server URL given: set server.url or server.urls, or let the stage start a server")
        self.servers = {u: ServerState(u) for u in urls}
        self.probe_interval_s, self.down_timeout_s, self.health_path = probe_interval_s, down_timeout_s, health_path
        self._since = time.monotonic()          # servers stopped before the pool began are not its servers
        self._changed = asyncio.Event()
        self._probe_client: httpx.AsyncClient | None = None

    def check_exited(self) -> None:
        """Raise launcher.ServerExited if a server this process started has exited, or launcher.ServerStopped if
        this process stopped it on purpose, and no other server of the pool is up to take over (the usual case: the
        stage's one server died, or the stage was cancelled)."""
        dead = [e for u in self.servers if (e := exit_error(u, self._since)) is not None]
        if dead and not any(s.up and exit_error(u, self._since) is None for u, s in self.servers.items()):
            raise dead[0]

    def _advice(self) -> str:
        """What to do about servers that do not answer, by kind: started here (their logs) or external."""
        logs = [str(log) for u in self.servers if (log := started_here(u)) is not None]
        if len(logs) == len(self.servers):
            return (f"the stage started {'this server' if len(logs) == 1 else 'these servers'} and it passed its "
                    f"health check: see {'its log' if len(logs) == 1 else 'their logs'} {', '.join(logs)}")
        return ("start it or set server.url / server.urls to a running server (server.kind 'llama.cpp' or 'sglang' "
                "lets the stage start one)")

    async def __aenter__(self) -> ServerPool:
        self.check_exited()
        self._probe_client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0))
        results = await asyncio.gather(*(self._healthy(u) for u in self.servers))
        for (url, s), (ok, why) in zip(self.servers.items(), results):
            if not ok:
                self.failed(url, why, server_down=True)
        if not any(s.up for s in self.servers.values()):
            await self.__aexit__(None, None, None)
            reasons = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers.values())
            raise ServerError(f"cannot reach any inference server ({reasons}); {self._advice()}")
        return self

    async def __aexit__(self, *exc) -> None:
        for s in self.servers.values():
            if s.probe is not None:
                s.probe.cancel()
        await asyncio.gather(*(s.probe for s in self.servers.values() if s.probe), return_exceptions=True)
        if self._probe_client is not None:
            await self._probe_client.aclose()

    async def _healthy(self, url: str) -> tuple[bool, str]:
        try:
            resp = await self._probe_client.get(f"{url}{self.health_path}")
        except httpx.HTTPError as e:
            return False, f"{type(e).__name__}: {e}"
        return resp.status_code < 500, f"/health answered {resp.status_code}"

    async def _probe_until_up(self, s: ServerState) -> None:
        while True:
            ok, why = await self._healthy(s.url)
            if ok:
                s.up, s.down_since, s.probe = True, None, None
                self._changed.set()
                return
            s.last_error = why
            await asyncio.sleep(self.probe_interval_s)

    def failed(self, url: str, reason: str, server_down: bool) -> None:
        """Record a failed attempt on `url`; `server_down` marks it down and starts probing it."""
        s = self.servers[url]
        s.errors += 1
        s.last_error = reason
        if server_down and s.up:
            s.up, s.down_since = False, time.monotonic()
            s.probe = asyncio.get_running_loop().create_task(self._probe_until_up(s))

    def answered(self, url: str) -> None:
        self.servers[url].answered += 1

    @asynccontextmanager
    async def server(self):
        """Yields the base URL of the reachable server with the fewest requests in flight (waits while none is)."""
        s = await self._acquire()
        s.in_flight += 1
        s.last_used = time.monotonic()
        try:
            yield s.url
        finally:
            s.in_flight -= 1

    async def _acquire(self) -> ServerState:
        while True:
            self.check_exited()
            up = [s for s in self.servers.values() if s.up]
            if up:
                return min(up, key=lambda s: (s.in_flight, s.last_used))
            since = min(s.down_since for s in self.servers.values())
            left = self.down_timeout_s - (time.monotonic() - since)
            if left <= 0:
                reasons = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers.values())
                what = (self._advice() if any(started_here(u) for u in self.servers)
                        else "check the servers (server.url / server.urls)")
                raise ServerError(f"no inference server answered for {self.down_timeout_s:.0f} s ({reasons}); "
                                  f"{what}; then rerun: finished work is kept")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, self.probe_interval_s))
            except asyncio.TimeoutError:
                pass

    def stats(self) -> dict:
        """Per server: answered, errors, in_flight, up, down_s (seconds since it stopped answering, or None)
        (JSON-able)."""
        now = time.monotonic()
        return {s.url: {"answered": s.answered, "errors": s.errors, "in_flight": s.in_flight, "up": s.up,
                        "down_s": None if s.down_since is None else now - s.down_since}
                for s in self.servers.values()}
