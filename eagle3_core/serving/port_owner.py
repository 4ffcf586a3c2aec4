"""Who listens on a TCP port (Linux /proc): a server started on a port that another process took in the meantime
(free_port hands out a port that is free now; two runs starting servers at once may both get it) fails to bind and
exits, while the other process answers its health check. The launcher asks whether the listener is in the server's
own process group before it trusts the answer.

/proc/net/tcp and tcp6 list listening sockets (state 0A) with their local port (hex) and socket inode; a process
holds the socket if one of its /proc/<pid>/fd links reads 'socket:[inode]' (proc(5))."""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on TCP `port` (IPv4 and IPv6); empty where /proc is missing."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _group(pgid: int) -> list[int]:
    """The pids of process group `pgid` (field 5 of /proc/<pid>/stat, after the parenthesised command name)."""
    pids = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def held_by_group(port: int, pgid: int) -> bool | None:
    """Whether a process of group `pgid` holds a socket listening on `port`: True, False (another process listens
    there), or None (unknown: no /proc, or no listener found, e.g. it closed meanwhile)."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    for pid in _group(pgid):
        try:
            fds = os.listdir(PROC / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(PROC / str(pid) / "fd" / fd)[8:-1] in inodes:
                    return True
            except OSError:
                continue
    return False
