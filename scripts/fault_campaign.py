"""A seeded, randomized fault campaign against the serialized restore, judged from outside the job.

``python scripts/fault_campaign.py [--seed S] [--runs N] [--json OUT] [--timeout-scale X] [--faults K,..]``

Each run draws a launcher (Lightning's own, ``python harness/fault_job.py CONFIG``, whose rank 0 starts the others;
or ``torchrun --standalone --nproc-per-node R``), an entry (``trainer.fit`` / ``trainer.validate`` with
``ckpt_path``, or ``fabric.load(path, state)``; ``serialized_restore.lightning``'s classes,
``serialized_checkpoint_loading=True``, or ``1`` in a third of the runs), R in {2, 3} and a fault (none in 2 runs of
11); the job's in-turn hook
sleeps 1 s. One upstream job per API (2 ranks, Lightning's launcher) writes the checkpoint; upstream's classes
resuming it with the same launcher, entry, R and settings give a fault-free run's expected end state.

Faults (r: the target rank; u: a drawn fraction): ``raise`` / ``exit``: the hook in rank r's turn
(``on_load_checkpoint``; Fabric: a stateful object's ``load_state_dict``) raises ``RuntimeError`` / ``SystemExit``;
``sigint`` / ``sigkill``: that signal to rank r u x (R - 1/4) s (True: u x 3/4 s) after the first rank entered its
turn (r waiting for its turn, in it, or past it); ``sigstop``: to rank r u x 0.5 s into its hook, inside its turn;
``ctrl-c``: SIGINT to the job's process group at a moment drawn as for ``sigint`` (as a terminal's Ctrl-C: under
torchrun, the agent, whose workers run in sessions of their own); ``truncated`` / ``garbage`` / ``missing``:
``ckpt_path`` is the checkpoint cut to 10-90 %, seeded random bytes (first byte neither zip's ``P`` nor pickle's
``0x80``), or a path that does not exist. A signal that finds its target past the restore fails check 0 (``missed``:
the campaign's problem, unless the restore ended early because the ranks did not take turns).

Checks, by number: 1 ``bound``: the main process ends within turn timeout + 60 s, else the job is killed (turn
timeout 6 s for sigint, sigkill, sigstop; 60 s otherwise); ``prompt``: where docs/failures.md says the others learn
at once (an exception or SystemExit in a turn, bad input, Ctrl-C), it ends within 30 s of the fault, which a job
that waits out the turn timeout cannot. 2 ``exit``: status 0 without a fault, non-zero with one; ``crash``: no
process aborted (``terminate called``, or SIGABRT / SIGSEGV as an exit status of the main process or of a rank in the
launcher's report): a signal or an error must end a rank as Python does, not crash it. 3 ``state``
(fault-free): every rank's state after the restore and after 2 more steps (weights, optimizer and scheduler states,
step, epoch, fit loop, a callback's state, metrics; Fabric: a stateful counter, the returned remainder) equals
upstream's bit for bit; ``turns``: with ``1``, no two ranks were in their in-turn hooks at once. 4 ``files``: the
checkpoint's folder and a bad-file run's folder keep their names, sizes, mtimes and SHA-256s. 5 ``leftovers``: no
process of the job is alive (SIGSTOPped ones count, zombies do not) 20 s after the main process ended; the rest is
then killed. The job's processes are those of the main process's session and of every session a descendant of it
led (torchrun starts each worker in its own), collected by pid and start time while the job runs, and their later
children. 6 ``cause``: the output names the failing rank and the kind (``expected_cause``).

Exit status: 0 if every run passed every check, 1 if a check failed, 2 if a checkpoint job failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.processes import job_env  # noqa: E402

JOB = REPO / "harness" / "fault_job.py"
DECK = ["none", "none", "raise", "exit", "sigint", "sigkill", "sigstop", "ctrl-c", "truncated", "garbage", "missing"]
"""The faults are dealt from this deck, reshuffled when empty, so that a short slice still covers the kinds."""
BAD_FILE = {"truncated", "garbage", "missing"}
PROMPT = {"raise", "exit", "ctrl-c"} | BAD_FILE
SIGNALS = {"sigint": signal.SIGINT, "sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "ctrl-c": signal.SIGINT}
HOOK_SLEEP = 1.0
LATE = ("after the restore", "done")
TIMEOUT_PHRASE = "did not end its turn within the turn timeout"
STORE_LOST = "lost contact with the process group's store"
STORE_STOPPED = "stopped answering"  # kind 'store unresponsive': the store's host is stopped
BAD_TEXT = {"truncated": ("truncated",), "garbage": ("not a PyTorch checkpoint",),
            "missing": ("does not exist", "Checkpoint file not found", "No such file or directory")}  # fmt: skip
Events = list[dict[str, Any]]


@dataclasses.dataclass
class Spec:
    """One drawn run."""

    id: str
    launcher: str  # "lightning" or "torchrun"
    entry: str  # "fit", "validate" or "load"
    devices: int
    fault: str
    target: int  # the rank the fault is aimed at (bad files: 0, the node's first reader)
    u: float  # when a signal falls in its window; how much of a truncated file is kept
    k: Any = True  # serialized_checkpoint_loading: True (the mapped stage with the ranks at once) or 1 (turns)

    @property
    def api(self) -> str:
        return "fabric" if self.entry == "load" else "trainer"


def draw(seed: int, runs: int, faults: Optional[list[str]]) -> list[Spec]:
    rng, deck, specs = random.Random(seed), list[str](), list[Spec]()
    for i in range(runs):
        if not deck:
            deck = [f for f in DECK if faults is None or f in faults]
            rng.shuffle(deck)
        fault, launcher = deck.pop(), rng.choice(["lightning", "torchrun"])
        entry, devices = rng.choice(["fit", "validate", "load"]), rng.choice([2, 3])
        target = 0 if fault in BAD_FILE else rng.randrange(devices)
        k = 1 if rng.random() < 1 / 3 else True
        specs.append(Spec(f"s{seed}-{i:03d}", launcher, entry, devices, fault, target, rng.random(), k))
    return specs


# ----------------------------------------------------------------------------------------- the job, from outside


def proc_table() -> dict[int, tuple[int, int, str, int]]:
    """Every process: pid -> (ppid, session id, state, start time in clock ticks), from ``/proc/<pid>/stat``."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(rest[1]), int(rest[3]), rest[0], int(rest[19]))
    return table


