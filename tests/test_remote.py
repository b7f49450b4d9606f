"""Remote checkpoints: fetched once per node from a real HTTP server on 127.0.0.1 into a private directory, removed
after the restore; what is created in the download directory is watched while the job runs."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.processes import job_env, kill_job, start_job
from serialized_restore._restore.remote import (
    FILE_NAME,
    PREFIX,
    NodeLocalCopy,
    check_fetch_directory,
    ensure_free_space,
)
from tests.helpers.checks import JOB_TIMEOUT, assert_training_state_equal, run_ok
from tests.helpers.launch import JOB, run_job

pytestmark = pytest.mark.timeout(300)

PER_RANK_ENV_JOB = Path(__file__).parent / "helpers" / "per_rank_env_job.py"


class _Server:
    """Serves one checkpoint file over HTTP; counts requests and full downloads; can cut the body short, after
    ``stall`` seconds."""

    def __init__(self, payload: bytes, truncate: bool = False, stall: float = 0.0) -> None:
        self.payload = payload
        self.truncate = truncate
        self.requests = 0
        self.downloads = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _headers(self) -> None:
                server.requests += 1
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
                self.wfile.flush()
                time.sleep(stall)
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


class _Watcher:
    """Records every file, directory and link that appears under ``root`` while it runs (polled every 2 ms): for each
    path relative to ``root``, every (kind, mode, owner) it was seen with."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, set[tuple[str, int, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            time.sleep(0.002)
        self._scan()

    def _scan(self) -> None:
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
                self.seen.setdefault(os.path.relpath(path, self.root), set()).add(
                    (kind, stat.S_IMODE(st.st_mode), st.st_uid)
                )


def _assert_private(seen: dict[str, set[tuple[str, int, int]]], not_named: tuple[str, ...] = ()) -> list[str]:
    """Everything seen is a directory ``serialized-restore-*`` (0700, ours) holding one file (0600, ours), none named
    as in ``not_named``; returns the directories' names."""
    uid = os.geteuid()
    directories = sorted(path for path in seen if os.sep not in path)
    for name in directories:
        assert seen[name] == {("dir", 0o700, uid)}, (name, seen[name])
        assert name.startswith(PREFIX) and name not in not_named and not any(n in name for n in not_named), name
    for path, observed in seen.items():
        if os.sep in path:
            parent, _, leaf = path.partition(os.sep)
            assert parent in directories and leaf == FILE_NAME, path
            assert observed == {("file", 0o600, uid)}, (path, observed)
    return directories


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _predictable_name(url: str, port: int, node: int = 0) -> str:
    """The name earlier versions gave the local copy, derivable by anyone who knows the URL and the port."""
    digest = hashlib.sha1(f"{url}|127.0.0.1:{port}|{node}".encode()).hexdigest()[:16]
    return f"serialized-restore-{digest}.ckpt"


@pytest.fixture
def fetch_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "fetched"
    directory.mkdir(mode=0o755)
    yield directory


def _validate_job(tmp_path: Path, url: str) -> dict[str, Any]:
    """The config of a 2-rank job that validates from ``url`` with the option on."""
    return {"trainer": "ours", "serialized": True, "out": str(tmp_path / "job"), "entry": "validate", "ckpt_path": url}


def _env(fetch_dir: Path, port: int, **extra: str) -> dict[str, str]:
    return {
        "SERIALIZED_RESTORE_TMPDIR": str(fetch_dir),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **extra,
    }


