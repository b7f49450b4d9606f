"""A job's process tree: started in a session of its own, waited for, and killed as a whole.

Lightning's launcher (and ``torchrun``) start a job's other ranks as children of its first process, in the same
session; killing that session's process group ends every rank, whatever state it is in. The tests, the demo and the
benchmarks run their jobs through here."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Callable, NoReturn, Optional, Union

REPO = Path(__file__).resolve().parents[1]
RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")
_PR_SET_CHILD_SUBREAPER = 36


def job_env(extra: Optional[dict[str, str]] = None, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``base`` (the environment by default) with this checkout first on ``PYTHONPATH``, one OpenMP thread per rank
    (the ranks share a few cores) and ``extra`` on top."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH", "")]))
    return {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def free_port() -> int:
    """A TCP port that is free now, for one job's ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_job_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``job_env`` for a job of its own on this host: a free ``MASTER_PORT`` on 127.0.0.1, and neither the rank
    variables nor the ``SERIALIZED_RESTORE_*`` settings of a job this process may itself run in."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SERIALIZED_RESTORE_") and k not in RANK_VARIABLES}
    own = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}
    return job_env({**own, **(extra or {})}, base=base)


def start_job(
    script: Path,
    config: dict[str, Any],
    *,
    cwd: Path,
    env: dict[str, str],
    stdout: Union[int, IO[Any], None],
    argv: Optional[list[str]] = None,
    preexec_fn: Optional[Callable[[], None]] = None,
    text: bool = False,
) -> subprocess.Popen:
    """Start ``python [argv...] script '<config as JSON>'`` as the first process of a new session."""
    return subprocess.Popen(
        [sys.executable, *(argv or []), str(script), json.dumps(config)],
        cwd=cwd,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=text,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def end_process_group() -> None:
    """As a training script ends (and as Lightning's own tests do between tests): the default process group's threads
    stop here, not in the interpreter's teardown, where torch's gloo group can abort the process ("terminate called
    without an active exception", pytorch/pytorch#190489)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_finished_rank() -> NoReturn:
    """End a test job's rank once its work is done and its results are written: the process group ends
    (``end_process_group``), the exit handlers run and output is flushed as at any exit, and the exit status is 0, but
    the interpreter's finalization is skipped. With torch and
    Lightning imported that finalization costs about 1 s of CPU per process (mostly collecting the objects of
    thousands of modules), and the suite starts hundreds of ranks. Not for jobs whose claim is about how a process
    ends, or what it prints while it does (failures, launchers, log parity, the benchmarks' jobs)."""
    end_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (every rank it launched, whatever state they are in) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextlib.contextmanager
def job_session(
    script: Path,
    config: dict[str, Any],
    *,
    cwd: Path,
    env: dict[str, str],
    log: Path,
    preexec_fn: Optional[Callable[[], None]] = None,
) -> Iterator[subprocess.Popen]:
    """``start_job`` with its output in ``log``; on leaving, whatever happened, the job's whole session is killed
    (``kill_job``): no rank is ever left behind."""
    with open(log, "w") as out:
        proc = start_job(script, config, cwd=cwd, env=env, stdout=out, preexec_fn=preexec_fn)
        try:
            yield proc
        finally:
            kill_job(proc)


def _child_subreaper(on: bool) -> bool:
    """Make this process adopt its orphaned descendants (Linux ``prctl``); whether that took effect."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def run_to_exit(
    script: Path, config: dict[str, Any], *, cwd: Path, env: dict[str, str], log: Path, ranks: int, timeout: float
) -> tuple[Optional[int], dict[int, tuple[float, Any]], float]:
    """Run a job of ``ranks`` processes to the exit of its last one, as a child subreaper: the ranks its first
    process launched become this process's children when it exits, so each one's exit is seen when it happens and its
    resource usage (``wait4``: CPU time to the very end, the interpreter's shutdown included) is read when it is
    reaped. The ranks are looked for every 0.5 s until all are known; exits are polled every 5 ms. Returns the first
    process's exit status (None: not every process exited within ``timeout``); for every process seen to exit,
    ``pid -> (seconds from the start to its exit, its rusage or None where it was not reaped here)``; and the start
    (``time.time()``)."""
    import psutil

    adopted = _child_subreaper(True)
    gone: dict[int, tuple[float, Any]] = {}
    known: set[int] = set()
    returncode: Optional[int] = None
    wall_started, started = time.time(), time.monotonic()
    try:
        with job_session(script, config, cwd=cwd, env=env, log=log) as proc:
            scanned = started - 0.5
            while time.monotonic() < started + timeout and not (proc.pid in gone and known <= gone.keys()):
                if proc.pid not in gone and len(known) < ranks - 1 and time.monotonic() - scanned >= 0.5:
                    scanned = time.monotonic()
                    with contextlib.suppress(psutil.NoSuchProcess):
                        known.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
                for pid in [pid for pid in [proc.pid, *known] if pid not in gone]:
                    try:
                        reaped, status, rusage = os.wait4(pid, os.WNOHANG)
                    except ChildProcessError:  # rank 0's child while it lives; reaped elsewhere; no subreaper
                        if proc.pid in gone and not _alive(pid):
                            gone[pid] = (time.monotonic() - started, None)
                        continue
                    if reaped:
                        gone[pid] = (time.monotonic() - started, rusage)
                        if pid == proc.pid:
                            returncode = proc.returncode = os.waitstatus_to_exitcode(status)
                time.sleep(0.005)
    finally:
        if adopted:
            _child_subreaper(False)
            for pid in known - gone.keys():  # killed stragglers, adopted: leave no zombie behind
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    return (returncode if known <= gone.keys() else None), gone, wall_started


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has exited)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session_processes(session: int) -> list[int]:
    """The processes of session ``session`` (a job started with ``start_job``: its first process's id), whatever state
    they are in (a stopped process counts; a zombie, which holds nothing but its exit status, does not)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            found.append(int(entry))
    return found


def file_mappings(path: Optional[str] = None) -> list[tuple[int, int]]:
    """Address ranges of this process that map a file (``/proc/self/maps`` lines with an inode), or only the file at
    ``path``."""
    target = os.path.realpath(path) if path is not None else None
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0":
                continue
            if target is None or os.path.realpath(fields[5].strip()) == target:
                start, end = fields[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def in_mappings(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in ranges)
