"""Stack frames built by hand, as ``traceback.extract_stack`` gives them: what the stall-diagnosis tests describe."""

from __future__ import annotations

from traceback import FrameSummary


def frames(*rows: tuple[str, int, str, str]) -> list[FrameSummary]:
    """``(file, line, function, source)`` rows as frames, outermost first."""
    return [FrameSummary(file, line, name, lookup_line=False, line=source) for file, line, name, source in rows]


# a hook blocked in `torch.distributed.broadcast`, past its logging decorator
BROADCAST = frames(
    ("train.py", 42, "on_load_checkpoint", "dist.broadcast(t, 0)"),
    ("/x/torch/distributed/c10d_logger.py", 80, "wrapper", ""),
    ("/x/torch/distributed/distributed_c10d.py", 2000, "broadcast", ""),
)
