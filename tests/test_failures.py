"""Failed restores end the same way on every rank, in bounded time, and lose nothing.

Real multi-process Lightning jobs (gloo on CPU, the Trainer's own ``ddp`` and ``ddp_spawn`` launchers) run
``tests/helpers/failing_job.py``, which injects one fault per case and writes every rank's outcome. Timeouts are short
here (``FAST``) so that a case that should end at a bound ends within seconds; each job also has a hard timeout that
kills its whole process group. Every test prints a ``TIMING`` line: the seconds from the fault to the end of the last
rank, and to the end of the whole job (processes gone), as reported in ``docs/failures.md``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from harness.models import make_model_class
from harness.processes import job_env, kill_job, session_processes, start_job
from tests.helpers import launch

FAILING_JOB = Path(__file__).with_name("helpers") / "failing_job.py"
TURN_TIMEOUT = 8.0
FAST = {"SERIALIZED_RESTORE_TURN_TIMEOUT": str(TURN_TIMEOUT)}
STAGE_1 = "restore modules and callbacks"
STAGE_2 = "restore training state"
# how long after a fault every rank must have ended, for a failure that is seen at once
PROMPT = 3.0


# ----------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def trained_checkpoint(reference: dict[str, Any]) -> Path:
    """The shared 1-epoch checkpoint written by upstream Lightning (``conftest.py``); never modified."""
    return Path(reference["ckpt"])


@pytest.fixture()
def checkpoint_dir(tmp_path: Path, trained_checkpoint: Path) -> Path:
    """A checkpoint directory as ``ModelCheckpoint`` leaves it: two checkpoints and ``last.ckpt``."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    data = trained_checkpoint.read_bytes()
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"):
        (directory / name).write_bytes(data)
    return directory


def _snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``directory``: size, modification time and content hash."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns, _sha256(path))
        for path in sorted(directory.rglob("*"))
        if path.is_file() or path.is_symlink()
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else f"-> {os.readlink(path)}"


class Run:
    """One job's return code, output and end time, and per case every rank's outcome and the fault's time."""

    def __init__(self, result: launch.JobResult, ended: float, out: Path, cases: list[dict[str, Any]]) -> None:
        self.returncode = result.returncode
        self.output = result.output
        self.ended = ended
        self.cases: dict[str, dict[str, Any]] = {}
        for case in cases:
            directory = out / case["name"]
            fault = directory / "fault.json"
            self.cases[case["name"]] = {
                "ranks": {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))},
                "fault": json.loads(fault.read_text()) if fault.exists() else None,
            }

    def ranks(self, case: str) -> dict[int, dict[str, Any]]:
        return self.cases[case]["ranks"]

    def fault_at(self, case: str) -> float:
        fault = self.cases[case]["fault"]
        assert fault is not None, f"the fault of {case!r} was never injected"
        return float(fault["at"])

    def timing(self, case: str, bound: float, start: Optional[float] = None) -> float:
        """Print and return the seconds from the fault (or ``start``) to the end of the last rank that ended.

        For a job of one case, also print the seconds until the job's processes were all gone.
        """
        origin = self.fault_at(case) if start is None else start
        ranks = self.ranks(case)
        last = max(o["ended_at"] for o in ranks.values()) - origin if ranks else float("nan")
        each = ", ".join(f"{r}: {o['ended_at'] - origin:.2f}s" for r, o in sorted(ranks.items())) or "none"
        job = f", job ended {self.ended - origin:.2f}s" if len(self.cases) == 1 else ""
        print(f"TIMING {case}: last rank ended {last:.2f}s ({each}){job}, bound {bound:g}s")
        return last