class Watch:
    """The job's processes, by (pid, start time): while the main process lives, every process of its session and of
    any session one of its descendants led; afterwards also any child of one of those."""

    def __init__(self, main: subprocess.Popen) -> None:
        self.main, self.sessions, self.members = main, {main.pid}, set[tuple[int, int]]()

    def update(self) -> dict[int, str]:
        """Scan ``/proc``; return pid -> state of the job's live (not zombie) processes."""
        table = proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_) in table.items():
            children.setdefault(ppid, []).append(pid)
        if self.main.poll() is None:
            stack = [self.main.pid]
            while stack:
                pid = stack.pop()
                if pid in table:
                    self.sessions.add(table[pid][1])
                    stack += children.get(pid, [])
            self.members |= {(p, t) for p, (_, sid, _, t) in table.items() if sid in self.sessions}
        known = {p for p, t in self.members if p in table and table[p][3] == t}
        self.members |= {(c, table[c][3]) for p in known for c in children.get(p, []) if table[c][1] in self.sessions}
        return {p: table[p][2] for p, t in self.members if p in table and table[p][3] == t and table[p][2] != "Z"}

    def kill_all(self) -> None:
        """SIGKILL the job's processes until none is left (5 s at most); reap the main process."""
        for _ in range(50):
            left = self.update()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left:
                break
            time.sleep(0.1)
        self.main.wait()


@dataclasses.dataclass
class Outcome:
    returncode: Optional[int] = None  # None: still running at the bound, killed by the campaign
    seconds: float = 0.0  # from the start to the main process's end (or the bound)
    output: str = ""
    events: Events = dataclasses.field(default_factory=list)
    fault_at: Optional[float] = None  # wall-clock time of the fault (sent, raised, or the bad file's first read)
    fault_note: str = ""
    exit_at: float = 0.0  # wall-clock time the campaign saw the main process end
    survivors: dict[int, str] = dataclasses.field(default_factory=dict)  # pid -> "rank r, state S"


