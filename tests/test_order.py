"""``_order``: the node log of a stage's turns. Pure, no store."""

from __future__ import annotations

from serialized_restore._order import NodeLog


def test_node_log_reads_starts_and_ends_and_skips_foreign_lines():
    """``NodeLog.parse`` counts the ``start`` and ``end`` lines it writes and ignores any other; the log tells which
    local ranks are inside, after or still waiting for their turn; no text at all is an empty log."""
    text = NodeLog.start_line(0, 100.0) + NodeLog.end_line(0, 2.5) + NodeLog.start_line(1, 102.5) + "junk\nend x y\n"
    log = NodeLog.parse(text)
    assert log.events == 3
    assert log.started == {0: 100.0, 1: 102.5} and log.durations == {0: 2.5}
    assert log.ended(0) and not log.ended(1) and log.inside() == [1]
    assert log.doing(1) == "inside its turn" and log.doing(2) == "waiting for its turn"
    assert log.doing(0).startswith("after its turn")
    assert NodeLog.parse(None).events == 0


def test_node_log_keeps_what_each_turn_mapped_read_copied_and_added():
    """An end line carries the bytes a turn mapped, read eagerly and copied, the process's private memory and what
    the turn added to it (which may be negative); an end line without them still ends the turn."""
    text = NodeLog.end_line(0, 1.0, 300, 0, 16, 1000, -5) + NodeLog.end_line(1, 2.0)
    log = NodeLog.parse(text)
    assert log.ends == {0: (300, 0, 16, 1000, -5)} and log.durations == {0: 1.0, 1: 2.0}
