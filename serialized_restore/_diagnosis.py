"""A stalled stage, diagnosed: whom to blame when nothing moved for the turn timeout, and why."""

from __future__ import annotations

import time
from typing import Any

from serialized_restore._errors import FailureKind, RankFailure
from serialized_restore._options import TURN_TIMEOUT_SETTING
from serialized_restore._order import NodeLog
from serialized_restore._stack import UNKNOWN_STACK
from serialized_restore._store import StageStore


def timeout_failures(
    stage: str,
    observer: Any,
    turn_timeout: float,
    idle: float,
    what: str,
    logs: dict[int, NodeLog],
    arrived: dict[tuple[int, int], int],
    wheres: dict[tuple[int, int], str],
    now: float | None = None,
) -> list[RankFailure]:
    """Whom to blame when ``observer`` (a placement) waited ``idle`` seconds for ``what``, longer than the turn
    timeout, among the nodes in ``logs``: the ranks inside their turn (``wheres``: their ``_stack.where``), else those
    that have not arrived (``arrived``: the global rank of each ``(node, local)`` known to have), else itself."""
    now = time.time() if now is None else now
    me, lws = observer.global_rank, observer.local_world_size
    setting = f"{TURN_TIMEOUT_SETTING} (seconds, now {turn_timeout:g})"
    others = [(n, r) for n in sorted(logs) for r in range(lws) if (n, r) != (observer.node_rank, observer.local_rank)]
    failures = []
    for node, local in [(n, r) for n, r in others if r in logs[n].inside()]:
        message = (
            f"still inside its turn after {now - logs[node].started[local]:.1f}s, and no turn on node {node} has"
            f" started or ended for {idle:.1f}s: longer than the turn timeout, {setting}."
            + wheres.get((node, local), UNKNOWN_STACK)
        )
        rank = arrived.get((node, local), node * lws + local)
        failures.append(RankFailure(rank, node, local, stage, FailureKind.TIMEOUT, message, reported_by=me))
    if failures:
        return failures
    absent = [(n * lws + r, n, r) for n, r in others if r not in logs[n].started and (n, r) not in arrived]
    why = "this rank has not reached the restore (it may be slower to start, or stuck before it)."
    message = f"rank {me} waited {idle:.1f}s for {what} with no turn starting or ending, longer than the turn timeout,"
    message += f" {setting}: {why if absent else 'no rank is inside its turn.'}"
    blamed = absent or [(me, observer.node_rank, observer.local_rank)]
    return [RankFailure(*who, stage, FailureKind.TIMEOUT, message, reported_by=me) for who in blamed]


def diagnose_stall(
    schedule: Any, store: StageStore, idle: float, node_log: NodeLog | None, predecessor: int | None
) -> list[RankFailure]:
    """(a rank's watch, once per wait) The timeout failures to post after ``idle`` seconds without progress: for its
    own node (``node_log``) when it waits for its predecessor; for every unfinished node when it waits for the stage
    to end and claims the diagnosis (so only one rank reads O(nodes) keys)."""
    p, keys, view = schedule.placement, store.keys, store.side
    if node_log is not None:
        logs, what = {p.node_rank: node_log}, f"the end of local rank {predecessor}'s turn"
    elif view.compare_set(keys.diagnosis, "", str(p.global_rank)) != str(p.global_rank):
        return []  # another rank diagnoses the stall
    else:
        every = (NodeLog.parse(view.get_if_set(keys.log(n))) for n in range(p.world_size // p.local_world_size))
        logs = {n: log for n, log in enumerate(every) if len(log.durations) < p.local_world_size}
        what = "every rank to end the stage"
    # other nodes' ranks that have not started count as not arrived: one that did has its wake-up repaired by its watch
    arrived = {(p.node_rank, local): ident.global_rank for local, ident in schedule.peers.identities.items()}
    arrived[(p.node_rank, p.local_rank)] = p.global_rank
    published = {(n, r): view.get_if_set(keys.where(n, r)) for n, log in logs.items() for r in log.inside()}
    wheres = {at: text for at, text in published.items() if text is not None}
    return timeout_failures(keys.stage, p, schedule.turn_timeout, idle, what, logs, arrived, wheres)
