"""``_coordination/failures.py``: the failure records ranks exchange and the one error every rank raises, without
processes (``test_failures.py`` has the failures of real jobs)."""

from __future__ import annotations

import json
import pickle

import pytest

from serialized_restore import CheckpointRestoreError, RankFailure
from serialized_restore._coordination.failures import (
    FailureKind,
    failure_from_exception,
    restore_error,
    store_lost_failure,
    timeout_failure,
)
from serialized_restore._coordination.placement import RankPlacement

CKPT = "/checkpoints/epoch=3.ckpt"
STAGE = "restore modules and callbacks"
REMOTE = "s3://bucket/epoch=3.ckpt"


def test_kinds_are_their_text():
    """A failure kind compares, prints and serializes as its text (records stay plain JSON), and text is accepted
    where a kind is expected; the kinds are exactly exception, timeout, store lost, store unresponsive and malformed
    report."""
    failure = RankFailure(1, 0, 1, STAGE, "timeout", "did not end its turn", reported_by=0)
    assert failure.kind is FailureKind.TIMEOUT and failure.kind == "timeout" and str(failure.kind) == "timeout"
    assert json.loads(failure.to_json())["kind"] == "timeout"
    assert {k.value for k in FailureKind} == {
        "exception",
        "timeout",
        "store lost",
        "store unresponsive",
        "malformed report",
    }
    with pytest.raises(ValueError):
        RankFailure(1, 0, 1, STAGE, "exploded", "?")


def test_records_round_trip_and_anything_else_is_refused_by_name():
    """``from_json`` gives back what ``to_json`` wrote and refuses, with the reason, anything that is not such a
    record: not JSON, not an object, unknown or missing fields, a wrong type, an unknown kind."""
    own = RankFailure(1, 0, 1, STAGE, "exception", "OSError: disk", traceback="...", error_types=("builtins:OSError",))
    assert RankFailure.from_json(own.to_json()) == own
    bad = {
        "{not json": "not JSON",
        "[1, 2]": "not an object",
        '{"global_rank": 1}': "missing fields",
        own.to_json().replace('"global_rank": 1', '"global_rank": "1"'): "'global_rank' is str",
        own.to_json().replace('"node_rank": 0', '"node_rank": true'): "'node_rank' is bool",
        own.to_json().replace('"exception"', '"exploded"'): "'exploded' is not a valid FailureKind",
    }
    for text, reason in bad.items():
        with pytest.raises(ValueError, match=reason):
            RankFailure.from_json(text)


def test_error_names_who_reported_and_survives_pickling():
    """A failure reported by another rank says so; the error pickles with its failures and its type."""
    timed_out = RankFailure(2, 0, 2, STAGE, "timeout", "did not end its turn", reported_by=3)
    own = RankFailure(
        1, 0, 1, STAGE, "exception", "OSError: disk", traceback="Traceback ...", error_types=("builtins:OSError",)
    )
    err = restore_error(CKPT, [own, timed_out], observed_on=0)
    assert isinstance(err, CheckpointRestoreError) and isinstance(err, OSError)
    assert err.failed_ranks == [1, 2] and err.stage == STAGE
    assert "(node 0, local rank 2, reported by rank 3), stage 'restore modules and callbacks': did not end" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err) and str(clone) == str(err) and clone.failures == err.failures


def test_the_error_type_keeps_every_original_type_it_can_name():
    """The error derives from the original types of every rank that raised, in rank order, as far as this process
    can name them; with no exception among the failures it is a ``RuntimeError``."""
    key = RankFailure(0, 0, 0, STAGE, "exception", "KeyError: 'x'", error_types=("builtins:KeyError",))
    unknown = RankFailure(1, 0, 1, STAGE, "exception", "E", error_types=("not_imported_anywhere:Error",))
    value = RankFailure(2, 0, 2, STAGE, "exception", "ValueError: y", error_types=("builtins:ValueError",))
    err = restore_error(CKPT, [value, unknown, key], observed_on=1)
    assert type(err).__name__ == "CheckpointRestoreError[KeyError, ValueError]"
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    died = restore_error(CKPT, [RankFailure(1, 0, 1, STAGE, "timeout", "stuck", reported_by=0)], observed_on=0)
    assert isinstance(died, RuntimeError) and str(died).startswith(f"Serialized restore of checkpoint {CKPT!r}")


def _raise_in_a_hook() -> None:
    raise ValueError("bad state")


def test_a_failure_is_one_line_of_the_message_and_keeps_its_traceback_in_the_record():
    """A rank's exception becomes a record with its type, message and full traceback; the error other ranks raise
    says it in one line, with no traceback and no frames of its own (a remote file: nothing to say of the file)."""
    try:
        _raise_in_a_hook()
    except ValueError as err:
        failure = failure_from_exception(RankPlacement(3, 4, 0, 3, 4), STAGE, err, REMOTE)
    assert (failure.global_rank, failure.kind, failure.error_types) == (3, "exception", ("builtins:ValueError",))
    assert failure.message == "ValueError: bad state"
    assert "Traceback (most recent call last)" in failure.traceback and "_raise_in_a_hook" in failure.traceback
    text = str(restore_error(REMOTE, [failure], observed_on=0))
    assert text == (
        f"Serialized restore of checkpoint {REMOTE!r} failed on rank(s) 3 in stage {STAGE!r} (node 0, local rank 3):"
        " ValueError: bad state"
    )


def test_a_timeout_names_the_likely_cause_of_its_stage():
    """A turn past the timeout says what its stage was doing: a download of a remote checkpoint is slower than the
    timeout (raise it), a reading turn may be stuck in a collective; both name the setting and its value."""
    observer = RankPlacement(1, 2, 0, 1, 2)
    fetch = timeout_failure(observer, "fetch checkpoint", 0, 30, "downloading the checkpoint")
    read = timeout_failure(observer, STAGE, 0, 30)
    assert (fetch.global_rank, fetch.local_rank, fetch.kind, fetch.reported_by) == (0, 0, FailureKind.TIMEOUT, 1)
    assert "did not finish downloading the checkpoint" in fetch.message and "collective" not in fetch.message
    assert "collective" in read.message and "downloading" not in read.message
    for failure in (fetch, read):
        assert "`SerializedLoading(turn_timeout=...)` (seconds, now 30)" in failure.message, failure.message


def test_store_lost_names_rank_zero_and_the_cause():
    """Without torchrun's agent store, a lost store blames global rank 0, which hosts it, as reported by the
    observer, and quotes the type and first line of the error that revealed the loss; with it, the agent."""
    failure = store_lost_failure(STAGE, 2, ConnectionResetError("Connection reset by peer\nmore"), agent=False)
    assert (failure.global_rank, failure.kind, failure.reported_by) == (0, "store lost", 2)
    assert "hosted by global rank 0" in failure.message
    assert "ConnectionResetError: Connection reset by peer)" in failure.message
    agent = store_lost_failure(STAGE, 2, ConnectionResetError("reset"), agent=True)
    assert agent.global_rank == 2 and "the launcher's agent (torchrun)" in agent.message