def read_events(path: Path) -> Events:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def sigint_at_default() -> None:
    """(the job's main process, before it starts) SIGINT at its default action, as a terminal's foreground job has
    it, also where the campaign runs in the background: a shell without job control starts a command given ``&``
    with SIGINT ignored, which its children would inherit, and neither Ctrl-C nor a SIGINT fault would reach them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_job(config: dict[str, Any], launcher: str, where: Path, turn_timeout: float, bound: float, linger: float,
            trigger: Optional[Callable[[Events, Outcome, Watch], None]] = None) -> Outcome:  # fmt: skip
    """Start the job in a session of its own, call ``trigger`` as its events come, wait at most ``bound`` s for its
    main process, then up to ``linger`` s for its other processes; kill whatever is left."""
    argv = [sys.executable]
    if launcher == "torchrun":
        argv += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config['devices']}"]
    where.mkdir(parents=True, exist_ok=True)
    env = job_env({"SERIALIZED_RESTORE_TURN_TIMEOUT": f"{turn_timeout:g}", "PYTHONUNBUFFERED": "1"})
    events_path = Path(config["out"]) / "events.jsonl"
    started = time.monotonic()
    with open(where / "job.log", "wb") as log:
        main = subprocess.Popen([*argv, str(JOB), json.dumps(config)], cwd=where, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=sigint_at_default)  # fmt: skip
    watch, outcome = Watch(main), Outcome()
    try:
        while main.poll() is None and time.monotonic() - started < bound:
            watch.update()
            outcome.events = read_events(events_path)
            if trigger is not None:
                trigger(outcome.events, outcome, watch)
            time.sleep(0.1)
        outcome.returncode, outcome.exit_at, outcome.seconds = main.poll(), time.time(), time.monotonic() - started
        if outcome.returncode is not None:
            while watch.update() and time.time() - outcome.exit_at < linger:
                time.sleep(0.2)
            outcome.events = read_events(events_path)
            ranks = {e["pid"]: e["rank"] for e in outcome.events}
            outcome.survivors = {p: f"rank {ranks.get(p, '?')}, state {s}" for p, s in watch.update().items()}
    finally:  # also when the campaign itself is interrupted
        watch.kill_all()
    outcome.output = (where / "job.log").read_text(errors="replace")
    return outcome


def phase(events: Events, rank: int) -> str:
    """Where rank ``rank`` is, by its last event so far."""
    names = {"begin": "waiting for its turn", "turn": "in its turn", "fault": "in its turn",
             "hook_end": "past its hook", "restored": "after the restore", "done": "done"}  # fmt: skip
    last = [e["event"] for e in events if e["rank"] == rank]
    return names.get(last[-1], last[-1]) if last else "before the restore"


def signal_trigger(spec: Spec) -> Callable[[Events, Outcome, Watch], None]:
    """Send the run's signal when its moment has come (the module's docstring); note the phases then."""

    def fire(events: Events, outcome: Outcome, watch: Watch) -> None:
        aimed = spec.fault == "sigstop"
        turns = [e["t"] for e in events if e["event"] == "turn" and (not aimed or e["rank"] == spec.target)]
        pid = next((e["pid"] for e in events if e["rank"] == spec.target), None)
        # the restore's hooks: one after another with k = 1, all at once with True (the file is memory-mapped)
        span = (0.5 if aimed else (spec.devices if spec.k is not True else 1) - 0.25) * HOOK_SLEEP
        if outcome.fault_at is not None or not turns or pid is None or time.time() < min(turns) + spec.u * span:
            return
        phases = {r: phase(events, r) for r in range(spec.devices)}
        if spec.fault == "ctrl-c":
            os.killpg(watch.main.pid, signal.SIGINT)
            outcome.fault_note = "phases " + ", ".join(f"r{r}: {p}" for r, p in phases.items())
            missed = all(p in LATE for p in phases.values())
        else:
            try:
                os.kill(pid, SIGNALS[spec.fault])
                outcome.fault_note, missed = f"rank {spec.target} {phases[spec.target]}", phases[spec.target] in LATE
            except ProcessLookupError:
                outcome.fault_note, missed = f"rank {spec.target} had exited", True
        outcome.fault_note += ": missed" if missed else ""
        outcome.fault_at = time.time()

    return fire


# -------------------------------------------------------------------------------------------------------- checks


def listing(folder: Path) -> dict[str, Any]:
    """Every entry of ``folder``: name -> [size, mtime, SHA-256] for a file, else its kind."""
    result: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            result[path.name] = [st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()]
        else:
            result[path.name] = "dir" if path.is_dir() else "other"
    return result


def overlapping_turns(events: Events) -> Optional[tuple[int, int]]:
    """Two ranks whose in-turn hooks (``turn`` to ``hook_end``) overlapped in time."""
    spans = {e["rank"]: [e["t"], None] for e in events if e["event"] == "turn"}
    for e in events:
        if e["event"] == "hook_end":
            spans[e["rank"]][1] = e["t"]
    latest: Optional[tuple[float, int]] = None
    for t0, t1, rank in sorted((t0, t1, r) for r, (t0, t1) in spans.items() if t1 is not None):
        if latest is not None and t0 < latest[0]:
            return latest[1], rank
        latest = max(latest or (t1, rank), (t1, rank))
    return None


def names_rank(output: str, rank: int, kinds: tuple[str, ...]) -> bool:
    """A line of the project's error names ``rank`` as failing (``failed on rank(s) ..`` for one failure, or an item
    ``- rank r (`` of several) and says one of ``kinds``."""
    for line in output.splitlines():
        match = re.search(r"failed on rank\(s\) ([\d, ]+)", line)
        named = match is not None and str(rank) in match.group(1).replace(" ", "").split(",")
        if (named or re.match(rf"\s*- rank {rank} \(", line)) and any(k in line for k in kinds):
            return True
    return False


def launcher_names(output: str, launcher: str, rank: int, pid: Optional[int], code: int) -> bool:
    """The launcher's own report says rank ``rank`` ended with ``code``: Lightning's child process observer (which
    names the pid), or torchrun's summary (``rank : r (local_rank: r)`` then ``exitcode : code``)."""
    if launcher == "lightning":
        return pid is not None and f"Child process with PID {pid} terminated with code {code}" in output
    return re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*{code}\b", output) is not None


