"""Errors raised by a serialized restore."""

from __future__ import annotations

import json
import os
import traceback
import zipfile
from dataclasses import asdict, dataclass
from typing import Any, Optional

# a rank of this kind will not take part in the rest of the restore: others stop waiting for it
GONE_KINDS = ("died", "unresponsive", "timeout", "store lost")


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank during a serialized restore.

    Built on the rank that saw it (the failing rank itself for an exception, another rank for a rank that died or
    hangs) and shipped to every other rank through the process group's store, so that all ranks can raise the same
    :class:`CheckpointRestoreError`.
    """

    global_rank: int
    """The rank that failed."""
    node_rank: Optional[int]
    local_rank: Optional[int]
    stage: str
    kind: str
    """``"exception"`` (raised on the failing rank), ``"died"`` (its process exited), ``"unresponsive"`` (no
    heartbeat), ``"timeout"`` (its turn, or the wait for it, took longer than the turn timeout) or ``"store lost"``
    (the process hosting the process group's store is gone)."""
    message: str
    traceback: str = ""
    reported_by: Optional[int] = None
    """The rank that noticed the failure, when it is not the failing rank."""

    def describe(self) -> str:
        """The failure as one item of :class:`CheckpointRestoreError`'s message."""
        where = f"rank {self.global_rank}"
        if self.node_rank is not None and self.local_rank is not None:
            where += f" (node {self.node_rank}, local rank {self.local_rank})"
        seen_by = ""
        if self.reported_by is not None and self.reported_by != self.global_rank:
            seen_by = f", reported by rank {self.reported_by}"
        text = f"{where}, stage {self.stage!r}{seen_by}: {self.message}"
        if self.traceback:
            indented = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
            text += f"\n  Traceback on {where}:\n{indented}"
        return text

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankFailure:
        return cls(**json.loads(text))


class CheckpointRestoreError(RuntimeError):
    """A serialized checkpoint restore failed on at least one rank.

    Raised on every rank of the job with the same message: the failing rank(s), the checkpoint path, the stage and
    the original error with its traceback. On the rank where an exception happened it is chained as ``__cause__``.
    """

    def __init__(self, checkpoint_path: str, failures: list[RankFailure], observed_on: int) -> None:
        self.checkpoint_path = checkpoint_path
        self.failures = _merge(failures)
        self.observed_on = observed_on
        ranks = ", ".join(str(r) for r in self.failed_ranks) or "unknown"
        stages = ", ".join(dict.fromkeys(repr(f.stage) for f in self.failures)) or "unknown"
        details = "\n".join(f"- {f.describe()}" for f in self.failures)
        super().__init__(
            f"Serialized restore of checkpoint {checkpoint_path!r} failed on rank(s) {ranks} in stage {stages}"
            f" (reported on rank {observed_on}):\n{details}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # the default would call __init__ with the message only
        return type(self), (self.checkpoint_path, list(self.failures), self.observed_on)

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, in increasing order, each once."""
        return list(dict.fromkeys(f.global_rank for f in self.failures))

    @property
    def stage(self) -> str:
        """The stage of the first failure."""
        return self.failures[0].stage if self.failures else ""


def _merge(failures: list[RankFailure]) -> list[RankFailure]:
    """One failure per failing rank and kind (the failing rank's own report preferred), sorted by rank."""
    chosen: dict[tuple[int, str], RankFailure] = {}
    for failure in failures:
        key = (failure.global_rank, failure.kind)
        current = chosen.get(key)
        if current is None or _preference(failure) < _preference(current):
            chosen[key] = failure
    # within one rank, what others saw first: a rank's own exception can only follow it (a collective that fails once
    # the ranks that timed out on it have left), never precede it, since a rank that raised is no longer waited for
    return sorted(chosen.values(), key=lambda f: (f.global_rank, f.reported_by is None, f.kind))


def _preference(failure: RankFailure) -> tuple[int, int]:
    own = failure.reported_by is None or failure.reported_by == failure.global_rank
    return (0 if own else 1, failure.reported_by if failure.reported_by is not None else -1)


# small archive members worth a checksum test when a load failed: the pickle and torch's format records
_CHECKED_MEMBERS = ("data.pkl", ".format_version", "version", "byteorder", ".storage_alignment")
_CHECKED_MEMBER_BYTES = 64 * 2**20


def failure_from_exception(rank: Any, stage: str, err: BaseException, checkpoint_path: str) -> RankFailure:
    """The :class:`RankFailure` of an exception raised on this rank (``rank``: anything with ``global_rank``,
    ``node_rank`` and ``local_rank``), its message led by what the file most likely is when that can be told."""
    message = f"{type(err).__name__}: {err}"
    explanation = explain_failure(checkpoint_path, err)
    if explanation is not None:
        # what the file is first: the low-level message can be long, and for a damaged file misleading
        message = f"{explanation}\n  {message}"
    return RankFailure(
        global_rank=rank.global_rank,
        node_rank=rank.node_rank,
        local_rank=rank.local_rank,
        stage=stage,
        kind="exception",
        message=message,
        traceback="".join(traceback.format_exception(type(err), err, err.__traceback__)),
    )


def explain_failure(checkpoint_path: str, err: BaseException) -> Optional[str]:
    """What a failed load most likely means, in words, when a cheap look at the file or the exception tells.

    (the rank whose turn failed, once) Reads at most the file's first bytes, the end of its zip archive and the
    archive's small records, never the tensors. ``None`` when the file looks like a sound checkpoint, so that the
    original message stands alone (a ``strict`` mismatch, an exception in a hook, a refused pickle).
    """
    problem = _file_problem(checkpoint_path)
    if problem is not None:
        if "weights_only" in str(err):
            problem += (
                " Loading it with `weights_only=False`, as the message from torch below suggests, would not help:"
                " the file itself is damaged or not a checkpoint."
            )
        return problem
    if isinstance(err, KeyError) and err.args in (("pytorch-lightning_version",), ("state_dict",)):
        return (
            f"{checkpoint_path!r} is not a Lightning checkpoint (it has no {err.args[0]!r} key): it looks like a"
            " bare `state_dict` saved with `torch.save(model.state_dict(), path)`. Load it into the model with"
            " `model.load_state_dict(torch.load(path))` before calling the Trainer, instead of passing it as"
            " `ckpt_path`."
        )
    return None


def _file_problem(path: str) -> Optional[str]:
    if "://" in path and not path.startswith("file://"):
        return None  # remote: a look would cost a read
    local = path[len("file://") :] if path.startswith("file://") else path
    if not os.path.lexists(local):
        where = "" if os.path.isabs(local) else f" (relative to the working directory {os.getcwd()!r})"
        return f"{path!r} does not exist{where}."
    if os.path.isdir(local):
        files = sorted(name for name in os.listdir(local) if name.endswith(".ckpt"))[:3]
        inside = f" It contains {', '.join(map(repr, files))}." if files else ""
        return f"{path!r} is a directory, not a checkpoint file: pass the path of a checkpoint file.{inside}"
    try:
        size = os.path.getsize(local)
        with open(local, "rb") as f:
            head = f.read(16)
    except OSError as err:
        return f"{path!r} cannot be read: {err}."
    if size == 0:
        return f"{path!r} is empty (0 bytes): the save that wrote it was probably interrupted, or the disk was full."
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(local):
            return (
                f"{path!r} is truncated or damaged: it starts as a PyTorch checkpoint (a zip archive) but the end of"
                f" the archive is missing ({size} bytes). The save or the copy that wrote it was probably cut short."
            )
        return _archive_problem(path, local)
    if head.startswith(b"\x80"):
        return None  # a pickle: torch's legacy (pre-1.6) format, which torch.load reads
    return (
        f"{path!r} is not a PyTorch checkpoint: it is neither a zip archive nor a pickle (it starts with"
        f" {head[:12]!r})."
    )


def _archive_problem(path: str, local: str) -> Optional[str]:
    try:
        with zipfile.ZipFile(local) as archive:
            for info in archive.infolist():
                if info.filename.endswith(_CHECKED_MEMBERS) and info.file_size <= _CHECKED_MEMBER_BYTES:
                    with archive.open(info) as member:
                        while member.read(2**20):
                            pass
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{path!r} is corrupted: {err}."
    return None