def test_remote_checkpoint_is_fetched_once_per_node_into_a_private_directory(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any], fetch_dir: Path
) -> None:
    """2 ranks resume from an http:// checkpoint, then validate from it: one download per restore, each into a
    directory of its own that only this user can enter, with a name nobody can predict; the copy is 0600; nothing is
    left afterwards. A file, a symbolic link to a victim file and a '.partial' planted at the name earlier versions
    used are neither read, followed, changed nor removed."""
    port = _free_port()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not a checkpoint")
    with _Server(Path(reference["ckpt"]).read_bytes()) as server:
        old = fetch_dir / _predictable_name(server.url, port)
        old.symlink_to(victim)
        Path(f"{old}.partial").write_bytes(b"planted partial")
        planted = {old.name, f"{old.name}.partial"}
        with _Watcher(fetch_dir) as watcher:
            result = run_ok(
                {
                    "trainer": "ours",
                    "serialized": True,
                    "out": str(tmp_path / "job"),
                    "max_epochs": 2,
                    "calls": [["fit", server.url], ["validate", server.url]],
                },
                env=_env(fetch_dir, port),
            )
        assert server.downloads == 2  # once per restore: per rank, it would be 4
    fit = {rank: got["history"][0] for rank, got in result.ranks.items()}
    assert_training_state_equal(fit, upstream_resume)
    assert victim.read_bytes() == b"not a checkpoint"
    assert os.readlink(old) == str(victim) and Path(f"{old}.partial").read_bytes() == b"planted partial"
    assert sorted(p.name for p in fetch_dir.iterdir()) == sorted(planted)  # nothing else is left
    fresh = {path: seen for path, seen in watcher.seen.items() if path not in planted}
    assert any(path.endswith(FILE_NAME) for path in fresh), fresh  # the copies were seen, private
    not_named = (old.name, old.name[len(PREFIX) : -len(".ckpt")])
    assert len(_assert_private(fresh, not_named=not_named)) == 2  # one new directory per restore
    for rank, got in result.ranks.items():
        assert [call["ckpt_path"] for call in got["history"]] == [server.url] * 2, f"rank {rank}"
        for call in got["history"]:
            # local rank 0 fetched (an exchange, not logged as turns); every rank checked the copy in its turn
            fetched = any("serialized restore: fetched" in m and server.url in m for _, m in call["turn_log"])
            assert fetched == (rank == 0), f"rank {rank}"
            assert any("turn for 'check local copy' ended" in m for _, m in call["turn_log"]), f"rank {rank}"


def test_truncated_download_fails_on_every_rank_and_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], fetch_dir: Path
) -> None:
    """A download cut short raises on every rank (rank 0, which fetched, its own error; rank 1 a
    CheckpointRestoreError naming it); while it ran, only a private directory and
    file existed, and afterwards nothing is left."""
    with _Server(Path(reference["ckpt"]).read_bytes(), truncate=True, stall=1.0) as server:
        with _Watcher(fetch_dir) as watcher:
            result = run_job(
                _validate_job(tmp_path, server.url),
                timeout=JOB_TIMEOUT,
                env=_env(fetch_dir, _free_port()),
            )
    assert result.returncode != 0
    assert sorted(result.errors) == [0, 1], result.output[-4000:]
    # rank 0, which fetched, raises its own error; rank 1 names it
    assert not result.errors[0]["type"].startswith("CheckpointRestoreError"), result.errors[0]
    error = result.errors[1]
    assert error["type"].startswith("CheckpointRestoreError"), error
    assert "fetch checkpoint" in error["message"] and server.url in error["message"], error
    # the download stalled for a second halfway: the watcher saw the directory and the partial file, both private
    assert len(_assert_private(watcher.seen)) == 1 and len(watcher.seen) == 2, watcher.seen
    assert list(fetch_dir.iterdir()) == []