def own_traceback_names(output: str, rank: int, text: str) -> bool:
    """Rank ``rank``'s own uncaught exception says ``text``: a line of its traceback, which torch prefixes with
    ``[rank<r>]:`` once the process group is up."""
    return any(line.startswith(f"[rank{rank}]:") and text in line for line in output.splitlines())


def expected_cause(spec: Spec, outcome: Outcome, text: str) -> Optional[str]:
    """None if the output names the cause as the fault kind must, else what is missing:

    * raise / exit: the injected text is printed (the failing rank's own exception), and a line of the project's
      error names rank r with that text (exit: with ``SystemExit``); with ``k=True`` the ranks run the hook's stage at
      once, and a launcher that ends the job as soon as one rank exits (torchrun's agent) may end the others before
      they reach the stage's end, where they would learn of the failure, as it ends upstream's ranks: then rank r's
      own report names it, its traceback under torch's ``[rank<r>]:`` prefix (raise) or the launcher's record of its
      exit with status 1 (exit);
    * bad file: a line of the project's error names rank 0 (the node's local rank 0 reads first) with the problem:
      ``truncated``; ``not a PyTorch checkpoint``; ``does not exist`` or upstream's ``Checkpoint file not found`` /
      ``No such file or directory`` (docs/failures.md promises the first in its table, the second in its text);
    * sigstop: a line of the project's error names rank r with ``did not end its turn within the turn timeout``
      or, for rank 0 under Lightning's launcher (the store's host), ``stopped answering`` (no launcher sees a
      stopped process);
    * sigkill: the project's error names rank r with that timeout or, for rank 0 under Lightning's launcher (the
      store's host), the lost store; or the launcher names rank r ended by signal 9 (``launcher_names``);
    * sigint: as sigkill, with ``KeyboardInterrupt`` (rank r was in its turn) also accepted in the project's error,
      and signal 2; or, rank 0 of a Trainer, Lightning's ``Detected KeyboardInterrupt`` (printed by rank 0 only);
    * ctrl-c (no rank to name): ``KeyboardInterrupt`` or ``SIGINT`` is printed, or the main process ended by SIGINT,
      or the launcher says a rank did (a rank waiting when SIGINT comes ends by it, as a program without a handler).
    """
    out, r, fault = outcome.output, spec.target, spec.fault
    if fault in ("raise", "exit"):
        if text not in out:
            return f"the injected text {text!r} is not in the output"
        kind = text if fault == "raise" else "SystemExit"
        if names_rank(out, r, (kind,)):
            return None
        if spec.k is True and fault == "raise" and own_traceback_names(out, r, f"RuntimeError: {text}"):
            return None
        pid = next((e["pid"] for e in outcome.events if e["rank"] == r), None)
        if spec.k is True and fault == "exit" and launcher_names(out, spec.launcher, r, pid, 1):
            return None
        return f"no error line names rank {r} with {kind!r}"
    if fault in BAD_FILE:
        return None if names_rank(out, 0, BAD_TEXT[fault]) else f"no error line names rank 0 with {BAD_TEXT[fault]}"
    if fault == "sigstop":
        kinds = (TIMEOUT_PHRASE,) + ((STORE_STOPPED,) if r == 0 and spec.launcher == "lightning" else ())
        return None if names_rank(out, r, kinds) else f"no error line names rank {r} with the timeout"
    if fault in ("sigkill", "sigint"):
        kinds = (TIMEOUT_PHRASE,) + ((STORE_LOST,) if r == 0 and spec.launcher == "lightning" else ())
        kinds += ("KeyboardInterrupt",) if fault == "sigint" else ()
        pid = next((e["pid"] for e in outcome.events if e["rank"] == r), None)
        if names_rank(out, r, kinds) or launcher_names(out, spec.launcher, r, pid, -SIGNALS[fault]):
            return None
        if fault == "sigint" and r == 0 and spec.api == "trainer" and "Detected KeyboardInterrupt" in out:
            return None
        return f"neither the project's error nor the launcher names rank {r} with {fault}"
    ok = "KeyboardInterrupt" in out or "SIGINT" in out or outcome.returncode == -signal.SIGINT
    ok = ok or any(launcher_names(out, spec.launcher, e["rank"], e["pid"], -signal.SIGINT) for e in outcome.events)
    return None if ok else "no KeyboardInterrupt or SIGINT printed, and no process is said to have ended by SIGINT"


