"""``_stack``: why a rank inside its turn may be stuck, from its frames. Pure, no store."""

from __future__ import annotations

import threading

from serialized_restore._stack import collective, stuck_in, where
from tests.helpers.frames import BROADCAST


def test_the_collective_and_its_caller_are_found_past_decorators():
    """``collective`` names the public ``torch.distributed`` function the frames are blocked in (past decorators)
    and the frame that called it; frames outside ``torch.distributed`` have none, and a stack that starts inside it
    has no caller to name."""
    assert collective(BROADCAST) == ("broadcast", "`on_load_checkpoint` (train.py, line 42)")
    assert collective(BROADCAST[:1]) is None
    assert collective(BROADCAST[1:]) == ("broadcast", "code outside the frames recorded")


def test_stuck_in_names_the_collective_else_the_likely_causes_then_the_frames():
    """The text names the collective and its caller when there is one, else the two likely causes; the frames follow,
    innermost last, each with its source line when known."""
    text = stuck_in(BROADCAST)
    assert text.startswith(" It is blocked in the collective `torch.distributed.broadcast`, called from")
    assert text.endswith("    File '/x/torch/distributed/distributed_c10d.py', line 2000, in broadcast")
    assert "    File 'train.py', line 42, in on_load_checkpoint\n      dist.broadcast(t, 0)" in text
    slow = stuck_in(BROADCAST[:1])
    assert "slow or overloaded file system" in slow and "Where its main thread was:" in slow


def test_where_reads_a_live_thread_and_none_for_a_thread_gone():
    """``where`` describes the stack of a running thread (here, one waiting on an event) and gives ``None`` for an
    identifier no thread has."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        text = where(thread.ident or 0)
        assert text is not None and "in wait" in text
    finally:
        release.set()
        thread.join()
    assert where(-1) is None
