"""What a turn did, for its log lines: byte counts, and a process's private memory. Each line carries the same
figures as a record (``LogRecord.turn``: :meth:`TurnRecord.fields`), for whatever reads them without parsing text."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from serialized_restore._files import format_bytes


@dataclass
class TurnRecord:
    """What one rank's turn did; its body fills in the bytes read (or mapped) and copied, and the ``reader``."""

    stage: str
    waited: float = 0.0
    duration: float = 0.0
    bytes_read: int = 0
    bytes_copied: int = 0
    reader: str = ""
    at_once: bool = False  # with the node's other ranks at once, not in turns

    def fields(self, rank: int, event: str) -> dict[str, Any]:
        """The record of a log line: this record's fields, the global ``rank`` and the ``event`` (``"started"`` or
        ``"ended"``)."""
        return {**asdict(self), "rank": rank, "event": event}


def turn_end_line(rank: int, record: TurnRecord, memory_before: int) -> str:
    """``[rank 1] ... ended in 0.31s, read 1.4 GiB memory-mapped, copied 16.1 MiB out of the mapped file; ...``."""
    how = {"mmap": " memory-mapped", "eager": " eagerly"}.get(record.reader, "")
    done = [f"read {format_bytes(record.bytes_read)}{how}"] if record.bytes_read or record.reader else []
    done += [f"copied {format_bytes(record.bytes_copied)} out of the mapped file"] if record.bytes_copied else []
    memory = private_memory()
    together = " with the node's other ranks at once" if record.at_once else ""
    return (
        f"[rank {rank}] serialized restore: turn for {record.stage!r} ended in {record.duration:.2f}s{together},"
        f" {', '.join(done) or 'read nothing'}; the process holds {format_bytes(memory)} of private memory,"
        f" {format_bytes(memory - memory_before)} more than before its turn"
    )


def private_memory() -> int:
    """This process's private resident memory (``RssAnon``: mapped file pages left out), or 0 without ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
