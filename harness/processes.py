"""A job's process tree: started in a session of its own, and killed as a whole.

Lightning's launcher (and ``torchrun``) start a job's other ranks as children of its first process, in the same
session; killing that session's process group ends every rank, whatever state it is in."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Callable, NoReturn, Optional, Union

REPO = Path(__file__).resolve().parents[1]


def job_env(extra: Optional[dict[str, str]] = None, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``base`` (the environment by default) with this checkout first on ``PYTHONPATH``, one OpenMP thread per rank
    (the ranks share a few cores) and ``extra`` on top."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH", "")]))
    return {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


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
