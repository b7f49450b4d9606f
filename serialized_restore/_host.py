"""The memory available to a job on this host: the cgroup limit of this process's cgroup where one is set (v2
``memory.max``, the smallest over its ancestors; v1 ``memory.limit_in_bytes``), else the host's ``MemAvailable``
(``/proc/meminfo``). The forecast says whether a resume fits in it; the prefetch reads a file ahead only where it
fits."""

from __future__ import annotations

import os
from dataclasses import dataclass

from serialized_restore._files import format_bytes


@dataclass(frozen=True)
class Available:
    """The memory available to the job, and where the figure comes from."""

    bytes: int | None
    source: str


_UNLIMITED = 2**60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < _UNLIMITED else None


def memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Available:
    """The cgroup memory limit of this process (v2 ``memory.max``, the smallest over its ancestors; v1
    ``memory.limit_in_bytes``), else the host's ``MemAvailable``."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        group = group.strip("/")
        if hierarchy == "0" and controllers == "":
            parts = group.split("/") if group else []
            limits = []
            for depth in range(len(parts), -1, -1):
                where = os.path.join(cgroup_root, *parts[:depth], "memory.max")
                value = _read_int(where)
                if value is not None:
                    limits.append((value, where))
            if limits:
                value, where = min(limits)
                return Available(value, f"cgroup v2 memory.max ({where})")
        elif "memory" in controllers.split(","):
            for where in (
                os.path.join(cgroup_root, "memory", group, "memory.limit_in_bytes"),
                os.path.join(cgroup_root, "memory", "memory.limit_in_bytes"),
            ):
                value = _read_int(where)
                if value is not None:
                    return Available(value, f"cgroup v1 memory.limit_in_bytes ({where})")
    info: dict[str, int] = {}
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                name, _, figure = line.partition(":")
                if figure.strip().endswith("kB"):
                    info[name] = int(figure.split()[0]) * 1024
    except OSError:
        return Available(None, "unknown: no cgroup memory limit and no /proc/meminfo")
    if "MemAvailable" not in info:
        return Available(None, "unknown: no cgroup memory limit and no MemAvailable in /proc/meminfo")
    total = f" of MemTotal {format_bytes(info['MemTotal'])}" if "MemTotal" in info else ""
    return Available(info["MemAvailable"], f"the host's MemAvailable{total} (no cgroup memory limit is set)")
