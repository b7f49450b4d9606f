"""Why a rank inside its turn may be stuck, in words, from its main thread's stack: for a turn timeout's message."""

from __future__ import annotations

import os
import sys
import traceback

from serialized_restore._options import TURN_TIMEOUT_SETTING

_WHERE_FRAMES = 8
_COLLECTIVE = (
    " It is blocked in the collective `torch.distributed.{}`, called from {}: a collective inside a turn cannot"
    " complete while the other ranks wait for their turn. Hooks that run during the restore (`on_load_checkpoint`, a"
    " callback's `load_state_dict`) must not run collectives while `serialized_checkpoint_loading` is on; move the"
    " collective to `setup` or `on_fit_start`, or turn the option off."
)
# what a timeout says of a rank whose stack is not known
UNKNOWN_STACK = (
    " Either reading the checkpoint is that slow (for example a slow or overloaded file system: set"
    f" {TURN_TIMEOUT_SETTING} to a larger number of seconds), or code in the turn waits for other ranks, for example"
    " a collective such as `broadcast` or `barrier` in `on_load_checkpoint` or in a callback's `load_state_dict`,"
    " which cannot complete while they wait for their turn."
)


def where(thread: int) -> str | None:
    """(the watch of a rank inside its turn) :func:`stuck_in` of its main thread's innermost frames."""
    frame = sys._current_frames().get(thread)
    return None if frame is None else stuck_in(traceback.extract_stack(frame)[-_WHERE_FRAMES:])


def stuck_in(frames: list[traceback.FrameSummary]) -> str:
    """Why a rank inside its turn may be stuck, for a timeout message: the collective it is in, and its frames."""
    blocked = collective(frames)
    shown = "".join(f"\n    File {f.filename!r}, line {f.lineno}, in {f.name}" + (f"\n      {f.line}" if f.line else "")
                    for f in frames)  # fmt: skip
    return (_COLLECTIVE.format(*blocked) if blocked else UNKNOWN_STACK) + f"\n  Where its main thread was:{shown}"


def collective(frames: list[traceback.FrameSummary]) -> tuple[str, str] | None:
    """The public ``torch.distributed`` function ``frames`` are blocked in (past decorators and private helpers) and
    the frame that called it."""
    inside = [i for i, f in enumerate(frames) if "torch/distributed/" in f.filename.replace(os.sep, "/")]
    if not inside:
        return None
    first = inside[-1]
    while first - 1 in inside:
        first -= 1
    api = first
    while api < len(frames) - 1 and frames[api].name.startswith(("wrapper", "_")):
        api += 1
    caller = frames[first - 1] if first else None
    return (
        frames[api].name,
        f"`{caller.name}` ({caller.filename}, line {caller.lineno})" if caller else "code outside the frames recorded",
    )
