"""``_order``: who waits for whom on a node, and the node log of a stage's turns. Pure, no store."""

from __future__ import annotations

from serialized_restore._order import NodeLog, TurnOrder


def test_turn_order_forms_k_chains():
    """With 8 local ranks and k = 3, local rank r waits for r - 3 and hands over to r + 3: the first three wait for
    nobody and the last three hand over to nobody; a single rank has neither."""
    order = TurnOrder(local_world_size=8, max_concurrent=3)
    assert [order.predecessor(r) for r in range(8)] == [None, None, None, 0, 1, 2, 3, 4]
    assert [order.successor(r) for r in range(8)] == [3, 4, 5, 6, 7, None, None, None]
    single = TurnOrder(local_world_size=1, max_concurrent=1)
    assert single.predecessor(0) is None and single.successor(0) is None


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
