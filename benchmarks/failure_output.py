"""How many lines a failed resume prints, upstream Lightning against the add-on, in one run.

    python benchmarks/failure_output.py [--ranks 2 4] [--cases missing truncated "random bytes" "rank raising"]
                                        [--json OUT]

Each case is a 2- or 4-rank ``ddp`` job on CPU, started by Lightning's own launcher, whose
``trainer.fit(ckpt_path=...)`` fails in the restore with nothing caught (``tests/helpers/uncaught_job.py``): the output
a user's terminal shows, stdout and stderr together, every rank. The cases: a path that does not exist, a checkpoint cut
in half, 4 KiB of random bytes, and a sound checkpoint whose last rank raises in ``on_load_checkpoint``. Prints one row
per case and N; the add-on's count should never exceed upstream's (``tests/test_failures.py`` pins two of them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.models import dataloader, make_model_class  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402
from tests.helpers import launch  # noqa: E402

CASES = ("missing", "truncated", "random bytes", "rank raising")
SCRIPT = launch.JOB.with_name("uncaught_job.py")
FAST = {"SERIALIZED_RESTORE_TURN_TIMEOUT": "60"}


def make_checkpoint(directory: Path) -> Path:
    """A sound checkpoint of the job's model, saved by a 1-rank fit of two steps."""
    from pytorch_lightning import Trainer

    path = directory / "sound.ckpt"
    trainer = Trainer(**quiet_cpu_trainer_kwargs(str(directory), 1, "auto", max_steps=2, enable_checkpointing=False))
    trainer.fit(make_model_class("pytorch_lightning")(), dataloader())
    trainer.save_checkpoint(path)
    return path


def case_config(case: str, directory: Path, sound: Path, ranks: int) -> dict[str, Any]:
    """The job's config for ``case``: its checkpoint path (written here) and, for a raising rank, which one."""
    path = directory / f"{case.replace(' ', '-')}.ckpt"
    if case == "truncated":
        data = sound.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "random bytes":
        path.write_bytes(b"\x00" + os.urandom(4095))
    elif case == "rank raising":
        path = sound
    config: dict[str, Any] = {"ckpt_path": str(path), "devices": ranks}
    if case == "rank raising":
        config["raise_on_rank"] = ranks - 1
    return config


def count_lines(case: str, ranks: int, directory: Path, sound: Path) -> dict[str, Any]:
    """Run the case with upstream's ``Trainer`` and the add-on's; the lines each printed."""
    row: dict[str, Any] = {"case": case, "ranks": ranks}
    for serialized in (False, True):
        config = case_config(case, directory, sound, ranks)
        config.update(out=str(directory / f"{case}-{ranks}-{serialized}"), serialized=serialized)
        result = launch.run_job(config, timeout=180, env=FAST, script=SCRIPT)
        if result.returncode == 0:
            raise RuntimeError(f"{case} with {ranks} ranks did not fail:\n{result.output[-3000:]}")
        row["addon" if serialized else "upstream"] = len(result.output.splitlines())
        row["addon_output" if serialized else "upstream_output"] = result.output
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", type=Path, help="write the rows (the counts) here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sound = make_checkpoint(directory)
        print("| case | ranks | upstream lines | add-on lines | add-on / upstream |")
        print("|---|---|---|---|---|")
        for ranks in args.ranks:
            for case in args.cases:
                row = count_lines(case, ranks, directory, sound)
                rows.append(row)
                ratio = row["addon"] / row["upstream"]
                print(f"| {case} | {ranks} | {row['upstream']} | {row['addon']} | {ratio:.2f} |", flush=True)
    if args.json is not None:
        counts = [{key: value for key, value in row.items() if not key.endswith("_output")} for row in rows]
        args.json.write_text(json.dumps(counts, indent=1) + "\n")
    return 0 if all(row["addon"] <= row["upstream"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
