"""`serialized_checkpoint_loading="auto"`: the per-node choice of k from the memory available."""

from __future__ import annotations

import pytest

from serialized_restore._plan import SAFETY_MARGIN, parse_plan, plan_auto


@pytest.mark.parametrize(
    ("available", "reader", "expected"),
    [
        (10 * 2**30, "eager", 4),  # room for every local rank
        (int(2.6 * 2**30), "eager", 2),  # 2.6 GiB x 0.8 = 2.08 GiB: two 1 GiB turns
        (int(1.3 * 2**30), "eager", 1),
        (int(1.2 * 2**30), "mmap", 4),  # a mapped turn needs about a tenth of the file privately
        (int(0.5 * 2**30), "eager", 0),  # not even one turn fits
    ],
)
def test_auto_plan_from_injected_available_memory(available: int, reader: str, expected: int) -> None:
    """ "auto" picks k from available memory x (1 - margin) / per-turn need, clamped to the local world size."""
    k, figures = plan_auto(checkpoint_size=2**30, reader=reader, local_world_size=4, available_memory=available)
    assert k == expected
    assert f"available (given), {SAFETY_MARGIN:.0%} kept as margin" in figures


@pytest.mark.parametrize("text", ["", "not json", "[1]", '[true, "x"]', '["2", "x"]', "[2, 3]", "{}"])
def test_a_malformed_decision_from_the_store_is_refused(text: str) -> None:
    """A decision read from the (unauthenticated) store that is not `[k, figures]` raises a clear ValueError."""
    with pytest.raises(ValueError, match='"auto" read a malformed decision'):
        parse_plan(text)
    assert parse_plan('[3, "figures"]') == (3, "figures")
