"""Node memory and restore time of a DDP or FSDP restore on Lightning master, unpatched vs patched.

Figures for the upstream pull request `03-fsdp-full-state`, and, with the withdrawn serialized-loading PR applied, for
`proposals/serialized-loading.md` (its `turns` variants were removed with that PR: the figures in `figures.json` name
the commit of this script that measured them). Each job is a real DDP (or FSDP) run on CPU over gloo, started as
Lightning starts it: this script runs as global rank 0 and Lightning's own `ddp` launcher starts the other local ranks.
The parent samples the ``RssAnon`` of every process of the job's tree (``/proc/<pid>/status``, every 2 ms, the ranks at
a lower priority) and reports the peak of its sum, the node's peak anonymous memory. A job with a checkpoint is
compared with the same job without one (the baseline):

* ``validate``: ``trainer.validate(ckpt_path=...)`` on one batch; nothing of the checkpoint needs to stay.
* ``fit``: ``trainer.fit(ckpt_path=...)`` with ``max_steps`` equal to the checkpoint's step, so the job ends right
  after the restore; its baseline (no checkpoint, ``max_steps=0``) holds no optimizer state, so the figure is given
  net of the optimizer state the job keeps in any case (N copies under DDP, one in N shards under FSDP).

Beside the memory, each job reports the restore's wall time: from the first rank's ``setup`` hook to the last rank's
``on_validation_start`` or, for ``fit`` (which resumes at ``max_steps`` and skips its loop), ``on_fit_end`` (the
restore and the strategy's setup; the same for every variant).

Which Lightning runs is chosen by ``PYTHONPATH``: ``--master`` and ``--patched`` name two ``src/`` folders (the
pristine snapshot and the snapshot with the series applied, ``upstream/series.py apply``). ``--variants`` are the
patched runs: ``mmap`` (``TorchCheckpointIO(mmap=True)``, PR 01; under FSDP, PR 03, whose full-state load honours it),
``plain`` (no flag). ``--legacy`` saves the checkpoint in torch's legacy (non-zip) format, which cannot be
memory-mapped (PR 01 falls back to reading it into memory). Small sizes only: this is meant for a shared machine.

    python upstream/measure_turns.py --master M/src --patched P/src --sizes 8 --devices 2 4 --fns fit \
        --strategy fsdp --variants mmap
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN = 1024
MIB = 2**20


def _model(layers: int) -> Any:
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    class Mlp(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            # `BoringModel.forward` runs `self.layer`
            self.layer = torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)))  # type: ignore[assignment]

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(RandomDataset(HIDDEN, 4), batch_size=2)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(RandomDataset(HIDDEN, 2), batch_size=2)

    return Mlp()


def _strategy(kind: str) -> Any:
    if kind == "ddp":
        return "ddp"
    from lightning.pytorch.strategies import FSDPStrategy

    # the Trainer refuses the `fsdp` strategy on CPU; a subclass is the documented way around its guard
    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy(state_dict_type="full")


def job(spec: dict[str, Any]) -> None:
    """One measured run (rank 0 of a DDP job; Lightning's launcher re-runs this command for the other ranks)."""
    from lightning.pytorch import Callback, Trainer

    class Marker(Callback):
        """Appends ``<event> <monotonic time>`` to the job's marker file: the restore's window."""

        def _mark(self, event: str) -> None:
            with open(spec["markers"], "a") as markers:
                markers.write(f"{event} {time.monotonic()}\n")

        def setup(self, *_: Any, **__: Any) -> None:
            self._mark("start")

        def on_train_start(self, *_: Any) -> None:
            self._mark("end")

        def on_fit_end(self, trainer: Any, *_: Any) -> None:
            # a resumed `fit` that has reached `max_steps` skips its loop and `on_train_start`
            if trainer.global_step == spec["steps"]:
                self._mark("end")

        def on_validation_start(self, trainer: Any, *_: Any) -> None:
            if not trainer.training:
                self._mark("end")

    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=_strategy(spec["strategy"]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        max_steps=spec["steps"] if spec["ckpt"] else 0,
    )
    if spec["variant"] == "mmap":
        from lightning.pytorch.plugins import TorchCheckpointIO

        kwargs["plugins"] = [TorchCheckpointIO(mmap=True)]  # type: ignore[call-arg]  # PR 01's argument
    kwargs["callbacks"] = [Marker()]
    trainer = Trainer(**kwargs)
    getattr(trainer, spec["fn"])(_model(spec["layers"]), ckpt_path=spec["ckpt"])


def prepare(layers: int, path: Path, legacy: bool = False) -> None:
    """Writes a checkpoint of the model after two steps of Adam, with Lightning's single-device Trainer (``legacy``:
    re-saved in torch's legacy non-zip format)."""
    import torch
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(_model(layers))
    trainer.save_checkpoint(path)
    if legacy:
        torch.save(torch.load(path, weights_only=False), path, _use_new_zipfile_serialization=False)


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def measure(python: str, src: str, spec: dict[str, Any], timeout: float = 600.0) -> dict[str, float]:
    """Runs one job and samples its process tree; returns its node peak anonymous memory and wall time."""
    import psutil

    markers = Path(tempfile.mkstemp(prefix="markers-")[1])
    spec = dict(spec, markers=str(markers))
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    start = time.monotonic()
    # the ranks run at a lower priority than this sampler, so that it does not miss a short peak of a busy node
    proc = subprocess.Popen(
        [python, __file__, "--job", json.dumps(spec)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(10),
    )
    root = psutil.Process(proc.pid)
    pids = [proc.pid]
    peak = 0
    last_scan = 0.0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - start > timeout:
                raise TimeoutError(f"job {spec} did not finish in {timeout} s")
            if now - last_scan > 0.2:
                try:
                    pids = [proc.pid] + [child.pid for child in root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    break
                last_scan = now
            peak = max(peak, sum(_rss_anon(pid) for pid in pids))
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            for child in root.children(recursive=True):
                child.kill()
            proc.kill()
    if proc.wait() != 0:
        raise RuntimeError(f"job {spec} failed with exit code {proc.returncode}")
    marks: dict[str, list[float]] = {"start": [], "end": []}
    for line in markers.read_text().split("\n"):
        if line:
            event, at = line.split()
            marks[event].append(float(at))
    markers.unlink()
    restore = max(marks["end"]) - min(marks["start"]) if marks["start"] and marks["end"] else None
    return {"peak": peak, "seconds": time.monotonic() - start, "restore_seconds": restore}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--master", help="src/ of the unpatched snapshot")
    parser.add_argument("--patched", help="src/ of the snapshot with the series applied")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch, psutil and Lightning's deps")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 40], help="model sizes in millions of parameters")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="local ranks (N)")
    parser.add_argument("--fns", nargs="+", default=["validate", "fit"])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--variants", nargs="+", default=["mmap"], choices=["mmap", "plain"])
    parser.add_argument("--legacy", action="store_true", help="save the checkpoint in torch's legacy non-zip format")
    parser.add_argument("--out", type=Path, help="write the raw results here as JSON")
    args = parser.parse_args()
    if args.job:
        job(json.loads(args.job))
        return

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            layers = max(1, round(size * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
            ckpt = Path(tmp, f"{size}M.ckpt")
            env = dict(os.environ, PYTHONPATH=args.master)
            code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import measure_turns as m;"
            code += f" m.prepare({layers}, {str(ckpt)!r}, {args.legacy})"
            subprocess.run([args.python, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
            ckpt_mib = ckpt.stat().st_size / MIB
            params = layers * (HIDDEN * HIDDEN + HIDDEN)
            weights_mib = params * 4 / MIB
            for devices in args.devices:
                for fn in args.fns:
                    base = dict(layers=layers, devices=devices, fn=fn, steps=2, strategy=args.strategy, variant="")
                    runs = {
                        "baseline": (args.master, dict(base, ckpt=None)),
                        "master": (args.master, dict(base, ckpt=str(ckpt))),
                    }
                    runs.update({v: (args.patched, dict(base, ckpt=str(ckpt), variant=v)) for v in args.variants})
                    row: dict[str, Any] = dict(
                        size_m=size, params=params, ckpt_mib=ckpt_mib, devices=devices, fn=fn, strategy=args.strategy
                    )
                    row["legacy_format"] = args.legacy
                    for name, (src, spec) in runs.items():
                        row[name] = measure(args.python, src, spec)
                    # what the job keeps in any case after `fit`: the optimizer state (Adam: 2 x weights), whole on
                    # each DDP rank, one shard per FSDP rank
                    kept = (devices if args.strategy == "ddp" else 1) * 2 * weights_mib if fn == "fit" else 0.0
                    row["kept_mib"] = kept
                    line = f"{size}M (S={ckpt_mib:.0f} MiB) N={devices} {fn:8s} {args.strategy}:"
                    for name in runs:
                        if name == "baseline":
                            continue
                        raw = (row[name]["peak"] - row["baseline"]["peak"]) / MIB
                        # raw: the peak above the baseline's; net: less what the job keeps anyway (below zero: the
                        # job's own later peak hides the restore, a timing artifact, not a saving)
                        row[name].update(raw_mib=raw, raw_x_s=raw / ckpt_mib, net_mib=raw - kept)
                        row[name]["net_x_s"] = (raw - kept) / ckpt_mib
                        line += f" {name} raw {raw / ckpt_mib:.2f} net {(raw - kept) / ckpt_mib:.2f} x S"
                        seconds = row[name]["restore_seconds"]
                        line += f" restore {seconds:.1f} s;" if seconds is not None else " restore ? s;"
                    results.append(row)
                    print(line, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv[1:], "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
