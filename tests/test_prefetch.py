"""``_restore/prefetch.py``: local rank 0 of each node reads a cold checkpoint into the page cache ahead of the restore,
once per node, and nothing where the file is in the cache already. Real files, their pages dropped with
``POSIX_FADV_DONTNEED`` and checked gone with ``mincore``; real 2-rank jobs."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks._cache import CacheError, drop_cached
from serialized_restore._files import resident_bytes
from serialized_restore._restore.prefetch import CHUNK, Prefetch
from tests.helpers.checks import assert_training_state_equal, run_ok

pytestmark = pytest.mark.timeout(400)
PREFETCHED = "into the page cache ahead of the restore"
LOG = logging.getLogger("serialized_restore.test.prefetch")


def _cold(path: Path) -> Path:
    """``path`` with none of its pages in the page cache (skips the test where the system cannot drop them)."""
    try:
        drop_cached(path)
    except CacheError:
        pytest.skip("the page cache keeps this file's pages: no cold file to read")
    return path


def _file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_a_cold_file_is_read_into_the_page_cache_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cold local file is read to its end on a thread of its own: afterwards every page is resident, and one line
    says how much was read and how long it took."""
    path = _cold(_file(tmp_path / "cold.ckpt", 3 * CHUNK + 12345))
    with caplog.at_level(logging.INFO, logger=LOG.name):
        prefetch = Prefetch.start(str(path), 3, LOG)
        assert prefetch is not None
        prefetch._thread.join(60)
    assert resident_bytes(str(path)) == path.stat().st_size
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("[rank 3] serialized restore: read 24.0 MiB of ") and PREFETCHED in line, line


def test_nothing_is_read_where_there_is_nothing_to_gain(tmp_path: Path) -> None:
    """A file already in the page cache, a missing one, a directory and a URL start no read."""
    warm = _file(tmp_path / "warm.ckpt", CHUNK)
    warm.read_bytes()
    for path in (warm, tmp_path / "missing.ckpt", tmp_path, "s3://bucket/last.ckpt"):
        assert Prefetch.start(str(path), 0, LOG) is None, path


def test_a_stopped_read_ends_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Stopped, the read ends after the chunk in flight and says how far it got."""
    path = _cold(_file(tmp_path / "big.ckpt", 64 * CHUNK))
    with caplog.at_level(logging.INFO, logger=LOG.name):
        prefetch = Prefetch.start(str(path), 0, LOG)
        assert prefetch is not None
        prefetch.stop()
    assert not prefetch._thread.is_alive()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(("[rank 0] serialized restore: stopped after ", "[rank 0] serialized restore: read ")), line


def _prefetch_lines(result: Any) -> list[str]:
    """The job's lines that say a rank read the checkpoint ahead (the read may end before a rank's log is captured:
    its console output holds every line)."""
    return [line for line in result.output.splitlines() if PREFETCHED in line]


@pytest.mark.parametrize("entry", ["fit", "validate"])
def test_a_cold_resume_is_prefetched_by_local_rank_zero_alone(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any], entry: str
) -> None:
    """A 2-rank job resuming from a checkpoint none of whose pages are cached: local rank 0 alone reads it ahead, the
    restore ends exactly as upstream's, and for validate (which needs only the weights, first in the file) the read
    ends with the first stage at the latest."""
    ckpt = _cold(Path(shutil.copy(reference["ckpt"], tmp_path / "cold.ckpt")))
    config = {"trainer": "ours", "serialized": True, "out": str(tmp_path / "job"), "ckpt_path": str(ckpt)}
    if entry == "fit":
        result = run_ok({**config, "max_epochs": 2})
        assert_training_state_equal(result.ranks, upstream_resume)
    else:
        result = run_ok({**config, "entry": "validate"})
    lines = _prefetch_lines(result)
    assert len(lines) == 1 and lines[0].startswith("[rank 0] serialized restore: "), lines
    if entry == "fit":
        assert resident_bytes(str(ckpt)) == ckpt.stat().st_size


def test_a_warm_resume_reads_nothing_ahead(tmp_path: Path, reference: dict[str, Any]) -> None:
    """With the checkpoint in the page cache already, no rank reads it ahead."""
    ckpt = Path(shutil.copy(reference["ckpt"], tmp_path / "warm.ckpt"))
    ckpt.read_bytes()
    result = run_ok({"trainer": "ours", "serialized": True, "out": str(tmp_path / "job"), "ckpt_path": str(ckpt)})
    assert _prefetch_lines(result) == []
