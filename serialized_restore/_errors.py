"""Errors raised by a serialized restore."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank during a serialized restore.

    Built on the rank that failed and shipped to every other rank through the process group's store, so that all
    ranks can raise the same :class:`CheckpointRestoreError`.
    """

    global_rank: int
    node_rank: int
    local_rank: int
    stage: str
    kind: str
    """``"exception"``, ``"timeout"`` or ``"unresponsive"``."""
    message: str
    traceback: str = ""

    def describe(self) -> str:
        where = f"rank {self.global_rank} (node {self.node_rank}, local rank {self.local_rank})"
        text = f"{where}, stage {self.stage!r}: {self.message}"
        if self.traceback:
            indented = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
            text += f"\n  Traceback on {where}:\n{indented}"
        return text


class CheckpointRestoreError(RuntimeError):
    """A serialized checkpoint restore failed on at least one rank.

    Raised on every rank of the job with the same message: the failing rank(s), the checkpoint path, the stage and
    the original error with its traceback. On the rank where an exception happened it is chained as ``__cause__``.
    """

    def __init__(self, checkpoint_path: str, failures: list[RankFailure], observed_on: int) -> None:
        self.checkpoint_path = checkpoint_path
        self.failures = sorted(failures, key=lambda f: f.global_rank)
        self.observed_on = observed_on
        ranks = ", ".join(str(f.global_rank) for f in self.failures) or "unknown"
        details = "\n".join(f"- {f.describe()}" for f in self.failures)
        super().__init__(
            f"Serialized restore of checkpoint {checkpoint_path!r} failed on rank(s) {ranks}"
            f" (reported on rank {observed_on}):\n{details}"
        )

    @property
    def failed_ranks(self) -> list[int]:
        return [f.global_rank for f in self.failures]