# ------------------------------------------------------------------------------------------------------ campaign


class Campaign:
    """The checkpoints and upstream's references, each made once, and the runs judged against them."""

    def __init__(self, workdir: Path, scale: float) -> None:
        self.workdir, self.scale = workdir, scale
        self.checkpoints: dict[str, dict[str, Any]] = {}  # api -> {"path", "global_step"}
        self.references: dict[tuple[str, str, int], Any] = {}  # (launcher, entry, R) -> states, or why there are none
        self.setup_seconds: dict[str, float] = {}

    def job(self, config: dict[str, Any], launcher: str, where: Path, turn_timeout: float, trigger: Any = None
            ) -> Outcome:  # fmt: skip
        bound = turn_timeout + 60 * self.scale
        return run_job(config, launcher, where, turn_timeout, bound, 20 * self.scale, trigger)

    def make_checkpoint(self, api: str) -> None:
        """A fault-free upstream job (2 ranks, Lightning's launcher) trains and saves; no campaign without it."""
        save_dir, where = self.workdir / "checkpoints" / api, self.workdir / "checkpoints" / f"{api}-job"
        save_dir.mkdir(parents=True, exist_ok=True)
        config = {"api": api, "impl": "upstream", "role": "save", "devices": 2, "out": str(where),
                  "save_dir": str(save_dir)}  # fmt: skip
        outcome = self.job(config, "lightning", where, 60)
        self.setup_seconds[f"checkpoint {api}"] = round(outcome.seconds, 1)
        if outcome.returncode != 0 or not (save_dir / "meta.json").exists():
            print(f"the {api} checkpoint job failed ({outcome.returncode}):\n{outcome.output[-4000:]}", file=sys.stderr)
            raise SystemExit(2)
        saved = json.loads((save_dir / "meta.json").read_text())
        self.checkpoints[api] = {"path": str(save_dir / saved["file"]), "global_step": saved["global_step"]}

    def config(self, spec: Spec, impl: str, out: Path, ckpt_path: str, text: str) -> dict[str, Any]:
        fault = {"kind": spec.fault, "rank": spec.target, "text": text} if spec.fault in ("raise", "exit") else None
        return {"api": spec.api, "impl": impl, "role": "resume", "entry": spec.entry, "devices": spec.devices,
                "out": str(out), "ckpt_path": ckpt_path, "saved_step": self.checkpoints[spec.api]["global_step"],
                "hook_sleep": HOOK_SLEEP, "extra_steps": 2, "fault": fault, "k": spec.k}  # fmt: skip

    def reference(self, spec: Spec) -> Any:
        """Upstream's classes resuming the same checkpoint with the same launcher, entry and R: their states."""
        key = (spec.launcher, spec.entry, spec.devices)
        if key not in self.references:
            where = self.workdir / "references" / f"{spec.launcher}-{spec.entry}-R{spec.devices}"
            config = self.config(dataclasses.replace(spec, fault="none"), "upstream", where / "out",
                                 self.checkpoints[spec.api]["path"], "")  # fmt: skip
            outcome = self.job(config, spec.launcher, where, 60)
            self.setup_seconds[f"reference {where.name}"] = round(outcome.seconds, 1)
            from harness.fault_job import read_results

            states = read_results(where / "out")
            ok = outcome.returncode == 0 and sorted(states) == list(range(spec.devices))
            why = f"upstream's job failed ({outcome.returncode}): {outcome.output[-600:]}"
            self.references[key] = states if ok else why
        return self.references[key]

    def bad_file(self, spec: Spec, folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        if spec.fault == "missing":
            return str(folder / "missing.ckpt")
        path = folder / "last.ckpt"
        if spec.fault == "truncated":
            whole = Path(self.checkpoints[spec.api]["path"]).read_bytes()
            path.write_bytes(whole[: int(len(whole) * (0.1 + 0.8 * spec.u))])
        else:
            rng = random.Random(spec.id)
            data = bytearray(rng.randbytes(1024 + int(spec.u * 60000)))
            while data[0] in (ord("P"), 0x80):
                data[0] = rng.randrange(256)
            path.write_bytes(bytes(data))
        return str(path)

    def run(self, spec: Spec) -> dict[str, Any]:
        where = self.workdir / "runs" / spec.id
        text = f"injected fault {spec.id}: {spec.fault} in the hook on rank {spec.target}"
        ckpt_path = self.checkpoints[spec.api]["path"]
        folders = [Path(ckpt_path).parent] + ([where / "bad"] if spec.fault in BAD_FILE else [])
        if spec.fault in BAD_FILE:
            ckpt_path = self.bad_file(spec, where / "bad")
        before = {f: listing(f) for f in folders}
        turn_timeout = 6.0 if spec.fault in ("sigint", "sigkill", "sigstop") else 60.0
        trigger = signal_trigger(spec) if spec.fault in SIGNALS else None
        outcome = self.job(self.config(spec, "ours", where / "out", ckpt_path, text), spec.launcher, where,
                           turn_timeout, trigger)  # fmt: skip
        failures = self.judge(spec, outcome, text, before, turn_timeout)
        record = {**dataclasses.asdict(spec), "turn_timeout": turn_timeout, "verdict": "FAIL" if failures else "pass",
                  "seconds": round(outcome.seconds, 1), "failures": failures, "fault_note": outcome.fault_note,
                  "returncode": outcome.returncode, "survivors": outcome.survivors,
                  "log": str(where / "job.log")}  # fmt: skip
        if failures:
            pattern = r"Error|Exception|exitcode|rank\s*:|Signal|Keyboard|SystemExit|Child process|injected|Timeout|SIG"
            lines = [line[:400] for line in outcome.output.splitlines() if re.search(pattern, line)]
            record["output_excerpt"] = lines[-30:]
        return record

    def judge(self, spec: Spec, outcome: Outcome, text: str, before: dict[Path, Any], turn_timeout: float) -> list[str]:
        """Every check's failures, ``"<number> <name>: what"``."""
        failures, events = [], outcome.events
        broken = re.search(r"^\w*(ModuleNotFoundError|ImportError): .*", outcome.output, re.MULTILINE)
        if not events and broken:  # the job never got going: its environment, not the package, is at fault
            failures.append(f"0 environment: the job could not start ({broken.group(0)[:200]}); checks 2, 3, 6 skipped")
        else:
            failures += self.behaviour(spec, outcome, text, turn_timeout)
        overlap = overlapping_turns(events) if spec.k is not True else None  # True: the mapped stage runs at once
        if overlap:
            failures.append(f"3 turns: ranks {overlap[0]} and {overlap[1]} were inside their turns' hooks at once")
        for folder, listed in before.items():
            now = listing(folder)
            if now != listed:
                changed = sorted(k for k in listed.keys() | now.keys() if listed.get(k) != now.get(k))
                failures.append(f"4 files: {folder.name}/ changed: {changed}")
        if outcome.survivors:
            failures.append(f"5 leftovers: alive {20 * self.scale:g}s after the main process ended: "
                            f"{outcome.survivors}")  # fmt: skip
        return failures

    def behaviour(self, spec: Spec, outcome: Outcome, text: str, turn_timeout: float) -> list[str]:
        """Checks 0 (the fault was applied), 1, 2, 3 (state) and 6."""
        failures, events, out = [], outcome.events, outcome.output
        if spec.fault in ("raise", "exit"):
            outcome.fault_at = next((e["t"] for e in events if e["event"] == "fault"), None)
        elif spec.fault in BAD_FILE:
            outcome.fault_at = min((e["t"] for e in events if e["event"] == "begin"), default=None)
        if spec.fault != "none" and (outcome.fault_at is None or outcome.fault_note.endswith("missed")):
            failures.append(f"0 fault: not applied during the restore: {outcome.fault_note or 'never reached'}")
        if outcome.returncode is None:
            failures.append(f"1 bound: still running {turn_timeout + 60 * self.scale:g}s after it started; killed")
        else:
            late = outcome.exit_at - outcome.fault_at if outcome.fault_at is not None else 0.0
            if spec.fault in PROMPT and late > 30 * self.scale:
                failures.append(f"1 prompt: the main process ended {late:.1f}s after the fault")
            if (outcome.returncode == 0) != (spec.fault == "none"):
                with_ = "without" if spec.fault == "none" else "with"
                failures.append(f"2 exit: status {outcome.returncode} {with_} a fault")
        crash = re.search(r"terminate called.*|exitcode\s*:\s*-(6|11)\b.*|terminated with code -(6|11)\b", out)
        if crash or outcome.returncode in (-signal.SIGABRT, -signal.SIGSEGV):
            failures.append(f"2 crash: a process of the job aborted: {crash.group(0) if crash else outcome.returncode}")
        if spec.fault == "none" and outcome.returncode == 0:
            from harness.fault_job import differences, read_results  # torch: only where a state is compared

            reference, ours = self.reference(spec), read_results(self.workdir / "runs" / spec.id / "out")
            if isinstance(reference, str):
                failures.append(f"3 state: no reference: {reference}")
            elif sorted(ours) != sorted(reference):
                failures.append(f"3 state: ranks {sorted(ours)} wrote their state, upstream's {sorted(reference)}")
            else:
                diff = [f"rank {r}{d}" for r in reference for d in differences(ours[r], reference[r])]
                if diff:
                    failures.append(f"3 state: differs from upstream's at {diff[:4]}{' ...' if len(diff) > 4 else ''}")
        missing = expected_cause(spec, outcome, text) if spec.fault != "none" else None
        if missing:
            failures.append(f"6 cause: {missing}")
        return failures


def describe(record: dict[str, Any]) -> str:
    fault = record["fault"] + (f"@r{record['target']}" if record["fault"] in ("raise", "exit", *SIGNALS) else "")
    fault = fault.replace("ctrl-c@r" + str(record["target"]), "ctrl-c")
    k = "k=True" if record.get("k") is True else f"k={record.get('k')}"
    line = (f"{record['id']}  {record['launcher']:9} {record['entry']:8} R={record['devices']} {k}  {fault:12} "
            f"{record['verdict']:4} {record['seconds']:5.1f}s  rc={record['returncode']}")  # fmt: skip
    line += f"  [{record['fault_note']}]" if record["fault_note"] else ""
    return line + "".join(f"\n      {f[:500]}" for f in record["failures"])


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs, failures and seconds (min, mean, max) per fault kind; how often each check failed."""
    by_fault: dict[str, Any] = {}
    checks: dict[str, int] = {}
    for kind in sorted({r["fault"] for r in records}):
        mine = [r for r in records if r["fault"] == kind]
        s = [r["seconds"] for r in mine]
        failed = sum(r["verdict"] == "FAIL" for r in mine)
        by_fault[kind] = {"runs": len(s), "failed": failed, "min": min(s), "mean": round(sum(s) / len(s), 1),
                          "max": max(s)}  # fmt: skip
    for name in (" ".join(f.split()[:2]).rstrip(":") for r in records for f in r["failures"]):
        checks[name] = checks.get(name, 0) + 1
    failed = sum(r["verdict"] == "FAIL" for r in records)
    return {"runs": len(records), "passed": len(records) - failed, "failed": failed, "by_fault": by_fault,
            "failed_checks": checks}  # fmt: skip


def package_state() -> str:
    """The commit, and whether the package's files differ from it (another engineer may be editing them)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        diff = subprocess.run(["git", "diff", "HEAD", "--", "serialized_restore"], cwd=REPO, capture_output=True)
    except OSError:
        return "(no git)"
    if head.returncode != 0:
        return "(not a git checkout)"
    digest = hashlib.sha256(diff.stdout).hexdigest()[:10]
    return head.stdout.strip() + (f" + uncommitted changes (diff sha256 {digest})" if diff.stdout else "")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write every run's record and the summary here")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply the campaign's bounds (slow hosts)")
    parser.add_argument("--faults", help=f"deal only these comma-separated kinds of {sorted(set(DECK))}")
    parser.add_argument("--workdir", type=Path, help="keep checkpoints, logs and states here (default: a temporary "
                        "directory, removed if every run passed)")  # fmt: skip
    args = parser.parse_args(argv)
    faults = args.faults.split(",") if args.faults else None
    if faults and not set(faults) <= set(DECK):
        parser.error(f"unknown fault kinds {sorted(set(faults) - set(DECK))}")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="fault-campaign-"))).resolve()
    campaign, specs = Campaign(workdir, args.timeout_scale), draw(args.seed, args.runs, faults)
    started = time.monotonic()
    state = package_state()
    print(f"fault campaign: seed {args.seed}, {len(specs)} runs, package {state}, work directory {workdir}", flush=True)
    for api in sorted({s.api for s in specs}):
        campaign.make_checkpoint(api)
    records = []
    for spec in specs:
        now = package_state()
        if now != state:
            print(f"package now {now}", flush=True)
        records.append({**campaign.run(spec), "package": now})
        print(describe(records[-1]), flush=True)
        state = now
    summary = summarize(records)
    summary.update(seconds=round(time.monotonic() - started, 1), setup_seconds=campaign.setup_seconds)
    print(f"\n{summary['passed']}/{summary['runs']} runs passed in {summary['seconds']:.0f}s (checkpoints and "
          f"upstream's references: {sum(campaign.setup_seconds.values()):.0f}s)")  # fmt: skip
    for fault, k in sorted(summary["by_fault"].items()):
        times = f"{k['min']:.1f} / {k['mean']:.1f} / {k['max']:.1f} s (min / mean / max)"
        print(f"  {fault:10} {k['runs']:3} runs {k['failed']:3} failed   {times}")
    for check, n in sorted(summary["failed_checks"].items()):
        print(f"  check {check} failed in {n} run(s)")
    if args.json:
        report = {"seed": args.seed, "package": state, "workdir": str(workdir), "summary": summary, "runs": records}
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if not args.workdir and not summary["failed"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