def _run(
    tmp_path: Path,
    cases: list[dict[str, Any]],
    *,
    strategy: str = "ddp",
    devices: int = 2,
    timeout: float = 150.0,
    continue_after_failure: bool = False,
    env: Optional[dict[str, str]] = None,
    serialized: Any = True,
) -> Run:
    """Run ``failing_job.py`` with the Trainer's own launcher; kill its process group after ``timeout`` seconds.
    ``serialized``: the option's value (``1``: one rank at a time also where the file is memory-mapped)."""
    out = tmp_path / "job"
    config = {
        "out": str(out),
        "strategy": strategy,
        "devices": devices,
        "cases": cases,
        "continue_after_failure": continue_after_failure,
        "serialized": serialized,
    }
    result = launch.run_job(config, timeout=timeout, env={**FAST, **(env or {})}, script=FAILING_JOB)
    return Run(result, time.time(), out, cases)


def _assert_raised_on_every_rank(
    run: Run,
    case: str,
    world: int,
    failed: list[int],
    path: str,
    stage: str,
    *fragments: str,
    own: Optional[str] = None,
) -> None:
    """Every rank raised CheckpointRestoreError naming ``failed``, ``path`` and ``stage``, with ``fragments``; with
    ``own``, the failing rank raised its own exception of that type instead, unchanged."""
    ranks = run.ranks(case)
    assert sorted(ranks) == list(range(world)), (case, sorted(ranks), run.output[-4000:])
    for rank, outcome in ranks.items():
        if own is not None and rank in failed:
            assert outcome["type"] == own and outcome["failed_ranks"] is None, (case, rank, outcome)
            continue
        assert outcome["type"].startswith("CheckpointRestoreError["), (case, rank, outcome)
        assert outcome["failed_ranks"] == failed, (case, rank, outcome["message"])
        message = outcome["message"]
        assert f"Serialized restore of checkpoint {path!r} failed on rank(s) {', '.join(map(str, failed))}" in message
        assert f"stage {stage!r}" in message
        for fragment in fragments:
            assert fragment in message, (case, rank, fragment, message)


# ------------------------------------------------------------------------------------- an exception on one rank


@pytest.mark.timeout(200)
def test_an_exception_on_one_rank_is_raised_on_every_rank(tmp_path, checkpoint_dir):
    """An exception on rank 0, a middle or the last rank, in either stage, ends every rank with one error at once;
    and ``ModelCheckpoint(save_on_exception=True)`` and ``OnExceptionCheckpoint``, which the stage-2 case adds, save
    no half-restored model: the checkpoint directory is left as it was."""
    before = _snapshot(checkpoint_dir)
    ckpt = str(checkpoint_dir / "last.ckpt")
    cases = [
        {"name": "rank 0, on_load_checkpoint", "fault": {"rank": 0, "in": "module_hook"}},
        {"name": "middle rank, strict key mismatch", "fault": {"rank": 1, "in": "strict_mismatch"}},
        {"name": "last rank, callback load_state_dict", "fault": {"rank": 2, "in": "callback_load_state_dict"}},
        {
            "name": "middle rank, optimizer state (stage 2)",
            "fault": {"rank": 1, "in": "optimizer_state"},
            "checkpoint_dir": str(checkpoint_dir),
        },
        {"name": "no fault afterwards", "max_epochs": 2},
    ]
    for case in cases:
        case["ckpt_path"] = ckpt
    run = _run(tmp_path, cases, devices=3, continue_after_failure=True, timeout=180)
    assert run.returncode == 0, run.output[-4000:]
    expected = [
        (0, STAGE_1, "RuntimeError: injected failure in module_hook on rank 0", "RuntimeError"),
        (1, STAGE_1, "Missing key(s) in state_dict", "RuntimeError"),
        (2, STAGE_1, "RuntimeError: injected failure in callback_load_state_dict on rank 2", "RuntimeError"),
        (1, STAGE_2, "ValueError: loaded state dict has a different number of parameter groups", "ValueError"),
    ]
    for case, (failed, stage, message, own) in zip(cases, expected):
        name = case["name"]
        fragments = (message,)
        _assert_raised_on_every_rank(run, name, 3, [failed], ckpt, stage, *fragments, own=own)
        for rank, outcome in run.ranks(name).items():
            # one traceback per rank, nothing chained: the failing rank's own exception, the others' error
            assert outcome["traceback"].count("Traceback") == 1 and outcome["cause_type"] is None, (name, rank)
            assert outcome["context_type"] is None, (name, rank, outcome["cause"])
        assert run.timing(name, bound=PROMPT) < PROMPT
    # the process group is still usable, and the checkpoint still restores
    assert all(o["ok"] for o in run.ranks("no fault afterwards").values())
    assert sorted(run.ranks("no fault afterwards")) == [0, 1, 2]
    assert _snapshot(checkpoint_dir) == before


