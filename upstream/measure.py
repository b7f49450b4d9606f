"""Node memory of a DDP restore on Lightning master, unpatched vs patched with the first K PRs of the series.

For each model size and number of local ranks N, a real DDP job (gloo, CPU, Lightning's own ``ddp`` launcher)
runs ``validate`` and ``fit`` on every variant, with ``ckpt_path`` and, as its baseline, without; this script
samples the resident anonymous memory (``RssAnon``) of the job's whole process tree from outside and reports the
node's peak above the baseline's peak as a multiple of S (both peaks taken from the first rank's ``setup`` hook,
before the restore, to the last rank's return from ``fit``/``validate``: the imports and the process group's start
come before and are left out), the checkpoint's size on disk (weights and Adam state).
The checkpoint is taken at step 1 and ``fit`` resumes it with ``max_steps=1``: it restores everything (the optimizer
state included) and trains no further step; its baseline trains no step either (``limit_train_batches=0``), and the
figure is net of the optimizer state the fit keeps (N times its size in the checkpoint), which a resumed job holds
however it reads the file. ``master`` is the snapshot unpatched, ``master+01..K`` the snapshot with PRs 01..K overlaid
(``series.py apply``), both imported through ``PYTHONPATH`` by the same interpreter (one with torch and
Lightning's dependencies installed, e.g. the snapshot's own install).

Usage::

    python upstream/measure.py --prs 2 --sizes 8M 40M --ranks 2 4 --out upstream/figures.json

Trainer arguments of the patched variant: ``plugins=[TorchCheckpointIO(mmap=True)]`` (PR 01) and
``--variant-kwargs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

UPSTREAM = Path(__file__).resolve().parent
WIDTH = 2000
LAYERS = {"8M": 2, "40M": 10}  # linear layers of WIDTH x WIDTH: 8,004,000 and 40,020,000 parameters
SAMPLE_INTERVAL = 0.005
JOB_TIMEOUT = 600


# ---- the job (every rank runs this; rank 0 is started by the driver, the others by Lightning's launcher) ----


def run_job(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins import TorchCheckpointIO
    from torch import nn

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS[config["size"]])))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(batch[0]).square().mean()
            return loss

        def validation_step(self, batch: Any, _: int) -> None:
            self.net(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Marker(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            with open(f"{config['markers']}.{trainer.global_rank}", "a") as markers:
                markers.write(f"start {time.monotonic()}\n")

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, WIDTH)), batch_size=2)
    kwargs = dict(config.get("trainer_kwargs", {}))
    if config.get("mmap"):
        kwargs["plugins"] = [TorchCheckpointIO(mmap=True)]  # type: ignore[call-arg]  # PR 01's argument
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=config["ranks"],
        strategy="ddp" if config["ranks"] > 1 else "auto",
        max_steps=1,
        limit_train_batches=config.get("limit_train_batches", 1),
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=config["root"],
        callbacks=[Marker()],
        **kwargs,
    )

    model = MLP()
    if config["fn"] == "fit":
        trainer.fit(model, train_dataloaders=data, val_dataloaders=data, ckpt_path=config.get("ckpt_path"))
    else:
        trainer.validate(model, dataloaders=data, ckpt_path=config.get("ckpt_path"))
    with open(f"{config['markers']}.{trainer.global_rank}", "a") as markers:
        markers.write(f"end {time.monotonic()}\n")
    if config.get("save"):
        trainer.save_checkpoint(config["save"])


# ---- the driver ----


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(root: int) -> list[int]:
    """``root`` and its descendants, from the parent pids in ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def measure(python: str, tree: Path, config: dict[str, Any], retries: int = 3) -> int:
    """Runs one job and returns the peak of its process tree's summed ``RssAnon`` (bytes) in its window: from the
    earliest ``setup`` of a rank to the latest return from ``fit``/``validate``."""
    markers = Path(tempfile.mkdtemp(prefix="markers-", dir=config["root"])) / "rank"
    config = {**config, "markers": str(markers)}
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    cmd = [python, str(Path(__file__).resolve()), "--job", json.dumps(config)]
    log = markers.parent / "output.log"
    with open(log, "wb") as output:
        job = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[tuple[float, int]] = []
    pids, scanned = [job.pid], 0.0
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if time.monotonic() - scanned > 0.05:
                pids, scanned = _tree(job.pid), time.monotonic()
            samples.append((time.monotonic(), sum(_rss_anon(pid) for pid in pids)))
            time.sleep(SAMPLE_INTERVAL)
    finally:
        # the other ranks are in rank 0's process group: none outlives it (a failed rank 0 can leave one waiting)
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
    if job.returncode != 0:
        if retries > 0:  # a port taken by another job between choosing and binding it, on a busy machine
            print(f"job failed ({job.returncode}), retrying: {log.read_text()[-1000:]}", file=sys.stderr)
            return measure(python, tree, config, retries - 1)
        raise RuntimeError(f"job failed ({job.returncode}): {config}\n{log.read_text()[-3000:]}")
    marks: dict[str, list[float]] = {"start": [], "end": []}
    for rank_file in markers.parent.glob("rank.*"):
        for line in rank_file.read_text().split("\n"):
            if line:
                kind, at = line.split()
                marks[kind].append(float(at))
    if len(marks["start"]) != config["ranks"] or len(marks["end"]) != config["ranks"]:
        raise RuntimeError(f"expected a start and an end marker per rank, got {marks}: {config}")
    window = [value for at, value in samples if min(marks["start"]) <= at <= max(marks["end"])]
    if not window:  # a short job whose window fell between two samples, on a busy machine: run it again
        if retries > 0:
            return measure(python, tree, config, retries - 1)
        raise RuntimeError(f"no sample in the job's window: {config}")
    return max(window)


