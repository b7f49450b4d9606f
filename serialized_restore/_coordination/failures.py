"""What failed on a rank (:class:`RankFailure`, JSON in the store) and the error every rank raises."""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
import sys
import traceback
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore.settings import TURN_TIMEOUT_SETTING


class FailureKind(str, Enum):
    """What happened to a failing rank (a ``str``: records stay plain JSON); ``docs/failures.md`` has the table."""

    EXCEPTION = "exception"  # it raised during its turn
    TIMEOUT = "timeout"  # its turn did not end within the turn timeout
    STORE_LOST = "store lost"  # the process hosting the process group's store is gone
    STORE_UNRESPONSIVE = "store unresponsive"  # the process hosting the store is alive but does not answer
    MALFORMED = "malformed report"  # a record in the store that is not ours (``global_rank`` -1)
    __str__ = str.__str__  # the value, not FailureKind.TIMEOUT


_PUBLIC = "serialized_restore"  # where the public classes are imported from: what tracebacks and records name
_BASES = (BaseException, Exception, object)  # left out of a failure's error_types
# errors whose own text says what is wrong with the file (upstream's), so that the package adds nothing to them
_SAYS_WHY = (FileNotFoundError, PermissionError)


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, built on the rank that saw it and shipped to every other rank through the store,
    so that all ranks raise the same :class:`CheckpointRestoreError`."""

    global_rank: int
    node_rank: int | None
    local_rank: int | None
    stage: str
    kind: FailureKind
    message: str
    traceback: str = ""
    reported_by: int | None = None  # the rank that noticed the failure, when it is not the failing rank
    error_types: tuple[str, ...] = ()  # an exception's class and bases, "module:qualname", most derived first

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind(self.kind))

    def describe(self) -> str:
        """One item of :class:`CheckpointRestoreError`'s message: rank, stage, message (not the :attr:`traceback`)."""
        where = f"rank {self.global_rank}" if self.global_rank >= 0 else "an unknown rank"
        return f"{where}{self._placed()}, stage {self.stage!r}: {self.message}"

    def _placed(self) -> str:
        """`` (node 0, local rank 1, reported by rank 2)``: what is known besides the global rank, or ``""``."""
        parts = [f"node {self.node_rank}, local rank {self.local_rank}"] if self.local_rank is not None else []
        if self.reported_by not in (None, self.global_rank):
            parts.append(f"reported by rank {self.reported_by}")
        return f" ({', '.join(parts)})" if parts else ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankFailure:
        """Parse a record written by :meth:`to_json`, field by field; ``ValueError`` naming what is wrong otherwise."""
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if set(data) != set(_FIELDS):
            raise ValueError(f"unknown or missing fields: {sorted(set(data) ^ set(_FIELDS))}")
        for name, value in data.items():
            if isinstance(value, bool) or not isinstance(value, _FIELDS[name]):
                raise ValueError(f"{name!r} is {type(value).__name__}")
        if not all(isinstance(item, str) for item in data["error_types"]):
            raise ValueError("'error_types' is not a list of strings")
        return cls(**{**data, "error_types": tuple(data["error_types"])})  # an unknown kind: ValueError

    @classmethod
    def malformed(cls, stage: str, record: str, problem: BaseException) -> RankFailure:
        """A record in the job's store that could not be read: a failure that says so."""
        shown = record if len(record) <= 200 else record[:200] + "..."
        message = (
            f"a failure record in the job's store could not be read ({problem}): {shown!r}. Another rank reported a"
            " failure, but its record was damaged or was not written by serialized_restore (any process that can"
            " reach the job's TCPStore can write to it)."
        )
        return cls(-1, None, None, stage, FailureKind.MALFORMED, message)


_OPTIONAL_INT = (int, type(None))
_FIELDS: dict[str, type | tuple[type, ...]] = dict(global_rank=int, node_rank=_OPTIONAL_INT, local_rank=_OPTIONAL_INT)
_FIELDS.update(stage=str, kind=str, message=str, traceback=str, reported_by=_OPTIONAL_INT, error_types=list)