@pytest.mark.timeout(200)
def test_an_exception_on_one_rank_ends_a_ddp_spawn_job(tmp_path, checkpoint_dir):
    """With ``ddp_spawn``, every worker writes the same error before the launcher terminates the others."""
    before = _snapshot(checkpoint_dir)
    ckpt = str(checkpoint_dir / "last.ckpt")
    cases = [{"name": "ddp_spawn, last rank raises", "ckpt_path": ckpt, "fault": {"rank": 1, "in": "module_hook"}}]
    run = _run(tmp_path, cases, strategy="ddp_spawn", timeout=180)
    assert run.returncode != 0
    name = cases[0]["name"]
    fragment = "injected failure in module_hook on rank 1"
    _assert_raised_on_every_rank(run, name, 2, [1], ckpt, STAGE_1, fragment, own="RuntimeError")
    assert "ProcessRaisedException" in run.output
    assert run.timing(name, bound=PROMPT) < PROMPT
    assert run.ended - run.fault_at(name) < 30
    assert _snapshot(checkpoint_dir) == before


# ------------------------------------------------------------------------------------------------- a dead rank


def _assert_dead_rank_reported(run: Run, name: str, world: int, dead: int, fragments: tuple[str, ...]) -> None:
    """Each surviving rank raised naming the dead rank, or was ended by the launcher once the dead rank was gone."""
    ranks = run.ranks(name)
    assert dead not in ranks
    for rank in set(range(world)) - {dead}:
        outcome = ranks.get(rank)
        if outcome is None:
            # the launcher got there first: Lightning's process observer, or torch.multiprocessing's join
            assert "Forcefully terminating all other processes" in run.output or "ProcessExitedException" in run.output
            continue
        assert outcome["type"].startswith("CheckpointRestoreError["), outcome
        assert outcome["failed_ranks"] == [dead], outcome["message"]
        for fragment in fragments:
            assert fragment in outcome["message"], (rank, fragment, outcome["message"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("strategy", "devices"), [("ddp", 3), ("ddp_spawn", 2)])
def test_a_rank_killed_in_its_turn_ends_the_job(tmp_path, checkpoint_dir, strategy, devices):
    """Rank 1 SIGKILLed in its turn ends the job as upstream's launchers end it (Lightning's process observer with
    ``ddp``, ``torch.multiprocessing`` at once with ``ddp_spawn``), and no rank waits past the turn timeout: its
    successor names it then."""
    before = _snapshot(checkpoint_dir)
    name = f"{strategy}, rank 1 killed"
    cases = [{"name": name, "ckpt_path": str(checkpoint_dir / "last.ckpt"), "fault": {"rank": 1, "in": "kill"}}]
    run = _run(tmp_path, cases, strategy=strategy, devices=devices, timeout=180)
    fragments = ("rank(s) 1 in stage", "did not end its turn", "`SerializedLoading(turn_timeout=...)`")
    _assert_dead_rank_reported(run, name, devices, 1, fragments)
    if strategy == "ddp_spawn":
        assert run.returncode != 0
        assert "ProcessExitedException" in run.output and "SIGKILL" in run.output
    if run.ranks(name):
        assert run.timing(name, bound=TURN_TIMEOUT) < TURN_TIMEOUT + PROMPT
    assert run.ended - run.fault_at(name) < 30
    assert _snapshot(checkpoint_dir) == before


@pytest.mark.timeout(150)
def test_rank_zero_killed_in_its_turn_ends_a_ddp_job(tmp_path, checkpoint_dir):
    """Killing rank 0, which hosts the store, ends every other rank at once with an error naming rank 0."""
    before = _snapshot(checkpoint_dir)
    ckpt = str(checkpoint_dir / "last.ckpt")
    name = "ddp, rank 0 killed"
    run = _run(tmp_path, [{"name": name, "ckpt_path": ckpt, "fault": {"rank": 0, "in": "kill"}}])
    ranks = run.ranks(name)
    assert sorted(ranks) == [1], run.output[-4000:]
    assert ranks[1]["failed_ranks"] == [0] and ranks[1]["kinds"] == ["store lost"]
    assert "lost contact with the process group's store, which is hosted by global rank 0" in ranks[1]["message"]
    assert run.timing(name, bound=PROMPT) < PROMPT
    assert run.ended - run.fault_at(name) < 30
    assert _snapshot(checkpoint_dir) == before


# ------------------------------------------------------------------------------------------- a turn that hangs


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("fault", "failed"),
    [
        ({"rank": 1, "in": "sleep", "seconds": 6.5}, 1),
        ({"rank": 1, "in": "stop"}, 1),
        ({"rank": "all", "in": "collective"}, 0),
    ],
    ids=["slow turn on the last rank", "last rank stopped (SIGSTOP)", "broadcast in on_load_checkpoint"],
)
def test_a_turn_past_the_timeout_names_the_setting_and_the_cause(tmp_path, checkpoint_dir, fault, failed):
    """A turn longer than the 4 s turn timeout (a slow last turn, timed by the rank before it; a rank stopped in its
    turn; a ``broadcast`` in a hook, which cannot complete in turns) ends the waiting rank at the bound with an error
    naming the rank in its turn, the setting and both likely causes; a stuck rank that can still run prints its stack
    then; the job's main process ends, non-zero."""
    ckpt = str(checkpoint_dir / "last.ckpt")
    name = f"ddp, {fault['in']}"
    turn_timeout = 4.0
    # one rank at a time (k = 1): a collective in a hook completes where the node's ranks run the hook at once
    run = _run(
        tmp_path,
        [{"name": name, "ckpt_path": ckpt, "fault": fault}],
        env={"SERIALIZED_RESTORE_TURN_TIMEOUT": "4"},
        serialized=1,
    )
    waiting = run.ranks(name)[1 - failed]
    assert waiting["failed_ranks"] == [failed] and waiting["kinds"] == ["timeout"], waiting
    message = waiting["message"]
    for fragment in ("`SerializedLoading(turn_timeout=...)` (seconds, now 4)", "did not end its turn", STAGE_1):
        assert fragment in message, message
    assert "slow file system" in message and "`LightningModule.on_load_checkpoint`" in message, message
    fault_at = run.fault_at(name)
    # the waiting rank's bound counts from when the turn could start, a little before the fault
    assert turn_timeout - 0.5 <= waiting["ended_at"] - fault_at < turn_timeout + PROMPT
    # the stuck rank printed where it was, and ended: with the same error, or its store gone
    if fault["in"] != "stop":
        assert "turn still running after 4s" in run.output and "on_load_checkpoint" in run.output, run.output[-4000:]
    if fault["in"] == "collective":
        assert "in broadcast" in run.output, run.output[-4000:]
    stuck = run.ranks(name).get(failed)
    assert stuck is None or stuck["failed_ranks"] in ([failed], [0]), stuck
    assert run.returncode != 0
    assert run.ended - fault_at < turn_timeout + 30


