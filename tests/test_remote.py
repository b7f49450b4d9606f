"""Remote checkpoints: fetched once per node from a real HTTP server on 127.0.0.1, removed after the restore."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serialized_restore._remote import NodeLocalCopy, ensure_free_space
from tests.conftest import run_ok
from tests.helpers.launch import run_job
from tests.test_restore import assert_training_state_equal

pytestmark = pytest.mark.timeout(300)


class _Server:
    """Serves one checkpoint file over HTTP; counts full downloads; can cut the body short."""

    def __init__(self, payload: bytes, truncate: bool = False) -> None:
        self.payload = payload
        self.truncate = truncate
        self.downloads = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _headers(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(server.payload)))
                self.end_headers()

            def do_HEAD(self) -> None:  # noqa: N802
                self._headers()

            def do_GET(self) -> None:  # noqa: N802
                if "Range" in self.headers:
                    self.send_error(416)
                    return
                self._headers()
                body = server.payload[: len(server.payload) // 2] if server.truncate else server.payload
                self.wfile.write(body)
                server.downloads += 1
                if server.truncate:
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/epoch1.ckpt"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fetch_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "fetched"
    directory.mkdir()
    yield directory


def test_remote_checkpoint_is_fetched_once_per_node(tmp_path: Path, reference: dict[str, Any], fetch_dir: Path) -> None:
    """2 ranks resume from an http:// checkpoint with one download; the local copy is gone afterwards."""
    with _Server(Path(reference["ckpt"]).read_bytes()) as server:
        result = run_ok(
            {
                "trainer": "ours",
                "serialized": True,
                "out": str(tmp_path / "job"),
                "max_epochs": 2,
                "ckpt_path": server.url,
            },
            env={"SERIALIZED_RESTORE_TMPDIR": str(fetch_dir)},
        )
        assert server.downloads == 1
    assert_training_state_equal(result.ranks, reference["uninterrupted"])
    assert list(fetch_dir.iterdir()) == []
    for rank, got in result.ranks.items():
        assert got["ckpt_path"] == server.url, f"rank {rank}"
        assert any("turn for 'fetch checkpoint' ended" in m for _, m in got["turn_log"]), f"rank {rank}"


def test_truncated_download_fails_on_every_rank_and_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], fetch_dir: Path
) -> None:
    """A download cut short raises CheckpointRestoreError on every rank and leaves no partial file."""
    with _Server(Path(reference["ckpt"]).read_bytes(), truncate=True) as server:
        result = run_job(
            {
                "trainer": "ours",
                "serialized": True,
                "out": str(tmp_path / "job"),
                "entry": "validate",
                "ckpt_path": server.url,
            },
            timeout=120,
            env={"SERIALIZED_RESTORE_TMPDIR": str(fetch_dir), "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT": "5"},
        )
    assert result.returncode != 0
    assert sorted(result.errors) == [0, 1], result.output[-4000:]
    for rank, error in result.errors.items():
        assert error["type"].startswith("CheckpointRestoreError["), f"rank {rank}: {error}"
        assert "fetch checkpoint" in error["message"] and server.url in error["message"], f"rank {rank}"
    assert list(fetch_dir.iterdir()) == []


def test_free_space_is_checked_before_fetching(tmp_path: Path) -> None:
    """A fetch that cannot fit says how much it needs, how much is free, and which setting to change."""
    with pytest.raises(OSError, match="SERIALIZED_RESTORE_TMPDIR") as info:
        ensure_free_space(str(tmp_path), 2**62)
    assert "needs" in str(info.value) and str(tmp_path) in str(info.value)


def test_local_copy_name_is_shared_by_a_node_and_unique_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one node agree on the copy's name; another node or another job gets another name."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    a, b = NodeLocalCopy("s3://b/x.ckpt", 0, "/d"), NodeLocalCopy("s3://b/x.ckpt", 0, "/d")
    assert a.path == b.path
    assert NodeLocalCopy("s3://b/x.ckpt", 1, "/d").path != a.path
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert NodeLocalCopy("s3://b/x.ckpt", 0, "/d").path != a.path