def test_ctrl_c_while_waiting_removes_the_node_local_copy(tmp_path: Path, reference: dict[str, Any], fetch_dir: Path):
    """SIGINT to rank 0 (the first process, which fetched the copy) while it waits for rank 1's turn to end: it raises
    `KeyboardInterrupt` through the process's own handler, the job ends, and the node-local copy is gone: the exit
    handlers ran (a SIGINT that killed the process outright would have left it)."""
    # one rank at a time (k = 1), so that rank 0 waits while rank 1 takes its turn
    config = {**_validate_job(tmp_path, ""), "serialized": 1, "hook_sleep": 3.0}
    output = tmp_path / "output.txt"
    with _Server(Path(reference["ckpt"]).read_bytes()) as server:
        config["ckpt_path"] = server.url
        (tmp_path / "job").mkdir()
        env = job_env(_env(fetch_dir, _free_port()))
        with open(output, "w") as out:
            proc = start_job(JOB, config, cwd=tmp_path / "job", env=env, stdout=out)
        try:
            waiting = "[rank 1] serialized restore: turn for 'restore modules and callbacks' started"
            deadline = time.monotonic() + JOB_TIMEOUT
            while waiting not in output.read_text() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert waiting in output.read_text(), output.read_text()[-4000:]
            assert any(fetch_dir.iterdir())  # the copy is there, while rank 1 reads it
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            kill_job(proc)
    assert proc.returncode != 0
    # Lightning's own handler turns the KeyboardInterrupt into `sys.exit(1)`, after killing the other rank
    error = json.loads((tmp_path / "job" / "rank0.error.json").read_text())
    assert error["type"] == "SystemExit" and "KeyboardInterrupt" in error["traceback"], error
    assert list(fetch_dir.iterdir()) == [], list(fetch_dir.iterdir())


def test_a_rank_that_refuses_the_announced_copy_ends_the_restore_on_every_rank(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Local rank 1 looks for the copy in another directory than local rank 0 put it in (as if the store had been
    written to by someone else): it refuses the path, and every rank raises the same error instead of waiting."""
    dirs = {rank: tmp_path / f"fetched{rank}" for rank in (0, 1)}
    for directory in dirs.values():
        directory.mkdir(mode=0o700)
    with _Server(Path(reference["ckpt"]).read_bytes()) as server:
        result = run_job(
            {
                **_validate_job(tmp_path, server.url),
                "env_by_local_rank": {str(r): {"SERIALIZED_RESTORE_TMPDIR": str(d)} for r, d in dirs.items()},
            },
            timeout=JOB_TIMEOUT,
            env={},
            script=PER_RANK_ENV_JOB,
        )
    assert result.returncode != 0
    assert sorted(result.errors) == [0, 1], result.output[-4000:]
    for rank, error in result.errors.items():
        # rank 1 refused it and raises its own PermissionError; rank 0 names rank 1
        expected = "PermissionError" if rank == 1 else "CheckpointRestoreError[PermissionError]"
        assert error["type"] == expected, f"rank {rank}: {error}"
        message = error["message"]
        if rank == 0:
            assert "failed on rank(s) 1 in stage 'check local copy'" in message, f"rank {rank}: {message}"
        assert f"inside {str(dirs[1])!r}" in message and "not authenticated" in message, f"rank {rank}: {message}"
        assert error["elapsed"] < 60, f"rank {rank}: {error['elapsed']}"
    assert list(dirs[0].iterdir()) == [] and list(dirs[1].iterdir()) == []


# ------------------------------------------------------------------ one process, no Trainer


def test_each_fetch_gets_a_fresh_private_directory(tmp_path: Path) -> None:
    """Two fetches of the same URL into the same directory: two directories with unrelated names, 0700, each with the
    copy 0600; removing one removes its directory and nothing else."""
    with _Server(b"checkpoint bytes" * 1000) as server:
        first, second = NodeLocalCopy(server.url, str(tmp_path)), NodeLocalCopy(server.url, str(tmp_path))
        paths = [json.loads(copy.fetch())["path"] for copy in (first, second)]
    assert paths[0] != paths[1] and {os.path.dirname(os.path.dirname(p)) for p in paths} == {str(tmp_path)}
    for path in paths:
        assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600 and Path(path).read_bytes() == b"checkpoint bytes" * 1000
    first.remove()
    assert not os.path.lexists(os.path.dirname(paths[0])) and os.path.exists(paths[1])
    second.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_fetch_in_one_process_raises_the_original_error_and_leaves_nothing(tmp_path: Path) -> None:
    """Without a store the download's own exception propagates; the private directory is gone with it."""
    with _Server(b"x" * 100_000, truncate=True) as server:
        with pytest.raises(Exception) as info:
            NodeLocalCopy(server.url, str(tmp_path)).fetch()
    assert "CheckpointRestoreError" not in type(info.value).__name__
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("mode", "refused"),
    [(0o700, False), (0o755, False), (0o1777, False), (0o1770, False), (0o777, True), (0o770, True), (0o703, True)],
)
def test_download_directory_permissions(tmp_path: Path, mode: int, refused: bool) -> None:
    """Writable by group or others is refused unless the sticky bit is set (as on /tmp), naming the directory."""
    directory = tmp_path / "d"
    directory.mkdir()
    directory.chmod(mode)
    if refused:
        with pytest.raises(PermissionError, match=r"SerializedLoading\(tmpdir=\.\.\.\)") as info:
            check_fetch_directory(str(directory))
        assert str(directory) in str(info.value) and f"{mode:04o}" in str(info.value)
    else:
        check_fetch_directory(str(directory))