# ---------------------------------------------------------------------------------------------- a stuck rank ends


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stopped", [1, 0], ids=["rank 1 stopped", "rank 0 stopped"])
@pytest.mark.parametrize("launcher", ["lightning", "torchrun", "ddp_spawn"])
def test_a_rank_stopped_in_its_turn_ends_with_the_job(tmp_path: Path, trained_checkpoint: Path, launcher, stopped):
    """A rank stopped (SIGSTOP) inside its turn, under Lightning's own launcher (rank 0 is the first process, which
    starts the other and hosts the store), torchrun (its agent hosts the store) or ``ddp_spawn`` (the first process
    spawns both ranks; rank 0 hosts the store): the other rank raises naming it within the turn timeout plus a few
    seconds, and no process of the job is alive 20 s after the job's first process exits (where that is the stopped
    rank: after the other rank ended)."""
    turn_timeout = 5.0
    case = {"name": "stop", "ckpt_path": str(trained_checkpoint), "fault": {"rank": stopped, "in": "stop"}}
    out = tmp_path / "job"
    config = {
        "out": str(out),
        "devices": 2,
        "cases": [case],
        "strategy": "ddp_spawn" if launcher == "ddp_spawn" else "ddp",
    }
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = job_env({"SERIALIZED_RESTORE_TURN_TIMEOUT": str(turn_timeout)})
    with open(tmp_path / "output.txt", "w") as output:
        proc = start_job(FAILING_JOB, config, cwd=tmp_path, env=env, stdout=output,
                         argv=torchrun if launcher == "torchrun" else None)  # fmt: skip
    other = 1 - stopped
    report = out / "stop" / f"rank{other}.json"
    try:
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        reported = time.time()
        assert report.exists(), (tmp_path / "output.txt").read_text()[-4000:]
        fault_at = json.loads((out / "stop" / "fault.json").read_text())["at"]
        outcome = json.loads(report.read_text())
        assert outcome["failed_ranks"] == [stopped], outcome
        # where the stopped rank hosts the store, the other finds the store stopped answering
        kinds = ["store unresponsive"] if stopped == 0 and launcher != "torchrun" else ["timeout"]
        assert outcome["kinds"] == kinds, outcome
        assert outcome["ended_at"] - fault_at < turn_timeout + 8, outcome["ended_at"] - fault_at
        # the first process: torchrun's agent, the process that spawned the ranks, or Lightning's rank 0, which exits
        # unless it is the stopped one
        if launcher != "lightning" or stopped != 0:
            proc.wait(timeout=60)
            ended = time.time()
        else:
            ended = reported
        while session_processes(proc.pid) and time.time() < ended + 20:
            time.sleep(0.2)
        alive = session_processes(proc.pid)
        output = (tmp_path / "output.txt").read_text()
        assert not alive, (alive, output[-4000:])
        assert "terminate called" not in output, output[-4000:]  # no rank aborted on its way out
        print(f"TIMING {launcher}, rank {stopped} stopped: other rank raised {outcome['ended_at'] - fault_at:.2f}s"
              f" after the fault, job gone {time.time() - fault_at:.2f}s after it")  # fmt: skip
    finally:
        kill_job(proc)