class CheckpointRestoreError(Exception):
    """A serialized checkpoint restore failed on at least one rank of a multi-process job: every rank raises one,
    with the same message, of a subclass that also derives from the original exception's type (``RuntimeError``
    when no rank raised), as ``docs/failures.md`` describes."""

    def __init__(self, checkpoint_path: str, failures: list[RankFailure], observed_on: int) -> None:
        self.checkpoint_path = checkpoint_path
        self.failures = sorted(failures, key=lambda f: f.global_rank)
        self.observed_on = observed_on
        ranks = ", ".join(str(r) for r in self.failed_ranks) or "unknown"
        stages = ", ".join(dict.fromkeys(repr(f.stage) for f in self.failures)) or "unknown"
        self.message = (
            f"Serialized restore of checkpoint {checkpoint_path!r} failed on rank(s) {ranks} in stage {stages}"
        )
        if len(self.failures) == 1:  # one line, as upstream's own error would be
            self.message += f"{self.failures[0]._placed()}: {self.failures[0].message}"
        else:
            self.message += ":" + "".join(f"\n- {f.describe()}" for f in self.failures)
        # BaseException's own __init__: the original type's may take other arguments (OSError, a user's class)
        Exception.__init__(self, self.message)

    def __str__(self) -> str:
        # the original type's __str__ may format differently (KeyError quotes its argument)
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # the default would call __init__ with the message only; the class itself is rebuilt from its bases
        bases = tuple(b for b in type(self).__bases__ if b is not CheckpointRestoreError)
        return _rebuild, (bases, self.checkpoint_path, list(self.failures), self.observed_on)

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, in increasing order."""
        return list(dict.fromkeys(f.global_rank for f in self.failures if f.global_rank >= 0))

    @property
    def stage(self) -> str:
        """The stage of the first failure."""
        return self.failures[0].stage if self.failures else ""


def restore_error(
    checkpoint_path: str, failures: list[RankFailure], observed_on: int, own: BaseException | None = None
) -> CheckpointRestoreError:
    """The error a rank raises: also an instance of each original type among ``failures`` (in rank order) found in the
    modules this process imported (nothing is imported or evaluated), and of ``own``'s type."""
    merged = sorted(failures, key=lambda f: f.global_rank)
    bases: list[type[BaseException]] = []
    for f in (f for f in merged if f.kind == FailureKind.EXCEPTION):
        mine = own is not None and f.global_rank == observed_on and f.reported_by is None
        cls = type(own) if mine else _resolve(f.error_types)
        if cls and issubclass(cls, Exception) and not issubclass(cls, CheckpointRestoreError) and cls not in bases:
            bases.append(cls)
    return _rebuild(tuple(bases), checkpoint_path, merged, observed_on)


def _rebuild(
    bases: tuple[type[BaseException], ...], checkpoint_path: str, failures: list[RankFailure], observed_on: int
) -> CheckpointRestoreError:
    return _error_class(tuple(bases) or (RuntimeError,))(checkpoint_path, failures, observed_on)


@functools.cache
def _error_class(bases: tuple[type[BaseException], ...]) -> type[CheckpointRestoreError]:
    """The subclass that also derives from ``bases``, built once; bases that cannot combine are dropped from the end."""
    for candidate in [bases[:n] for n in range(len(bases), 0, -1)]:
        name = f"CheckpointRestoreError[{', '.join(b.__name__ for b in candidate)}]"
        with contextlib.suppress(TypeError):
            return type(name, (CheckpointRestoreError, *candidate), {"__module__": _PUBLIC, "__qualname__": name})
    return _error_class((RuntimeError,))


def _resolve(names: tuple[str, ...]) -> type[BaseException] | None:
    """The first of ``names`` that names an exception class in a module this process has already imported."""
    for name in names:
        module_name, _, qualname = name.partition(":")
        obj: Any = sys.modules.get(module_name)
        for part in qualname.split(".") if obj is not None and "<" not in qualname else ():
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, Exception):
            return obj
    return None


def _store_host(agent: bool) -> str:
    return "the launcher's agent (torchrun)" if agent else "global rank 0"


def store_lost_failure(stage: str, observer: int, err: BaseException, agent: bool) -> RankFailure:
    """The loss of the store itself, when nothing read from it before explains the end; ``agent``: the store is
    hosted by torchrun's agent, not by global rank 0."""
    host = _store_host(agent)
    cause = err.__cause__ or err
    first_line = (str(cause).strip().splitlines() or [""])[0]
    message = (
        f"lost contact with the process group's store, which is hosted by {host}: that process probably exited, was"
        f" killed (for example by the out-of-memory killer) or crashed ({type(cause).__name__}: {first_line})."
    )
    rank, node, local = (observer, None, None) if agent else (0, 0, 0)
    return RankFailure(rank, node, local, stage, FailureKind.STORE_LOST, message, reported_by=observer)


