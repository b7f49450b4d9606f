"""``_diagnosis``: whom a stalled stage blames and why. Pure: the facts are given, no store."""

from __future__ import annotations

from serialized_restore._diagnosis import timeout_failures
from serialized_restore._options import TURN_TIMEOUT_SETTING
from serialized_restore._order import NodeLog
from serialized_restore._stack import stuck_in
from serialized_restore._turns import RankPlacement
from tests.helpers.frames import BROADCAST

STAGE = "restore modules and callbacks"


def test_timeout_names_the_rank_inside_its_turn_and_its_collective():
    """A turn timeout blames the rank still inside its turn, with how long, the turn timeout setting, the
    ``torch.distributed`` collective it is blocked in, the hook that called it and its frames, and says hooks must
    not run collectives; without word of where it is, it names the two likely causes."""
    log = NodeLog.parse(NodeLog.start_line(0, 1000.0))
    common = dict(stage=STAGE, observer=RankPlacement(1, 3, 0, 1, 3), turn_timeout=8.0, idle=8.5, now=1009.0)
    arrived = {(0, 0): 0, (0, 1): 1, (0, 2): 2}
    wheres = {(0, 0): stuck_in(BROADCAST)}
    (failure,) = timeout_failures(what="x", logs={0: log}, arrived=arrived, wheres=wheres, **common)
    assert (failure.global_rank, failure.kind, failure.reported_by) == (0, "timeout", 1)
    assert failure.message.startswith("still inside its turn after 9.0s, and no turn on node 0")
    assert f"{TURN_TIMEOUT_SETTING} (seconds, now 8)" in failure.message
    assert "blocked in the collective `torch.distributed.broadcast`" in failure.message
    assert "`on_load_checkpoint` (train.py, line 42)" in failure.message
    assert "must not run collectives" in failure.message
    assert "    File 'train.py', line 42, in on_load_checkpoint\n      dist.broadcast(t, 0)" in failure.message
    (unknown,) = timeout_failures(what="x", logs={0: log}, arrived=arrived, wheres={}, **common)
    assert "slow or overloaded file system" in unknown.message and "collective such as" in unknown.message


def test_timeout_names_ranks_that_never_arrived_else_the_observer():
    """With no rank inside its turn, a turn timeout blames the ranks that have not reached the restore; when every
    rank has, it blames the observer itself and says that no rank is inside its turn."""
    log = NodeLog.parse(NodeLog.start_line(0, 1.0) + NodeLog.end_line(0, 1.0))
    common = dict(stage=STAGE, observer=RankPlacement(0, 2, 0, 0, 2), turn_timeout=1.5, idle=2.0, what="x", now=5.0)
    (absent,) = timeout_failures(logs={0: log}, arrived={(0, 0): 0}, wheres={}, **common)
    assert absent.global_rank == 1 and "has not reached the restore" in absent.message
    (nobody,) = timeout_failures(logs={0: log}, arrived={(0, 0): 0, (0, 1): 1}, wheres={}, **common)
    assert nobody.global_rank == 0 and "no rank is inside its turn" in nobody.message
