"""A stalled stage, diagnosed: whom to blame when nothing moved for the turn timeout, and why.

:func:`diagnose_stall` gathers the facts from the store; :func:`timeout_failures` turns them into records.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from serialized_restore._errors import FailureKind, RankFailure
from serialized_restore._options import TURN_TIMEOUT_SETTING
from serialized_restore._order import NodeLog
from serialized_restore._store import StageStore, identity_key

_WHERE_FRAMES = 8
_DIAGNOSIS_BUDGET = 5.0
"""The longest the rank that diagnoses a job-wide stall spends reading the other nodes' state."""


@dataclass(frozen=True)
class Where:
    """The innermost frames of a rank's main thread while inside its turn: file, line number, function, source."""

    frames: list[tuple[str, int, str, str]]

    def collective(self) -> tuple[str, str] | None:
        """The public ``torch.distributed`` function the thread is blocked in (the innermost run of its frames, past
        decorators and private helpers) and the frame that called it, if any."""
        first = None
        for i in range(len(self.frames) - 1, -1, -1):
            if "torch/distributed/" in self.frames[i][0].replace(os.sep, "/"):
                first = i
            elif first is not None:
                break
        if first is None:
            return None
        api = first
        while api < len(self.frames) - 1 and self.frames[api][2].startswith(("wrapper", "_")):
            api += 1
        if first == 0:
            return self.frames[api][2], "code outside the frames recorded"
        filename, line, name, _ = self.frames[first - 1]
        return self.frames[api][2], f"`{name}` ({filename}, line {line})"

    @property
    def text(self) -> str:
        lines = []
        for filename, line, name, source in self.frames:
            lines.append(f"    File {filename!r}, line {line}, in {name}")
            if source:
                lines.append(f"      {source}")
        return "\n".join(lines)

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


def timeout_failures(
    stage: str,
    observer: Any,
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

    ``observer``: the placement of the rank that waited ``idle`` seconds for ``what``;
    ``arrived``: the global rank of each ``(node, local)`` that reached the stage; ``wheres``: where the main thread of
    a rank inside its turn was.
    """
    now = time.time() if now is None else now
    me, my_node, my_local = observer.global_rank, observer.node_rank, observer.local_rank
    local_world_size = observer.local_world_size
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
        blocked = where.collective() if where is not None else None
        if blocked is not None:
            cause = (
                f" It is blocked in the collective `torch.distributed.{blocked[0]}`, called from"
                f" {blocked[1]}: a collective inside a turn cannot complete while the other ranks wait for"
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
        message = (
            f"still inside its turn after {now - logs[node].started[local]:.1f}s, and no turn on node {node} has"
            f" started or ended for {idle:.1f}s: longer than the turn timeout, {setting}.{cause}"
        )
        if where is not None:
            message += f"\n  Where its main thread was:\n{where.text}"
        rank = arrived.get((node, local), node * local_world_size + local)
        failures.append(RankFailure(rank, node, local, stage, FailureKind.TIMEOUT, message, reported_by=me))
    if failures:
        return failures
    why = "this rank has not reached the restore (it may be slower to start, or stuck before it)."
    message = f"rank {me} waited {idle:.1f}s for {what} with no turn starting or ending, longer than the turn timeout,"
    message += f" {setting}: {why if absent else 'no rank is inside its turn.'}"
    blamed = [(node * local_world_size + local, node, local) for node, local in absent] or [(me, my_node, my_local)]
    return [RankFailure(*who, stage, FailureKind.TIMEOUT, message, reported_by=me) for who in blamed]


def diagnose_stall(
    schedule: Any, store: StageStore, idle: float, node_log: NodeLog | None, predecessor: int | None
) -> list[RankFailure]:
    """(a rank's watch, once per wait) The timeout failures to post after ``idle`` seconds without progress: for the
    own node (``node_log``) when waiting for the predecessor's end; for every unfinished node when waiting for the
    stage to end, by the one rank that claims the diagnosis (so only one rank reads O(nodes) keys)."""
    p, keys, view = schedule.placement, store.keys, store.side
    deadline = time.monotonic() + _DIAGNOSIS_BUDGET
    logs: dict[int, NodeLog] = {}
    if node_log is not None:
        logs[p.node_rank] = node_log
        what = f"the end of local rank {predecessor}'s turn"
    else:
        if view.compare_set(keys.diagnosis, "", str(p.global_rank)) != str(p.global_rank):
            return []  # another rank diagnoses the stall
        what = "every rank to end the stage"
        for node in range(max(1, p.world_size // p.local_world_size)):
            if time.monotonic() > deadline:
                break
            log = NodeLog.parse(view.get_if_set(keys.log(node)))
            if len(log.durations) < p.local_world_size:
                logs[node] = log
    arrived = {(p.node_rank, p.local_rank): p.global_rank}
    arrived.update({(p.node_rank, local): ident.global_rank for local, ident in schedule.peers.identities.items()})
    wheres: dict[tuple[int, int], Where] = {}
    for node, log in logs.items():
        for local in range(p.local_world_size):
            if time.monotonic() > deadline:
                break
            if node != p.node_rank and (node, local) not in arrived:
                raw = view.get_if_set(identity_key(node, local))
                if raw is not None:
                    arrived[(node, local)] = int(json.loads(raw)[0])  # an Identity
            if local in log.inside():
                raw = view.get_if_set(keys.where(node, local))
                if raw is not None:
                    wheres[(node, local)] = Where.from_json(raw)
    return timeout_failures(keys.stage, p, schedule.turn_timeout, idle, what, logs, arrived, wheres)
