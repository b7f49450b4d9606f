"""What went wrong, in words: the failure records of ranks that died, hang or time out. Pure functions, no store.

The callers (``_liveness.Monitor``) gather the facts from the store; everything here only turns facts into
:class:`~serialized_restore.RankFailure` records, so that each message can be tested without processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

from serialized_restore._errors import RankFailure, malformed_report
from serialized_restore._options import HEARTBEAT_TIMEOUT_SETTING, TURN_TIMEOUT_SETTING
from serialized_restore._order import NodeLog

_WHERE_FRAMES = 8


@dataclass(frozen=True)
class Where:
    """The innermost frames of a rank's main thread while inside its turn: file, line number, function, source."""

    frames: list[tuple[str, int, str, str]]

    @property
    def collective(self) -> str | None:
        """The ``torch.distributed`` function the thread is blocked in, if any."""
        run = self._distributed_run()
        return self.frames[run[1]][2] if run is not None else None

    @property
    def caller(self) -> str:
        """The frame that called into ``torch.distributed``."""
        run = self._distributed_run()
        if run is None or run[0] == 0:
            return "code outside the frames recorded"
        filename, line, name, _ = self.frames[run[0] - 1]
        return f"`{name}` ({filename}, line {line})"

    @property
    def text(self) -> str:
        lines = []
        for filename, line, name, source in self.frames:
            lines.append(f"    File {filename!r}, line {line}, in {name}")
            if source:
                lines.append(f"      {source}")
        return "\n".join(lines)

    def _distributed_run(self) -> tuple[int, int] | None:
        """The innermost run of frames in ``torch.distributed``: its first frame and its public function's frame."""
        first = None
        for i in range(len(self.frames) - 1, -1, -1):
            if _in_torch_distributed(self.frames[i][0]):
                first = i
            elif first is not None:
                break
        if first is None:
            return None
        # skip decorators (`c10d_logger`'s `wrapper`) and private helpers to the public function
        api = first
        while api < len(self.frames) - 1 and self.frames[api][2].startswith(("wrapper", "_")):
            api += 1
        return first, api

    @classmethod
    def of_thread(cls, ident: int) -> Where | None:
        frame = sys._current_frames().get(ident)
        if frame is None:
            return None
        summary = traceback.extract_stack(frame)[-_WHERE_FRAMES:]
        return cls([(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary])

    def to_json(self) -> str:
        return json.dumps(self.frames)

    @classmethod
    def from_json(cls, text: str) -> Where:
        return cls([(str(f), int(line), str(name), str(source)) for f, line, name, source in json.loads(text)])


def _in_torch_distributed(filename: str) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in filename or "torch/distributed/" in filename


def parse_reports(raw: str, stage: str) -> list[RankFailure]:
    """The failure records of a stage; a record that is not one of ours becomes a failure that says so."""
    failures = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            failures.append(RankFailure.from_json(line))
        except ValueError as err:
            failures.append(malformed_report(stage, line, err))
    return failures


def gone_failure(
    *,
    stage: str,
    observer: int,
    node: int,
    local: int,
    global_rank: int,
    pid: int,
    exited: bool,
    doing: str,
    silent: float,
    heartbeat_timeout: float,
) -> RankFailure:
    """A peer whose process exited (``exited``) or whose heartbeat has been silent for ``silent`` seconds."""
    bound = f"{HEARTBEAT_TIMEOUT_SETTING} (seconds, now {heartbeat_timeout:g})"
    if exited:
        message = (
            f"its process (pid {pid}) exited while {doing} of stage {stage!r}: it was probably killed (for example by"
            f" the out-of-memory killer) or crashed without raising. Ranks on other machines are declared dead after"
            f" {bound} without a heartbeat."
        )
    else:
        message = (
            f"stopped responding while {doing} of stage {stage!r}: no heartbeat for {silent:.1f}s. The process"
            f" probably died (killed, out of memory) or its machine is unreachable. Set {bound} to change how long"
            " ranks wait for a silent rank."
        )
    return RankFailure(
        global_rank=global_rank,
        node_rank=node,
        local_rank=local,
        stage=stage,
        kind="died" if exited else "unresponsive",
        message=message,
        reported_by=observer,
    )


def timeout_failures(
    *,
    stage: str,
    observer: tuple[int, int, int],
    local_world_size: int,
    turn_timeout: float,
    idle: float,
    what: str,
    logs: dict[int, NodeLog],
    arrived: dict[tuple[int, int], int],
    wheres: dict[tuple[int, int], Where],
    now: float | None = None,
) -> list[RankFailure]:
    """The ranks to blame when nothing moved for longer than the turn timeout, among the nodes in ``logs``: those
    inside their turn, else those that have not arrived, else the observer itself.

    ``observer``: ``(global rank, node, local rank)`` of the rank that waited ``idle`` seconds for ``what``;
    ``arrived``: the global rank of each ``(node, local)`` that reached the stage; ``wheres``: where the main thread of
    a rank inside its turn was.
    """
    now = time.time() if now is None else now
    me, my_node, my_local = observer
    setting = f"{TURN_TIMEOUT_SETTING} (seconds, now {turn_timeout:g})"
    busy: list[tuple[int, int]] = []
    absent: list[tuple[int, int]] = []
    for node, log in sorted(logs.items()):
        for local in range(local_world_size):
            if (node, local) == (my_node, my_local):
                continue
            if local in log.started:
                if not log.ended(local):
                    busy.append((node, local))
            elif (node, local) not in arrived:
                absent.append((node, local))
    failures = []
    for node, local in busy:
        where = wheres.get((node, local))
        if where is not None and where.collective:
            cause = (
                f" It is blocked in the collective `torch.distributed.{where.collective}`, called from"
                f" {where.caller}: a collective inside a turn cannot complete while the other ranks wait for"
                " their turn. Hooks that run during the restore (`on_load_checkpoint`, a callback's"
                " `load_state_dict`) must not run collectives while `serialized_checkpoint_loading` is on;"
                " move the collective to `setup` or `on_fit_start`, or turn the option off."
            )
        else:
            cause = (
                " Either reading the checkpoint is that slow (for example a slow or overloaded file system: set"
                f" {TURN_TIMEOUT_SETTING} to a larger number of seconds), or code in the turn waits for other ranks,"
                " for example a collective such as `broadcast` or `barrier` in `on_load_checkpoint` or in a"
                " callback's `load_state_dict`, which cannot complete while they wait for their turn."
            )
        failures.append(
            RankFailure(
                global_rank=arrived.get((node, local), node * local_world_size + local),
                node_rank=node,
                local_rank=local,
                stage=stage,
                kind="timeout",
                message=(
                    f"still inside its turn after {now - logs[node].started[local]:.1f}s, and no turn on node {node}"
                    f" has started or ended for {idle:.1f}s: longer than the turn timeout, {setting}.{cause}"
                    + (f"\n  Where its main thread was:\n{where.text}" if where is not None else "")
                ),
                reported_by=me,
            )
        )
    if not failures:
        for node, local in absent or [(my_node, my_local)]:
            failures.append(
                RankFailure(
                    global_rank=node * local_world_size + local if absent else me,
                    node_rank=node,
                    local_rank=local,
                    stage=stage,
                    kind="timeout",
                    message=(
                        f"rank {me} waited {idle:.1f}s for {what} with no turn starting or ending, longer than the"
                        f" turn timeout, {setting}: "
                        + (
                            "this rank has not reached the restore (it may be slower to start, or stuck before it)."
                            if absent
                            else "no rank is inside its turn."
                        )
                    ),
                    reported_by=me,
                )
            )
    return failures


def store_lost_failure(stage: str, observer: int, err: BaseException) -> RankFailure:
    """The loss of the store itself, when nothing read from it before explains the end."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host = "the launcher's agent (torchrun)" if agent else "global rank 0"
    cause = err.__cause__ or err
    first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return RankFailure(
        global_rank=observer if agent else 0,
        node_rank=None if agent else 0,
        local_rank=None if agent else 0,
        stage=stage,
        kind="store lost",
        message=(
            f"lost contact with the process group's store, which is hosted by {host}: that process probably"
            f" exited, was killed (for example by the out-of-memory killer) or crashed"
            f" ({type(cause).__name__}: {first_line})."
        ),
        reported_by=observer,
    )