def unresponsive_store_failure(stage: str, observer: int, err: BaseException, agent: bool) -> RankFailure:
    """The store's host is there but does not answer: stopped (SIGSTOP, a debugger), hung, or overloaded."""
    host = _store_host(agent)
    message = (
        f"the process group's store, which is hosted by {host}, stopped answering ({err}): that process is stopped"
        " or hung (for example inside its own turn, or in a collective), or the store is overloaded. Every rank"
        f" ends instead of waiting for it; a stuck host is named at the turn timeout, {TURN_TIMEOUT_SETTING}."
    )
    rank, node, local = (observer, None, None) if agent else (0, 0, 0)
    return RankFailure(rank, node, local, stage, FailureKind.STORE_UNRESPONSIVE, message, reported_by=observer)


def verdict_failures(stage: str, verdict: str) -> list[RankFailure]:
    """The failure a stage's verdict carries after its first line (checked: anyone can write to the store)."""
    try:
        return [RankFailure.from_json(verdict.partition("\n")[2])]
    except ValueError as err:
        return [RankFailure.malformed(stage, verdict, err)]


def timeout_failure(
    observer: RankPlacement, stage: str, local: int, turn_timeout: float, doing: str | None = None
) -> RankFailure:
    """Local rank ``local`` of ``observer``'s node did not end its turn within the turn timeout; ``doing``: what the
    turn does, where it is most likely just slow at it (a download)."""
    if doing is not None:
        message = (
            f"did not finish {doing} within the turn timeout, {TURN_TIMEOUT_SETTING} (seconds, now {turn_timeout:g}),"
            " counted from when it could start: it takes longer than that (raise the timeout above the time it needs),"
            " or its process stopped or ended."
        )
    else:
        message = (
            f"did not end its turn within the turn timeout, {TURN_TIMEOUT_SETTING} (seconds, now {turn_timeout:g}),"
            " counted from when it could start; it is stuck in its turn, has not reached the restore, or its process"
            " ended. Likely causes: a slow file system (raise the timeout), or a collective (such as"
            " `strategy.barrier()`) in `LightningModule.on_load_checkpoint` or a callback's `on_load_checkpoint` /"
            " `load_state_dict`, which cannot complete while the other ranks wait for their turns. A rank stuck in its"
            " turn prints its stack to its stderr at the timeout."
        )
    at = (observer.global_rank_of(local), observer.node_rank, local, stage)
    return RankFailure(*at, FailureKind.TIMEOUT, message, reported_by=observer.global_rank)


def stalled_failure(observer: RankPlacement, stage: str, waited: str, bound: float, turn_timeout: float) -> RankFailure:
    """The backstop: no rank timed the stall (a stage all ranks run at once, or a timer whose process ended too)."""
    message = (
        f"rank {observer.global_rank} waited {bound:g}s for {waited}: one turn timeout ({TURN_TIMEOUT_SETTING}, now"
        f" {turn_timeout:g}s) for each turn that had to end first. A rank stopped, or its process ended, where no"
        " other rank times it (a stage all ranks run at once, a rank that never arrived)."
    )
    return RankFailure(-1, None, None, stage, FailureKind.TIMEOUT, message, reported_by=observer.global_rank)


def failure_from_exception(rank: RankPlacement, stage: str, err: BaseException, checkpoint_path: str) -> RankFailure:
    """The record of an exception raised on this rank, led by what is wrong with the file when that can be told."""
    # imported here: it imports fsspec, which the package's import (and so the launcher, before it starts the
    # program) does without
    from serialized_restore._files import explain_failure

    message = f"{type(err).__name__}: {err}"
    explanation = None if isinstance(err, _SAYS_WHY) else explain_failure(checkpoint_path, err)
    if explanation is not None and isinstance(err, pickle.UnpicklingError):
        message = f"{type(err).__name__}: {explanation}"  # instead of torch's generic advice (`weights_only`, ...)
    elif explanation is not None:
        message = f"{explanation}\n  {message}"
    where = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    types = tuple(f"{c.__module__}:{c.__qualname__}" for c in type(err).__mro__ if c not in _BASES)
    at = (rank.global_rank, rank.node_rank, rank.local_rank, stage)
    return RankFailure(*at, FailureKind.EXCEPTION, message, where, error_types=types)


RankFailure.__module__ = CheckpointRestoreError.__module__ = _PUBLIC
