"""What a distfn launch may leave behind, seen from the launching process (used by rel_job.py and the bench).

``leftovers(pid)`` lists: live processes of this session (or children of ``pid`` when it leads no session),
sockets of ``pid`` still listening, new /dev/shm segments that no live process uses, and new temp entries of
multiprocessing/torch/distfn. "New" means not there when this module was imported.

While the launching process lives, Python's own multiprocessing helpers are not counted: the resource tracker
(spawn, forkserver), the fork server and its ``pymp-*`` socket directory (forkserver). They serve every launch
of the process and exit with it; ``processes(sid, session=True)`` after the process ended counts everything.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any

_SHM = "/dev/shm"
# torchinductor_<user> is torch's compile cache, kept across runs on purpose (a fresh interpreter may make it)
_TEMP_NAMES = re.compile(r"^(?!torchinductor_)(torch|distfn|tmp.*distfn)")
_MP_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_DISTFN_SERVER = "distfn-forksrv"  # distfn's fork server: a copy of the launching process, named so (its comm)


def _listdir(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


_BEFORE_SHM = _listdir(_SHM)
_BEFORE_TMP = _listdir(tempfile.gettempdir())


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    fields = _stat_fields(str(pid))
    return fields is not None and fields[0] != "Z"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def processes(pid: int, *, session: bool | None = None) -> list[str]:
    """Live processes of the job started by ``pid``: its session when it leads one (``session=True`` for a
    session whose leader has exited already), else its children."""
    if session is None:
        session = os.getsid(pid) == pid
    launcher_alive = alive(pid)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == pid:
            continue
        fields = _stat_fields(entry)
        if fields is None or fields[0] == "Z":
            continue
        if int(fields[3] if session else fields[1]) == pid:
            cmd = _cmdline(entry)
            if launcher_alive and (any(h in cmd for h in _MP_HELPERS) or _comm(entry) == _DISTFN_SERVER):
                continue  # Python's own helpers: they live as long as the launching process (see above)
            found.append(f"process {entry} ({cmd})")
    return found


def outliving(pid: int, *, within: float = 10.0) -> list[str]:
    """``processes(pid, session=True)`` once they are gone, or as they are after ``within`` seconds.

    For the check after the launching process ended: its helpers (the resource tracker, the fork server) and the
    ranks see it end only then (a pipe's end of file) and may still be exiting: a process past its last line whose
    memory is released already (an empty command line) but not yet a zombie. A process that has not gone after
    ``within`` seconds outlived the job.
    """
    deadline = time.monotonic() + within
    while True:
        found = processes(pid, session=True)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def listening(pid: int) -> list[str]:
    """``addr:port`` of TCP sockets that ``pid`` holds in LISTEN state."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    return [f"listening {addr}" for addr, inode in listen_table() if inode in inodes]


def listen_table() -> list[tuple[str, str]]:
    """``(local address, socket inode)`` of every listening TCP socket of this machine."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A":  # LISTEN
                continue
            addr_hex, port_hex = parts[1].split(":")
            rows.append((f"{decode_addr(addr_hex)}:{int(port_hex, 16)}", parts[9]))
    return rows


def decode_addr(addr_hex: str) -> str:
    """The /proc/net/tcp{,6} hex address as text (little-endian 32-bit words)."""
    raw = bytes.fromhex(addr_hex)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    import ipaddress

    return str(ipaddress.IPv6Address(words))


def _shm_in_use() -> set[str]:
    """Names of /dev/shm entries that a live process maps or holds open (other programs' live segments)."""
    used = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                used.update(line.split(_SHM + "/", 1)[1].split()[0] for line in f if _SHM + "/" in line)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith(_SHM + "/"):
                    used.add(link[len(_SHM) + 1:].split()[0])
        except OSError:
            continue
    return used


def shm_snapshot() -> set[str]:
    """The names in /dev/shm now (pass to :func:`shm_segments` as ``before``)."""
    return _listdir(_SHM)


def shm_segments(before: set[str] | None = None, *, forked: bool = False) -> list[str]:
    """New /dev/shm entries (since ``before``, default: this module's import) that no live process uses (a
    leak; a segment in use belongs to someone alive, e.g. another program creating its semaphores now).

    ``forked``: the job used the fork start method, whose multiprocessing semaphores are unlinked the moment
    they are made, so a ``sem.mp-*`` entry is another program's (a shared machine), not the job's.
    """
    new = _listdir(_SHM) - (_BEFORE_SHM if before is None else before)
    if forked:
        new = {n for n in new if not n.startswith("sem.mp-")}
    if not new:
        return []
    new -= _shm_in_use()
    new = {n for n in new if os.path.exists(os.path.join(_SHM, n))}  # transient ones are gone by now
    return [f"shm {name}" for name in sorted(new)]


def temp_files() -> list[str]:
    """New entries of the temp directory that multiprocessing, torch or distfn make."""
    return [f"temp {name}" for name in sorted(_listdir(tempfile.gettempdir()) - _BEFORE_TMP)
            if _TEMP_NAMES.match(name)]


def leftovers(pid: int, *, forked: bool = False) -> list[str]:
    """Everything above (``forked``: see :func:`shm_segments`)."""
    return processes(pid) + listening(pid) + shm_segments(forked=forked) + temp_files()


#: The soak's resources counted exactly: one more of any after the warm-up is a leak (tests/test_reliability_soak.py
#: and bench/bench_soak.py read the samples of tests/scripts/soak_job.py with the same rule).
EXACT = ("fds", "threads", "os_threads", "listening", "shm", "tmp", "children")


def growth(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Each resource's lasting growth from the warm-up (the first restart: every module imported, Python's
    multiprocessing helpers started): the least of the last 5 samples minus the warm-up's. A leak shows in every
    later sample; a passing blip (a thread still ending at the OS level after Python let it go, another program's
    fresh /dev/shm file on a shared machine) in one only."""
    first = next(i for i, s in enumerate(samples) if s["kind"] == "restart")
    base, rest = samples[first], samples[first + 1:][-5:]
    return {k: min([s[k] for s in rest] or [base[k]]) - base[k] for k in (*EXACT, "rss_mib")}
