"""A job's process tree: started in a session of its own, and killed as a whole.

Lightning's launcher (and ``torchrun``) start a job's other ranks as children of its first process, in the same
session; killing that session's process group ends every rank, whatever state it is in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

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


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (every rank it launched, whatever state they are in) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