def _optimizer_state_bytes(ckpt: Path) -> int:
    import torch

    states = torch.load(ckpt, weights_only=False, mmap=True)["optimizer_states"]
    tensors: list[torch.Tensor] = []
    for state in states:
        tensors += [value for param in state["state"].values() for value in param.values() if torch.is_tensor(value)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--prs", type=int, default=1, help="the patched variant: master + PRs 01..K (default 1)")
    parser.add_argument("--sizes", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--fns", nargs="+", default=["validate", "fit"], choices=["validate", "fit"])
    parser.add_argument("--variant-kwargs", default="{}", help="JSON: Trainer arguments of the patched variant")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch and Lightning's deps")
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args()
    if args.job:
        run_job(json.loads(args.job))
        return

    work = Path(tempfile.mkdtemp(prefix="upstream-measure-"))
    label = f"master+01..{args.prs:02d}"
    trees = {"master": work / "master", label: work / "patched"}
    for upto, tree in zip((0, args.prs), trees.values()):
        apply = [sys.executable, str(UPSTREAM / "series.py"), "apply", str(tree), "--upto", str(upto)]
        subprocess.run(apply, check=True)
    variant_config = {"master": {}, label: {"mmap": True, "trainer_kwargs": json.loads(args.variant_kwargs)}}
    results: list[dict[str, Any]] = []
    for size in args.sizes:
        ckpt = work / f"{size}.ckpt"
        base = {"size": size, "root": str(work)}
        measure(args.python, trees["master"], {**base, "fn": "fit", "ranks": 1, "save": str(ckpt)})
        s = ckpt.stat().st_size
        optimizer_bytes = _optimizer_state_bytes(ckpt)
        for ranks in args.ranks:
            for fn in args.fns:
                for variant, extra in variant_config.items():
                    config = {**base, **extra, "fn": fn, "ranks": ranks}
                    baseline = measure(args.python, trees[variant], {**config, "limit_train_batches": 0})
                    restore = measure(args.python, trees[variant], {**config, "ckpt_path": str(ckpt)})
                    kept = ranks * optimizer_bytes if fn == "fit" else 0
                    row = {"size": size, "S": s, "N": ranks, "fn": fn, "variant": variant, "kept": kept}
                    # raw: the restore's peak above the baseline's; x_S: net of what the job keeps anyway (below
                    # zero: the no-checkpoint run's own later peak is the higher one, a timing artifact, not a saving)
                    row |= {"baseline": baseline, "restore": restore, "raw_x_S": round((restore - baseline) / s, 2)}
                    row |= {"x_S": round((restore - baseline - kept) / s, 2)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    shutil.rmtree(work)
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv[1:], "results": results}, indent=1) + "\n")
    print(f"\n| size (S) | N | fn | {' | '.join(variant_config)} |\n|---|---|---|---|---|")
    for size in args.sizes:
        for ranks in args.ranks:
            for fn in args.fns:
                cells = [r for r in results if (r["size"], r["N"], r["fn"]) == (size, ranks, fn)]
                s_gib = cells[0]["S"] / 2**30
                figures = " | ".join(f"{r['x_S']:.2f} x S" for r in cells)
                print(f"| {size} ({s_gib:.2f} GiB) | {ranks} | {fn} | {figures} |")


if __name__ == "__main__":
    main()