def test_a_missing_or_non_directory_download_directory_is_named(tmp_path: Path) -> None:
    """A download directory that does not exist raises ``FileNotFoundError``, and a file in its place
    ``NotADirectoryError``, each with a message saying which."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_fetch_directory(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        check_fetch_directory(str(tmp_path / "file"))


def _announced(tmp_path: Path, server: _Server) -> tuple[NodeLocalCopy, dict[str, Any]]:
    fetcher = NodeLocalCopy(server.url, str(tmp_path))
    return fetcher, json.loads(fetcher.fetch())


def test_the_announced_copy_is_checked_before_it_is_read(tmp_path: Path) -> None:
    """What the node's other ranks receive through the store is plain JSON naming a file in a private directory of
    this user inside the download directory; anything else is refused with a message saying why, and no file is
    changed."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "secret").write_text("s")
    with _Server(b"y" * 5000) as server:
        fetcher, decision = _announced(tmp_path, server)
        path = decision["path"]
        reader = NodeLocalCopy(server.url, str(tmp_path))
        reader.adopt(json.dumps(decision))
        assert reader.checked_path() == path
        refusals = [
            ("not JSON", "\x80\x04\x95 a pickle?"),
            ('not {"path"', json.dumps([path, 5000])),
            ('not {"path"', json.dumps({**decision, "extra": 1})),
            ('not {"path"', json.dumps({**decision, "size": "5000"})),
            ("serialized-restore-* inside", json.dumps({**decision, "path": str(other / "secret")})),
            ("serialized-restore-* inside", json.dumps({**decision, "path": path.replace(FILE_NAME, "../other/x")})),
            ("it has 5000 bytes, not 4", json.dumps({**decision, "size": 4})),
        ]
        for expected, announced in refusals:
            with pytest.raises((ValueError, PermissionError), match="Refusing") as info:
                NodeLocalCopy(server.url, str(tmp_path)).adopt(announced)
            assert expected in str(info.value) and "not authenticated" in str(info.value), str(info.value)
        # a directory that is a symbolic link to the private one, or one that others can enter
        link = tmp_path / f"{PREFIX}link"
        link.symlink_to(os.path.dirname(path))
        with pytest.raises(PermissionError, match=r"not a directory \(a symbolic link\?\)"):
            NodeLocalCopy(server.url, str(tmp_path)).adopt(json.dumps({**decision, "path": str(link / FILE_NAME)}))
        os.chmod(os.path.dirname(path), 0o755)
        with pytest.raises(PermissionError, match="its directory has mode 0755, not 0700"):
            reader.checked_path()  # checked again before each read
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="it has mode 0644"):
            reader.checked_path()
        fetcher.remove()
    assert (other / "secret").read_text() == "s" and sorted(p.name for p in tmp_path.iterdir()) == ["other", link.name]


def test_free_space_is_checked_before_fetching(tmp_path: Path) -> None:
    """A fetch that cannot fit says how much it needs, how much is free, and which setting to change."""
    with pytest.raises(OSError, match=r"SerializedLoading\(tmpdir=\.\.\.\)") as info:
        ensure_free_space(str(tmp_path), 2**62)
    assert "needs" in str(info.value) and str(tmp_path) in str(info.value)
