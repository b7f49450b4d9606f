"""The node log: what the turns of a node have done so far in a stage. Pure, no store."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeLog:
    """A node's turn events of one stage, as appended to its ``log`` key: ``start <local> <unix time>`` and ``end
    <local> <duration> [<mapped> <read eagerly> <copied> <private memory> <added by the turn>]`` lines (bytes); lines
    that are not ours are ignored."""

    started: dict[int, float] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)
    ends: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)
    events: int = 0

    @staticmethod
    def start_line(local: int, at: float) -> str:
        return f"start {local} {at:.6f}\n"

    @staticmethod
    def end_line(local: int, duration: float, *figures: int) -> str:
        shown = " ".join(str(int(x)) for x in figures) if len(figures) == 5 else ""
        return f"end {local} {duration:.6f} {shown}".rstrip() + "\n"

    @classmethod
    def parse(cls, text: str | None) -> NodeLog:
        log = cls()
        for parts in (line.split() for line in (text or "").splitlines()):
            if not parts or (parts[0], len(parts)) not in (("start", 3), ("end", 3), ("end", 8)):
                continue
            try:
                local, value, extra = int(parts[1]), float(parts[2]), tuple(int(x) for x in parts[3:])
            except ValueError:
                continue
            log.events += 1
            (log.started if parts[0] == "start" else log.durations)[local] = value
            if extra:
                log.ends[local] = extra  # type: ignore[assignment]
        return log

    def ended(self, local: int) -> bool:
        return local in self.durations

    def inside(self) -> list[int]:
        """Local ranks inside their turn: started, not ended."""
        return sorted(local for local in self.started if local not in self.durations)

    def doing(self, local: int) -> str:
        """What a local rank was doing, in words, for a message."""
        if local in self.durations:
            return "after its turn, waiting for the other ranks to end the stage"
        return "inside its turn" if local in self.started else "waiting for its turn"