# ------------------------------------------------------------------------------------------------------ bad input


class _WritesMarker:
    """A pickle payload: unpickling it calls ``open(marker, "w")``, which creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _bad_inputs(directory: Path, trained: Path) -> tuple[list[dict[str, Any]], dict[str, tuple[str, ...]]]:
    """Bad checkpoint files, the cases that try them (all four entry points) and what each error must say."""
    directory.mkdir()
    raw = trained.read_bytes()
    checkpoint = torch.load(trained, weights_only=False)
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = directory / name
        files[name].write_bytes(data)

    write("empty.ckpt", b"")
    write("truncated.ckpt", raw[: len(raw) // 2])
    corrupted = bytearray(raw)
    start = raw.index(b"\x80\x02", raw.index(b"data.pkl"))  # the pickle's first opcode
    corrupted[start + 2 : start + 42] = bytes(40)  # its CRC-32 no longer matches
    write("corrupted.ckpt", bytes(corrupted))
    write("random.ckpt", bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist()))
    write("notes.txt", b"epoch: 3\nval_loss: 0.12\n")
    other = copy.deepcopy(checkpoint)
    other["state_dict"] = {
        f"net.{k}": v for k, v in make_model_class("pytorch_lightning")(width=16).net.state_dict().items()
    }
    files["other_model.ckpt"] = directory / "other_model.ckpt"
    torch.save(other, files["other_model.ckpt"])
    files["bare_state_dict.ckpt"] = directory / "bare_state_dict.ckpt"
    torch.save(checkpoint["state_dict"], files["bare_state_dict.ckpt"])
    files["legacy_format.ckpt"] = directory / "legacy_format.ckpt"
    torch.save(checkpoint, files["legacy_format.ckpt"], _use_new_zipfile_serialization=False)
    old = copy.deepcopy(checkpoint)
    old.pop("loops")
    old["pytorch-lightning_version"] = "1.2.0"
    files["lightning_1.2.ckpt"] = directory / "lightning_1.2.ckpt"
    torch.save(old, files["lightning_1.2.ckpt"])
    for flag in ("true", "false"):
        malicious = dict(checkpoint, extra=_WritesMarker(str(directory.parent / f"MARKER-weights-only-{flag}")))
        files[f"malicious_{flag}.ckpt"] = directory / f"malicious_{flag}.ckpt"
        torch.save(malicious, files[f"malicious_{flag}.ckpt"])

    cases = [
        ("missing", str(directory / "missing.ckpt"), {"entry": "validate"}, ("FileNotFoundError: Checkpoint file",)),
        ("directory", str(directory), {"entry": "test"}, ("is a directory, not a checkpoint file",)),
        ("empty", str(files["empty.ckpt"]), {"entry": "predict"}, ("is empty (0 bytes)",)),
        ("truncated", str(files["truncated.ckpt"]), {}, ("is truncated or damaged", "the end of the archive")),
        ("corrupted", str(files["corrupted.ckpt"]), {}, ("is corrupted", "CRC-32", "data.pkl")),
        ("random bytes", str(files["random.ckpt"]), {}, ("is not a PyTorch checkpoint",)),
        ("text file", str(files["notes.txt"]), {}, ("is not a PyTorch checkpoint", "b'epoch: 3")),
        ("other model, strict", str(files["other_model.ckpt"]), {}, ("size mismatch for net.0.weight",)),
        ("other model, non-strict", str(files["other_model.ckpt"]), {"strict": False}, ("size mismatch",)),
        ("bare state_dict", str(files["bare_state_dict.ckpt"]), {}, ("is not a Lightning checkpoint",)),
        (
            "malicious pickle, weights_only=True",
            str(files["malicious_true.ckpt"]),
            {"weights_only": True},
            ("Weights only load failed", "Unsupported global", "io.open"),
        ),
    ]
    built = [{"name": name, "ckpt_path": path, **extra} for name, path, extra, _ in cases]
    return built, {name: fragments for name, _, _, fragments in cases}


@pytest.mark.timeout(240)
def test_bad_input_is_refused_on_every_rank(tmp_path, trained_checkpoint):
    """Each kind of bad checkpoint is refused on every rank with a message that says what is wrong with it."""
    directory = tmp_path / "inputs"
    cases, fragments = _bad_inputs(directory, trained_checkpoint)
    readable = [
        {"name": "torch legacy format", "ckpt_path": str(directory / "legacy_format.ckpt")},
        {"name": "Lightning 1.2 checkpoint", "ckpt_path": str(directory / "lightning_1.2.ckpt")},
        # an explicit weights_only=False is passed through too: the payload runs, as it does upstream
        {
            "name": "pickle, weights_only=False",
            "ckpt_path": str(directory / "malicious_false.ckpt"),
            "weights_only": False,
        },
    ]
    before = _snapshot(directory)
    # one rank at a time (k = 1): the first reader refuses the file and the other never reads it; with `True` a file
    # whose archive looks whole (a damaged member) is mapped by the node's ranks at once, and each raises upstream's
    # own error; a missing or cut-short file is read in turns, as here (the next test, with `True`)
    run = _run(tmp_path, cases + readable, continue_after_failure=True, timeout=220, serialized=1)
    assert run.returncode == 0, run.output[-4000:]
    for case in cases:
        name = case["name"]
        ranks = run.ranks(name)
        own = ranks[0]["type"]
        assert not own.startswith("CheckpointRestoreError"), (name, ranks[0])
        _assert_raised_on_every_rank(run, name, 2, [0], case["ckpt_path"], STAGE_1, *fragments[name], own=own)
        # refused by rank 0 in the first turn: rank 1 never read the file
        assert run.ranks(name)[1]["context_type"] is None
        start = max(o["started_at"] for o in run.ranks(name).values())
        assert run.timing(name, bound=PROMPT, start=start) < PROMPT
    # with weights_only=True the payload never ran: the package did not turn weights_only off
    assert not (tmp_path / "MARKER-weights-only-true").exists()
    # older formats that upstream Lightning reads are read the same way, on every rank, and so is a pickle the user
    # chose to trust: the package did not turn weights_only on either
    for case in readable:
        assert sorted(run.ranks(case["name"])) == [0, 1]
        assert all(o["ok"] for o in run.ranks(case["name"]).values()), run.ranks(case["name"])
    assert (tmp_path / "MARKER-weights-only-false").exists()
    assert _snapshot(directory) == before


# ------------------------------------------------------------------------------------------ what a user's log shows


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("bad", "world"), [("missing", 2), ("rank raising", 2), ("random bytes", 2), ("truncated", 2)])
def test_a_failed_restore_prints_no_more_than_upstream(tmp_path, trained_checkpoint, bad, world):
    """A job whose resume fails, nothing caught (``benchmarks/failure_output.py`` has every case at 2 and 4 ranks):
    the add-on's output has no more lines than upstream's for the same failure, in the same run; each rank's log
    shows at most one traceback, says on every rank what is wrong and which rank found it, and has no line that points
    elsewhere (an eager-read notice, a hint at torch's legacy format)."""
    from benchmarks.failure_output import FAST, SCRIPT, case_config

    outputs = {}
    for serialized in (False, True):
        config = case_config(bad, tmp_path, trained_checkpoint, world)
        config.update(out=str(tmp_path / f"job-{serialized}"), serialized=serialized)
        result = launch.run_job(config, timeout=150, env=FAST, script=SCRIPT)
        assert result.returncode != 0, result.output[-3000:]
        outputs[serialized] = result.output
    ours, upstream = outputs[True], outputs[False]
    assert len(ours.splitlines()) <= len(upstream.splitlines()), f"{ours}\n----- upstream:\n{upstream}"
    for output in outputs.values():
        for rank in range(world):
            lines = [line for line in output.splitlines() if line.startswith(f"[rank{rank}]:")]
            assert sum("Traceback" in line for line in lines) <= 1, (rank, output)
    for misleading in ("eagerly instead of memory-mapped", "is not a file", "_use_new_zipfile_serialization"):
        assert misleading not in ours, (misleading, ours)
    failed = world - 1 if bad == "rank raising" else 0
    what = {
        "missing": "FileNotFoundError: Checkpoint file not found",
        "truncated": "is truncated or damaged",
        "random bytes": "is not a PyTorch checkpoint: it is neither a zip archive",
        "rank raising": f"RuntimeError: rank {failed} cannot use this checkpoint",
    }[bad]
    # the failing rank raised its own error, as upstream's; every other rank says what is wrong and who found it
    for rank in set(range(world)) - {failed}:
        rank_output = "\n".join(line for line in ours.splitlines() if line.startswith(f"[rank{rank}]:"))
        assert f"failed on rank(s) {failed} in stage {STAGE_1!r} (node 0, local rank {failed}): " in rank_output, ours
        assert what in rank_output, ours
