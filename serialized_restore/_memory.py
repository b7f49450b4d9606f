"""Memory figures for the turns' log lines: byte counts, and a process's private memory."""

from __future__ import annotations


def format_bytes(count: int) -> str:
    """``1.4 GiB``, ``35.2 KiB``, ``12 B``: a unit that fits, at every checkpoint size."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def private_memory() -> int:
    """This process's private resident memory in bytes: ``RssAnon`` (mapped file pages left out), or 0 where
    ``/proc`` cannot be read (the package supports Linux only)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
