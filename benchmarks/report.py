"""The report of a restore benchmark run, made from its ``results.json`` alone: ``report.md`` (the default run's is
``docs/benchmarks.md``), ``benchmark_results.json`` (one record per checkpoint size, N, mode and entry point: the
figures the page shows) and the plots (``plots.py``).

    python benchmarks/report.py bench_output/full/results.json [--docs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import against, plots  # noqa: E402
from benchmarks._measure import overheads  # noqa: E402
from benchmarks.modes import BASELINES, FAMILIES, MODES, TEXT, baseline_of, upstream_of  # noqa: E402

GIB = 2**30
DOCS = Path(__file__).resolve().parents[1] / "docs"
WHOLE = "## Whole process, restore only"
COLD = "## Cold resumes"
# sections of docs/benchmarks.md that other runs write (`--whole-only`, `--cold`, scale.py, failure_output.py), kept
# as they are
KEPT = (WHOLE, COLD, "## The turns at scale", "## What a failure prints")
Record = dict[str, Any]

# What the benchmark was written to show, checked at every size: (mode, entry, figure, scope, lowest, highest).
# figure: the raw or headline overhead over S, or "time": the window over the family upstream's; scope: "every" N,
# the largest ("top"), or the largest "rise" from a smaller N to a larger one. Nothing was tuned to meet them.
# fmt: off
TARGETS = [
    ("upstream", "validate", "raw", "top", 3.5, 4.3), ("upstream", "fit", "raw", "top", 3.5, 4.3),
    ("ours-true", "fit", "x S", "every", None, 0.3), ("ours-true", "fit", "x S", "rise", None, 0.1),
    ("ours-true", "validate", "x S", "every", None, 0.3), ("ours-true", "validate", "x S", "rise", None, 0.1),
    ("mmap-plugin", "fit", "x S", "top", None, 0.1), ("mmap-plugin", "validate", "x S", "top", None, 0.1),
    ("fsdp-ours", "fit", "x S", "every", None, 0.1), ("fsdp-ours", "validate", "x S", "every", None, 0.1),
    ("zero-ours", "fit", "x S", "every", None, 0.1), ("oss-ours", "fit", "x S", "every", None, 0.1),
    ("fabric-ours", "fit", "x S", "every", None, 0.1), ("fabric-fsdp-ours", "fit", "x S", "every", None, 0.1),
    ("ours-true", "fit", "time", "top", None, 0.5), ("ours-true", "validate", "time", "top", None, 1.0),
    ("mmap-plugin", "fit", "time", "top", None, 1.0), ("mmap-plugin", "validate", "time", "top", None, 1.0),
    ("fsdp-ours", "fit", "time", "top", None, 1.0), ("fsdp-ours", "validate", "time", "top", None, 1.0),
    ("zero-ours", "fit", "time", "top", None, 1.0), ("oss-ours", "fit", "time", "top", None, 1.0),
    ("fabric-ours", "fit", "time", "top", None, 1.0), ("fabric-fsdp-ours", "fit", "time", "top", None, 1.0),
    ("ours-true", "whole", "time", "every", None, 1.0),
]
# fmt: on

HOLDS = """How each mode holds the checkpoint (S_opt, Adam's state, is about two thirds of S):

- `upstream`, `ours-off`: every rank reads the whole file into private memory before DDP's setup and keeps it until \
`resume_end`: about N x S. For fit, Adam adopts the checkpoint's own `exp_avg` and `exp_avg_sq`: N x S_opt stays.
- `proposal-2021`: ranks read one after the other and drop the weights after their turn, but keep the optimizer \
state until `resume_end`, also for validate: the peak comes in the last turn, S + (N-1) x S_opt.
- `mmap-plugin`: upstream's restore with `torch.load(..., mmap=True)`: the file's pages sit in the page cache, shared \
and not anonymous, and each rank copies the weights from them. For fit, Adam's state is the file's pages at the end \
of the window (`Optimizer.load_state_dict` keeps the loaded tensors) until the first step writes them.
- `ours-true`, `ours-1`, `ours-2` (memory-mapped; all, 1 or 2 local ranks at a time in the first stage): each rank \
copies the weights from the mapped file in its turn and drops what it no longer needs at its end; for fit, after \
DDP's setup, every rank copies into private memory the optimizer state its optimizers keep (with `ours-1` and \
`ours-2` in turns too).
- `ours-true-eager`: each rank reads the whole file into private memory in its turn; for fit it drops the optimizer \
state after the first stage and reads the file again in its second turn."""

DEFINITIONS = """## Definitions

- **Node memory**: the job's whole process tree, summed, sampled from a separate process. *Anonymous* memory is \
private memory that only exiting gives back: `RssAnon` of `/proc/<pid>/status`, every {interval} ms. *PSS* adds \
file-backed pages, each shared page divided among the processes that map it (a mapped checkpoint counts about once \
per node): the anonymous memory plus `Pss - Pss_Anon` of `smaps_rollup` from the sweep over the tree nearest in time \
(a sweep walks page tables, 100 ms or more at several GiB: too slow for a short peak; see *Sampling*).
- **Restore window**: from the earliest rank's end of `LightningModule.setup` (the process group exists, no restore \
stage has run) to the latest rank's `on_train_start` (fit) or `on_validation_start` (validate), after `resume_end`; \
for Fabric, the `fabric.load` call. It holds DDP's `strategy.setup` too, which the baseline also runs.
- **Raw overhead**: the peak of node anonymous memory inside the window minus the baseline job's (same N, entry \
point and program, no checkpoint), whose own peak is a transient while DDP wraps the model.
- **Optimizer state kept** (fit): what the optimizers of all ranks hold at the end of the window, which every \
training job holds from its first step on. State still in the file's mapped pages (*mapped*) is not anonymous and is \
left in. *Raw minus optimizer state* undercounts (the peaks need not coincide); **net**, the fit figure, is the peak \
minus the larger of the baseline's peak and the baseline's memory at the end of its window plus the state kept. \
Validate keeps no optimizer state: its figure is the raw overhead.
- **Restore time**: the window; *vs upstream*: over the family's upstream at the same N and entry point. **Exact**: \
every rank compared what it restored bit for bit with the checkpoint (the run exits non-zero otherwise).
- **Floor**: the least the hardware needs, measured in the same run: reading the file once per node (sequential \
reads into one reused 8 MiB buffer, from the page cache as a warm restore finds it; median of 3) plus N ranks at \
once copying what each keeps from a fresh mapping of the checkpoint: the weights into memory written beforehand (the \
model's own, which the job without a checkpoint has too), then, for fit, the optimizer state into freshly allocated \
memory, the first touch of its pages included (the optimizer state must be allocated either way); each phase from \
the first rank's start to the last one's end. *x floor*: the window over it. **Own**: the window less the window of \
the baseline job of the same repeat (same N and entry point, no checkpoint: DDP's setup between the two stages, \
which every job pays), median over the repeats; *own x floor* (`restore_over_floor`) is that over the floor. A rank \
of FSDP, ZeRO or OSS keeps only its shard, so their floor is lower.
- **Medians and range**: every time is the median of the cell's jobs (`repeats`), with the smallest and largest in \
`benchmark_results.json` (`*_range`) and, where the page shows them, in parentheses."""

INTRO = {
    "fsdp": """Lightning's `FSDPStrategy` (`state_dict_type="full"`, one unit per layer; on CPU the test suite's \
`CPUFSDPStrategy`, which wraps with `device_id=cpu`). FSDP restores with collectives, so no turns: `fsdp-ours` maps \
the file and each rank copies only its shard of the optimizer state; `fsdp-upstream` materializes the whole optimizer \
state on every rank, for validate too. Exactness is checked on the gathered weights and state.""",
    "zero": """`trainer.fit` with a sharded optimizer: torch's `ZeroRedundancyOptimizer` under DDP (against the DDP \
`baseline`), and fairscale's `OSS` + `ShardedDataParallel` (Lightning 1.x's `ddp_sharded`: `harness/models.py`). \
*Optimizer state kept*: the sum of the ranks' shards.""",
    "fabric": """`fabric.load(path, {"model": ..., "optimizer": ..., "step": 0})` of the same tensors in the layout \
`fabric.save` writes, under Fabric's DDP after `fabric.setup`; the baseline is the program without the call.""",
    "fabric-fsdp": """The same `fabric.load` of the full checkpoint under Fabric's `FSDPStrategy` (on CPU \
`harness/models.py`'s `FabricCPUFSDPStrategy`), one unit per layer.""",
}
SECTIONS = (("Results", ("ddp",)), ("FSDP, full checkpoint", ("fsdp",)), ("Sharded optimizer state", ("zero", "oss")),
            ("Lightning Fabric", ("fabric",)), ("Lightning Fabric with FSDP", ("fabric-fsdp",)))  # fmt: skip
RESULTS = """Overheads in GiB, x S in parentheses, the headline in bold (fit: net; validate: raw); baseline rows show \
the baseline's own memory. *PSS above baseline* also counts the file's mapped pages. *CPU*: all ranks' CPU time \
inside the window; *other load*: cores' worth of CPU that other processes used meanwhile."""
WHOLE_TEXT = """Restore-only jobs timed as whole processes, as a user sees a resume: `trainer.fit(ckpt_path=...)` \
with `max_steps` equal to the checkpoint's step, from the start of the first process to the exit of the last rank; \
no sampler runs. `upstream` and `ours-true` alternate (ABBA), {repeats} of each per cell: medians, and every job's \
time. *CPU*: all ranks' user + system time to their exit (`wait4`, as their child subreaper). *Restore*: from the \
first rank's Trainer `setup` to the last rank's `on_fit_end`, where the two run different code. Written by \
`python benchmarks/restore_benchmark.py --whole-only --docs`."""
SIZES_TEXT = """The headline overhead over S of every mode at every size it was measured at, and the window at the \
largest N (x the family's upstream; the baselines' windows are DDP's or FSDP's setup, which every job runs). A \
figure holds only if it holds at every size; fixed costs (a few MiB per rank) weigh more in a smaller S."""
SAMPLING_TEXT = """The disagreement: between `Anonymous:` and `RssAnon` of one process whose `RssAnon` held still \
during the page-table walk. Gaps between fast samples are the sampler waiting for a CPU."""


def target_label(mode: str, entry: str, figure: str, scope: str, low: Optional[float], high: float) -> str:
    entry = "load" if FAMILIES[MODES[mode].family].action == "fabric" else entry
    what = {"raw": " (raw)", "x S": " (net)" if entry in ("fit", "load") else "", "time": " time"}[figure]
    bound = ("rises by " if scope == "rise" else "") + (f"{low} to {high}" if low is not None else f"<= {high}")
    unit = f"x {upstream_of(mode)}'s" if figure == "time" else "x S"
    return (
        f"{mode} {entry}{what}: {bound} {unit} {dict(every='at every N', top='at the largest N').get(scope, 'with N')}"
    )


TITLES = {"ddp": "DDP", "fsdp": "FSDP", "zero": "sharded optimizers", "oss": "sharded optimizers", "fabric": "Fabric"}


def _family_name(rec: dict[str, Any]) -> str:
    """What a record's mode restores with, for the page's title (Fabric with FSDP counts as Fabric)."""
    return TITLES[MODES[rec["mode"]].family.split("-")[0]]


def restore_window(run: dict[str, Any]) -> Optional[float]:
    """A whole-process job's restore: from the first rank's ``setup`` to the last rank's ``fit_end``."""
    marks = [(run.get("phases") or {}).get(event) or [] for event in ("setup", "fit_end")]
    return None if any(len(m) != run["devices"] for m in marks) else max(marks[1]) - min(marks[0])


def _median(values: Any) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _range(values: Any) -> Optional[list[float]]:
    """``[min, max]`` of the known values (the spread a median is shown with), or ``None``."""
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def cache_of(run: dict[str, Any]) -> str:
    """A job's page cache state (results of runs before ``--cache`` existed: ``warm``)."""
    return run.get("cache") or "warm"


def cold_reads(size: dict[str, Any]) -> list[float]:
    """Every cold sequential read of the checkpoint one size of a run made: the floor's, and the one before each cold
    job."""
    jobs = [r.get("cold_read_s") for r in size["runs"] + size["whole"]]
    return [*(size.get("floor") or {}).get("cold_read_all_s", []), *(t for t in jobs if t is not None)]


def records(results: dict[str, Any]) -> list[Record]:
    """One record per checkpoint size, N, mode, entry point (``whole``: the whole-process jobs) and page cache state
    (``cache``: ``warm`` or ``cold``; a baseline, which reads no checkpoint, is recorded under each cache state the run
    measured): medians of its jobs and their range (``*_range``: [min, max]), their overheads against the baseline
    job of the same repeat, the floor, and ratios. Cold records also carry the storage's read rate, measured in the
    same run, and the cold window's goal."""
    out: list[Record] = []
    for size in results["sizes"]:
        ck, floor = size["checkpoint"], size.get("floor") or {}
        caches = size.get("caches") or ["warm"]
        base = {(r["devices"], r["entry"], r["repeat"], r["mode"]): r for r in size["runs"] if r["mode"] in BASELINES}
        groups: dict[tuple[int, str, str, str], list[Record]] = {}
        for run in size["runs"] + [{**r, "entry": "whole"} for r in size["whole"]]:
            for cache in caches if run["mode"] in BASELINES else [cache_of(run)]:
                groups.setdefault((run["devices"], run["entry"], run["mode"], cache), []).append(run)
        cold = cold_reads(size)
        cold_read_s = _median(cold)
        cells = []
        for (n, entry, mode, cache), runs in sorted(groups.items()):
            rec = {"params": ck["params"], "checkpoint_bytes": ck["size_bytes"], "devices": n, "mode": mode}
            rec.update(entry=entry, cache=cache)
            # the floor: the file read once (from the page cache, or for cold from storage) + what the ranks keep
            # copied: the weights into memory written before, the optimizer state into new memory (first touch)
            copy = next((c for c in floor.get("copy", []) if c["devices"] == n), None)
            params_s = copy and copy["params_s"]
            optimizer_s = copy and copy.get("optimizer_fresh_s", copy["optimizer_s"])
            copy_s = copy and params_s + (0.0 if entry == "validate" else optimizer_s)
            read_s = cold_read_s if cache == "cold" else floor.get("read_s")
            rec.update(repeats=len(runs), read_s=read_s, copy_s=copy_s)
            rec["copy_prealloc_s"] = copy and copy["params_s"] + (0.0 if entry == "validate" else copy["optimizer_s"])
            rec["floor_s"] = read_s + copy_s if read_s is not None and copy_s is not None else None
            if cache == "cold":
                rec["cold_read_s"], rec["cold_reads"] = cold_read_s, len(cold)
                rec["cold_read_range_s"] = _range(cold)
                rec["read_rate_bytes_s"] = ck["size_bytes"] / cold_read_s if cold_read_s else None
            rec["cold_read_before_s"] = _median(r.get("cold_read_s") for r in runs)
            rec["major_faults"] = _median(r.get("major_faults") for r in runs)
            rec["read_bytes"] = _median(r.get("read_bytes") for r in runs)
            if entry == "whole":
                windows = [restore_window(r) for r in runs]
                rec.update(window_s=_median(windows), window_range_s=_range(windows))
                seconds = [r["seconds"] for r in runs]
                rec.update(whole_s=_median(seconds), whole_range_s=_range(seconds))
                rec.update(whole_cpu_s=_median(sum(r["cpu_seconds"]) for r in runs), exact=None)
                rec.update(all_whole_s=[r["seconds"] for r in runs], time="whole_s")
                loads = [r["other_cpu_seconds"] / r["seconds"] for r in runs]
                rec.update(other_load=_median(loads), other_load_max=max(loads))
                cells.append(rec)
                continue
            keys = [(n, entry, r["repeat"], baseline_of(mode)) for r in runs]
            over = [overheads(r, base[k]) for r, k in zip(runs, keys) if k in base and mode not in BASELINES]
            for key in ("anon_peak", "anon_end", "pss_peak", "optimizer_state_bytes", "optimizer_state_mapped_bytes"):
                rec[key if key.endswith("bytes") else f"{key}_bytes"] = _median(r[key] for r in runs)
            for key in ("raw", "minus_optimizer", "net", "pss"):
                rec["overhead_bytes" if key == "raw" else f"overhead_{key}_bytes"] = _median(o[key] for o in over)
            rec["headline_bytes"] = rec["overhead_net_bytes"] if entry == "fit" else rec["overhead_bytes"]
            rec.update(window_s=_median(r["window"] for r in runs), window_range_s=_range(r["window"] for r in runs))
            rec["window_cpu_s"] = _median(r["window_cpu_seconds"] for r in runs)
            # the restore's own time: each job's window less its repeat's baseline window (same N and entry point)
            own = [r["window"] - base[k]["window"] for r, k in zip(runs, keys) if k in base and mode not in BASELINES]
            rec.update(restore_s=_median(own), restore_range_s=_range(own))
            loads = [r["other_cpu_seconds"] / r["job_seconds"] for r in runs]
            rec.update(other_load=_median(loads), other_load_max=max(loads))
            rec.update(exact=None if mode in BASELINES else all(r["exact"] for r in runs), time="window_s")
            cells.append(rec)
        find = {(r["devices"], r["entry"], r["mode"], r["cache"]): r for r in cells}
        for rec in cells:
            time = rec.pop("time")
            ref = find.get((rec["devices"], rec["entry"], upstream_of(rec["mode"]), rec["cache"]), {}).get(time)
            known = ref and rec[time] is not None and rec["mode"] not in BASELINES
            rec["vs_upstream"] = rec[time] / ref if known else None
            rec["window_over_floor"] = rec["window_s"] / rec["floor_s"] if rec["floor_s"] and rec["window_s"] else None
            if rec["entry"] == "whole":  # no baseline job: the restore's own time is not measured
                rec.update(restore_s=None, restore_range_s=None)
            floor_s = rec["floor_s"]
            rec["restore_over_floor"] = rec["restore_s"] / floor_s if rec["restore_s"] is not None and floor_s else None
            spread = rec["restore_range_s"]
            rec["restore_over_floor_range"] = [v / floor_s for v in spread] if spread and floor_s else None
            if rec["cache"] == "cold":
                warm = find.get((rec["devices"], rec["entry"], rec["mode"], "warm"), {})
                rec["warm_window_s"], rec["warm_whole_s"] = warm.get("window_s"), warm.get("whole_s")
                # the goal: the restore's window cold <= 1.2 x S / the storage's rate + the warm window
                known = rec["cold_read_s"] is not None and rec["warm_window_s"] is not None and rec["window_s"]
                rec["goal_window_s"] = 1.2 * rec["cold_read_s"] + rec["warm_window_s"] if known else None
                rec["goal_met"] = rec["window_s"] <= rec["goal_window_s"] if known else None
            against.annotate(rec, ck)
            headline = rec.get("headline_bytes")
            rec["headline_x_s"] = None if headline is None else headline / rec["checkpoint_bytes"]
        out += cells
    return out


def _gib(value: Optional[float], size: int, bold: bool = False) -> str:
    text = "–" if value is None else f"{value / GIB:.2f} ({value / size:.2f})"
    return f"**{text}**" if bold and value is not None else text


def _num(value: Optional[float], bold: bool = False, digits: int = 2) -> str:
    return "–" if value is None else f"**{value:.{digits}f}**" if bold else f"{value:.{digits}f}"


def _size(params: int, size: int) -> str:
    return f"{params / 1e6:.0f}M, S = {size / GIB:.2f} GiB"


def _table(header: str, rows: list[list[Any]]) -> list[str]:
    """A Markdown table (``header``: its columns, ``" | "`` between them); nothing without rows."""
    lines = ["| " + " | ".join(map(str, row)) + " |" for row in [header.split(" | "), *rows]]
    return [lines[0], "|" + "---|" * (header.count(" | ") + 1), *lines[1:], ""] if rows else []


def family_tables(recs: list[Record], families: tuple[str, ...]) -> list[str]:
    """One table per entry point of the modes of ``families`` (their baselines first): memory, time, exactness."""
    modes = [m for m in BASELINES if m in {FAMILIES[f].baseline for f in families}]
    modes += [m for m in MODES if MODES[m].family in families and m not in BASELINES]
    lines = []
    for entry in ("fit", "validate"):
        fit, chosen = entry == "fit", [r for m in modes for r in recs if (r["mode"], r["entry"]) == (m, entry)]
        rows = []
        for r in chosen:
            size, base = r["checkpoint_bytes"], r["mode"] in BASELINES
            own = f"its peak: {r['anon_peak_bytes'] / GIB:.2f} GiB"
            if base:
                memory = ["–", f"{own}, at its end: {r['anon_end_bytes'] / GIB:.2f} GiB", "–", "–"] if fit else [own]
            elif fit:
                kept = _gib(r["optimizer_state_bytes"], size)
                kept += f", mapped: {_gib(mapped, size)}" if (mapped := r["optimizer_state_mapped_bytes"]) else ""
                memory = [_gib(r["overhead_net_bytes"], size, True), _gib(r["overhead_bytes"], size), kept]
                memory.append(_gib(r["overhead_minus_optimizer_bytes"], size))
            else:
                memory = [_gib(r["overhead_bytes"], size, True)]
            pss, ratio = ("–", "–") if base else (_gib(r["overhead_pss_bytes"], size), _num(r["vs_upstream"], True))
            exact = "–" if base else "yes" if r["exact"] else "**NO**"
            rows.append([f"`{r['mode']}`", r["devices"], *memory, pss, _num(r["window_s"]), ratio])
            rows[-1] += [_num(r["window_cpu_s"]), _num(r["other_load"]), exact]
        if all(r["mode"] in BASELINES for r in chosen):
            continue
        call = "fabric.load" if families[0].startswith("fabric") else f"trainer.{entry}"
        memory = "net | raw | optimizer state kept | raw minus optimizer state" if fit else "raw"
        header = f"mode | N | {memory} | PSS above baseline | window (s) | vs upstream | CPU (s) | other load | exact"
        lines += [f"### `{call}`", "", *_table(header, rows)]
    return lines


def target_rows(recs: list[Record]) -> list[tuple[str, str, bool, float]]:
    """(target, what was measured, met, worst figure) of each target measured, checked at every size."""
    key = {"raw": "overhead_bytes", "x S": "headline_bytes", "time": "vs_upstream"}
    out = []
    for mode, entry, figure, scope, low, high in TARGETS:
        per_size: dict[int, list[tuple[int, float]]] = {}
        for r in sorted(recs, key=lambda r: (r["params"], r["devices"])):
            if (r["mode"], r["entry"]) == (mode, entry) and r[key[figure]] is not None:
                value = r[key[figure]] / (1 if figure == "time" else r["checkpoint_bytes"])
                per_size.setdefault(r["params"], []).append((r["devices"], value))
        figures, texts = [], []
        for params, values in per_size.items():
            if scope == "rise":
                values = [(0, max([b - a for i, (_, a) in enumerate(values) for _, b in values[i + 1 :]], default=0.0))]
            chosen = values[-1:] if scope == "top" else values
            figures += [v for _, v in chosen]
            texts.append(
                f"{params / 1e6:.0f}M: " + ", ".join(f"N={n}: {v:.2f}" if n else f"{v:.2f}" for n, v in chosen)
            )
        if figures:
            met = all((low is None or f >= low) and (high is None or f <= high) for f in figures)
            worst = (min if low is not None else max)(figures)
            out.append((target_label(mode, entry, figure, scope, low, high), "; ".join(texts), met, worst))
    return out


def whole_section(recs: list[Record]) -> list[str]:
    """The whole-process jobs: per size and N, each mode's medians and ours over upstream's."""
    whole = {(r["params"], r["devices"], r["mode"]): r for r in recs if r["entry"] == "whole"}
    rows = []
    for params, n in sorted({(p, n) for p, n, _ in whole}):
        up, ours = (whole.get((params, n, mode), {}) for mode in ("upstream", "ours-true"))
        cells = [_size(params, (up or ours)["checkpoint_bytes"]), n]
        for key in ("whole_s", "whole_cpu_s", "window_s"):
            ratio = ours[key] / up[key] if ours.get(key) is not None and up.get(key) else None
            cells += [f"{_num(up.get(key))}; {_num(ours.get(key))}", _num(ratio, key == "whole_s")]
        each = "; ".join(", ".join(f"{t:.1f}" for t in c.get("all_whole_s", [])) or "–" for c in (up, ours))
        rows.append([*cells, each, _num(max(c.get("other_load") or 0.0 for c in (up, ours)))])
    repeats = "/".join(sorted({str(r["repeats"]) for r in whole.values()}))
    header = "model, S | N | upstream; ours-true (s) | ours / upstream | CPU, upstream; ours-true (s) | CPU ratio"
    header += " | restore, upstream; ours-true (s) | restore ratio | each job, upstream; ours-true (s) | other load"
    return [WHOLE, "", WHOLE_TEXT.format(repeats=repeats), "", *_table(header, rows)]


def sizes_section(recs: list[Record], image_dir: str) -> list[str]:
    """The headline overhead over S of every mode at every size and N, and every mode's window at N=4."""
    sizes = sorted({(r["params"], r["checkpoint_bytes"]) for r in recs if r["entry"] != "whole"})
    labels = [_size(params, size) for params, size in sizes]
    find = {(r["params"], r["devices"], r["entry"], r["mode"]): r for r in recs}
    keys = sorted({(list(MODES).index(r["mode"]), r["mode"], r["devices"]) for r in recs})
    plot = f"![restore overhead / S against size]({image_dir}/restore_sizes.png)"
    lines = _section("By checkpoint size", SIZES_TEXT, plot)
    for entry in ("fit", "validate"):
        rows = []
        for _, mode, n in keys:
            values = [find.get((p, n, entry, mode), {}).get("headline_x_s") for p, _ in sizes]
            if mode not in BASELINES and any(v is not None for v in values):
                rows.append([f"`{mode}`", n, *map(_num, values), _num(max(v for v in values if v is not None), True)])
        title = f"### `{entry}` ({'net' if entry == 'fit' else 'raw'}) / S"
        lines += [title, "", *_table(" | ".join(["mode", "N", *labels, "worst"]), rows)]
    rows, top = [], max(n for _, _, n in keys)
    for _, mode, n in (key for key in keys if key[2] == top):
        for entry in ("fit", "validate"):
            if any(found := [find.get((p, n, entry, mode)) for p, _ in sizes]):
                ratios = [f" ({r['vs_upstream']:.2f} x)" if r and r["vs_upstream"] else "" for r in found]
                rows.append(
                    [f"`{mode}`", entry, *(f"{r['window_s']:.2f}{x}" if r else "–" for r, x in zip(found, ratios))]
                )
    return lines + [f"### Restore time at N={top} (s)", "", *_table(" | ".join(["mode", "entry", *labels]), rows)]


def _section(title: str, *parts: Any) -> list[str]:
    """A ``## title`` section: each part a paragraph (a string) or lines (a list: a table's)."""
    lines = [f"## {title}", ""]
    for part in parts:
        lines += part if isinstance(part, list) else [part, ""]
    return lines


def report(results: dict[str, Any], recs: list[Record], image_dir: str) -> str:
    """The Markdown page: what was run, the modes and definitions, the tables and plots of the largest size, the
    floor, every size, the whole-process jobs, the targets and the sampling, all warm; then the cold resumes, if any
    were measured."""
    m, size = results["machine"], results["sizes"][-1]
    cold = [r for r in recs if r["cache"] == "cold"]
    recs = [r for r in recs if r["cache"] == "warm"]
    sizes = sorted({(r["params"], r["checkpoint_bytes"]) for r in recs if r["entry"] != "whole"})
    largest = [r for r in recs if sizes and r["params"] == sizes[-1][0] and r["entry"] != "whole"]
    runs = [r for s in results["sizes"] for r in s["runs"]]
    load = statistics.mean(r["other_cpu_seconds"] / r["job_seconds"] for r in runs) if runs else 0.0
    ck = ", ".join(f"{s['checkpoint']['params']:,} parameters (S = {s['checkpoint']['size_bytes'] / GIB:.3f} GiB)"
                   for s in results["sizes"])  # fmt: skip
    cold_text = ", or dropped from it and checked gone (cold: *Cold resumes*)" if cold else ""
    families = [f for f in ("DDP", "FSDP", "sharded optimizers", "Fabric") if any(_family_name(r) == f for r in recs)]
    head = f"""# Benchmark: node memory and time of a restore ({", ".join(families)})

Generated, with its plots and `benchmark_results.json`, by `benchmarks/restore_benchmark.py` (the page by \
`benchmarks/report.py` from the run's `results.json`); every number comes from that one run, but in the sections \
that name another.

- Command: `{results["command"]}` ({results["date"]}, {results["wall_seconds"] / 60:.1f} minutes in all)
- Versions: torch {m["torch"]}, pytorch-lightning {m["pytorch-lightning"]}, lightning {m["lightning"]}, Python \
{m["python"]}; `serialized_restore` at {results["package"]}
- Machine: {m["cores"]} cores ({m["cpu"]}), {m["ram_gib"]:.1f} GiB RAM, Linux {m["kernel"]}, no GPU
- Checkpoints: an MLP of {size["checkpoint"]["depth"]} linear layers trained {size["checkpoint"]["global_step"]} \
steps with Adam, saved by `trainer.save_checkpoint`: {ck}; the tables before *Against the floor* are for the largest.
- Jobs: gloo on CPU through Lightning's own launcher, `OMP_NUM_THREADS=1`; {size["repeats"]} measured job(s) per \
cell (the median is shown); before each job the checkpoint is read into the page cache and checked there with \
`mincore` (warm){cold_text}; each (N, entry point) and repeat starts with its baseline. Restore jobs build the model \
with zeros (the same pages as a random init).
- Load: other processes used on average {load:.2f} of the {m["cores"]} cores while the jobs ran. Restore times are \
sensitive to that; memory figures are not.
"""
    modes = [[f"`{mode}`", TEXT[mode]] for mode in MODES if any(r["mode"] == mode for r in recs)]
    lines = [head, *_section("Modes", _table("mode | what restores", modes), HOLDS)]
    lines += [DEFINITIONS.format(interval=round(size["fast_interval_s"] * 1000)), ""]
    for title, families in SECTIONS:
        if tables := family_tables(largest, families):
            intro = [INTRO[families[0]]] if families[0] in INTRO else []
            if title == "Results":
                top = max(r["devices"] for r in largest)
                names = ("restore_memory", "restore_time", "restore_timeline")
                whats = ("restore overhead / S against N", "restore time against N", f"node memory at N={top}")
                intro = [f"![{what}]({image_dir}/{name}.png)" for name, what in zip(names, whats)] + [RESULTS]
            if families == ("fsdp",):
                intro.append(f"![FSDP restore overhead / S against N]({image_dir}/restore_fsdp.png)")
            lines += _section(title, *intro, tables)
    table, worst = against.floor_section(recs)
    own = (
        "The restore window over the floor (*Definitions*); *own*: the window less the window of the baseline job of"
        " the same repeat (DDP's setup between the two stages, a broadcast of the weights from rank 0 that every job"
        " pays), over the floor: the median, and in parentheses the range over the repeats."
    )
    lines += _section("Against the floor", own, table, *worst)
    lines += against.prediction_section(recs)
    lines += sizes_section(recs, image_dir) if len(sizes) > 1 else []
    lines += whole_section(recs) if any(r["entry"] == "whole" for r in recs) else []
    if results["quick"]:
        lines += _section("Targets", "Not checked in a `--quick` run: a few MiB of fixed costs per rank are a large"
                          " multiple of a small S.")  # fmt: skip
    elif rows := [[t, v, _num(w), "yes" if ok else "**no**"] for t, v, ok, w in target_rows(recs)]:
        text = "Checked at every size measured (nothing was tuned to meet them); the figure is the worst case."
        lines += _section("Targets", text, _table("target | measured | figure (worst case) | met", rows))
    if size["runs"]:
        lines += _section("Sampling", _table(SAMPLING_HEADER, sampling_rows(size["runs"])), SAMPLING_TEXT)
    lines += cold_section(results, recs + cold, image_dir) if cold else []
    if results["failures"]:
        lines += _section("Failed jobs", [f"- {f.splitlines()[0]}" for f in results["failures"]] + [""])
    return "\n".join(lines)


COLD_TEXT = """Resumes on a node whose page cache does not hold the checkpoint, as after a preemption or on a fresh \
node (a remote checkpoint's node-local copy, once written, is read from storage the same way). Before each cold job \
the benchmark reads the file once from storage (its pages dropped before: `os.sync()`, then \
`posix_fadvise(POSIX_FADV_DONTNEED)`, checked gone with `mincore`), sequential reads of 8 MiB into one reused buffer \
as `dd` does: the storage's own rate, right before the job; then drops the pages again and checks them gone. Every \
warm job of the same cell ran in the same run, alternating with the cold ones (ABAB). Python's and torch's own files \
stay cached: only the checkpoint is cold.

- *S / rate*: S over the storage's sequential read rate, the median of the {reads} cold reads of this size in the run \
({rate}).
- *goal*: the bound set for the window cold, 1.2 x S / rate + the same mode's warm window.
- *read from storage*: what the ranks had the kernel read from storage inside the window (`/proc/self/io` \
`read_bytes`, all ranks); *major faults*: page faults that waited for storage, all ranks, inside the window. The \
add-on's own read ahead (local rank 0, from the entry point on: `_restore/prefetch.py`) is outside the window where \
it finished before it, and counted inside where it did not."""
COLD_WHOLE_TEXT = """Restore-only jobs as whole processes (as in *Whole process, restore only*), warm and cold \
alternating; *restore*: from the first rank's Trainer `setup` to the last rank's `on_fit_end`."""


def _spread(value: Optional[float], spread: Optional[list[float]], digits: int = 2) -> str:
    """A median with its range, ``1.23 (1.10 to 1.50)``."""
    if value is None:
        return "–"
    return f"{value:.{digits}f}" + (f" ({spread[0]:.{digits}f} to {spread[1]:.{digits}f})" if spread else "")


def cold_section(results: dict[str, Any], recs: list[Record], image_dir: str) -> list[str]:
    """The cold resumes against the warm ones of the same run: the restore windows, the storage's rate and the
    goal, and the whole-process jobs; the plot of the cold window against S."""
    find = {(r["params"], r["devices"], r["entry"], r["mode"], r["cache"]): r for r in recs}
    cold = sorted(
        (r for r in recs if r["cache"] == "cold" and r["mode"] not in BASELINES),
        key=lambda r: (r["params"], r["entry"] == "whole", r["entry"], r["devices"], list(MODES).index(r["mode"])),
    )
    rows, whole_rows, rates = [], [], []
    for r in cold:
        warm = find.get((r["params"], r["devices"], r["entry"], r["mode"], "warm"), {})
        label = _size(r["params"], r["checkpoint_bytes"])
        rate = r.get("read_rate_bytes_s")
        if rate and (label, rate) not in rates:
            rates.append((label, rate))
        if r["entry"] == "whole":
            cells = [label, r["devices"], f"`{r['mode']}`", _spread(warm.get("whole_s"), warm.get("whole_range_s"))]
            cells += [_spread(r["whole_s"], r["whole_range_s"])]
            extra = r["whole_s"] - warm["whole_s"] if warm.get("whole_s") is not None else None
            cells += [_num(extra), _num(r["vs_upstream"], True), _num(r["cold_read_s"])]
            cells += [_num(warm.get("window_s")), _num(r["window_s"])]
            cells += [", ".join(f"{t:.1f}" for t in r["all_whole_s"]), _num(r["other_load"])]
            whole_rows.append(cells)
            continue
        cells = [label, r["devices"], r["entry"], f"`{r['mode']}`"]
        cells += [_spread(warm.get("window_s"), warm.get("window_range_s"))]
        cells += [_spread(r["window_s"], r["window_range_s"])]
        cells += [_num(r["cold_read_s"]), _num(r["goal_window_s"])]
        cells += ["–" if r["goal_met"] is None else "yes" if r["goal_met"] else "**no**"]
        cells += [_num(r["vs_upstream"], True), _spread(r["restore_s"], r["restore_range_s"])]
        cells += [_num(r["read_bytes"] / GIB if r["read_bytes"] is not None else None)]
        cells += [f"{r['major_faults']:.0f}" if r["major_faults"] is not None else "–"]
        cells += [_num(r["other_load"])]
        rows.append(cells)
    rate_text = "; ".join(f"{label}: {rate / GIB:.2f} GiB/s" for label, rate in rates)
    counts = sorted({r["cold_reads"] for r in cold if r.get("cold_reads")})
    reads = f"{counts[0]} to {counts[-1]}" if len(counts) > 1 else "".join(map(str, counts))
    header = "model, S | N | entry | mode | warm window (s) | cold window (s) | S / rate (s) | goal (s) | met"
    header += " | cold vs upstream's cold | own, cold (s) | read from storage (GiB) | major faults"
    header += " | other load"
    whole_header = "model, S | N | mode | warm (s) | cold (s) | cold - warm (s) | cold vs upstream's cold"
    whole_header += " | S / rate (s) | restore, warm (s) | restore, cold (s) | each cold job (s) | other load"
    plot = f"![cold restore window against S]({image_dir}/restore_cold.png)"
    parts: list[Any] = [COLD_TEXT.format(reads=reads or "–", rate=rate_text or "–"), plot, _table(header, rows)]
    if whole_rows:
        parts += [COLD_WHOLE_TEXT, _table(whole_header, whole_rows)]
    return _section(COLD[3:], *parts)


SAMPLING_HEADER = (
    "N | entry point | sampler at full rate before the window, at least | longest gap between fast samples | fewest"
    " full sweeps in a window | longest sweep | largest disagreement of `Anonymous:` with `RssAnon`"
)


def sampling_rows(runs: list[Record]) -> list[list[Any]]:
    """Per N and entry point, the sampling's worst case over the jobs (see ``_measure.RestoreRun``)."""
    rows = []
    for n, entry in sorted({(r["devices"], r["entry"]) for r in runs}):
        sel = [r for r in runs if (r["devices"], r["entry"]) == (n, entry)]
        ms = [min(r["woke_before_window"] for r in sel), max(r["fast_max_gap"] for r in sel)]
        ms.append(max(r["sweep_max_duration"] for r in sel))
        mib = max(r["rss_anon_vs_anonymous"] for r in sel) / 2**20
        rows.append([n, entry, *(f"{v * 1000:.0f} ms" for v in ms[:2]), min(r["sweeps"] for r in sel)])
        rows[-1] += [f"{ms[2] * 1000:.0f} ms", f"{mib:.1f} MiB"]
    return rows


def _kept_sections(page: str, skip: tuple[str, ...]) -> list[str]:
    """The sections of ``page`` under one of ``KEPT`` and not in ``skip``, each up to the next ``## `` heading."""
    found = []
    for heading in (h for h in KEPT if h not in skip and f"\n{h}\n" in page):
        start = page.find(f"\n{heading}\n") + 1
        end = page.find("\n## ", start)
        found.append(page[start : end if end >= 0 else len(page)].rstrip("\n") + "\n")
    return found


def _replace_section(page: str, heading: str, section: str) -> str:
    """``page`` with its section under ``heading`` (up to the next ``## `` heading) replaced by ``section``, or with
    ``section`` appended where it has none."""
    start = page.find(f"\n{heading}\n") + 1
    if not start:
        return f"{page.rstrip()}\n\n{section}"
    end = page.find("\n## ", start)
    return page[:start] + section + (page[end:] if end >= 0 else "")


def write(results: dict[str, Any], out: Path, docs: bool) -> list[Path]:
    """``report.md``, ``benchmark_results.json`` and the plots in ``out``; with ``docs``, ``docs/benchmarks.md`` (the
    kept sections it has kept), ``docs/img/`` and ``docs/benchmark_results.json``. A ``--whole-only`` run replaces
    only its own section of ``docs/benchmarks.md``; a ``--cold`` run its own section (*Cold resumes*), its plot, and
    the cold records of ``docs/benchmark_results.json``, whose warm ones the default run writes."""
    recs = records(results)
    warm = [r for r in recs if r["cache"] == "warm"]
    (out / "benchmark_results.json").write_text(json.dumps(recs, indent=1) + "\n")
    (out / "report.md").write_text(report(results, recs, ".") + "\n")
    written = [out / "benchmark_results.json", out / "report.md", *plots.plot(warm, results, out)]
    written += plots.plot_cold(recs, results, out)
    if not docs:
        return written
    page, kept = DOCS / "benchmarks.md", DOCS / "benchmark_results.json"
    old = page.read_text() if page.exists() else ""
    old_recs = json.loads(kept.read_text()) if kept.exists() else []
    if results["whole_only"]:  # its section, in place
        new = _replace_section(old, WHOLE, "\n".join(whole_section(warm)).rstrip("\n") + "\n")
    elif results.get("kind") == "cold":  # its section in place; its cold records for the committed cold ones
        new = _replace_section(old, COLD, "\n".join(cold_section(results, recs, "img")).rstrip("\n") + "\n")
        cold = [r for r in recs if r["cache"] == "cold"]
        kept.write_text(json.dumps([r for r in old_recs if cache_of(r) != "cold"] + cold, indent=1) + "\n")
        written += [kept, *plots.plot_cold(recs, results, DOCS / "img")]
    else:
        text = report(results, recs, "img") + "\n"
        new = "\n".join([text, *_kept_sections(old, tuple(h for h in KEPT if f"\n{h}\n" in text))])
        kept.write_text(json.dumps(recs + [r for r in old_recs if cache_of(r) == "cold"], indent=1) + "\n")
        written += [kept, *plots.plot(warm, results, DOCS / "img")]
    page.write_text(new)
    return [*written, page]


def print_summary(results: dict[str, Any]) -> None:
    """The floor's table and worst cases, the targets and the whole-process medians (warm), and the cold resumes
    against their goal, on stdout."""
    recs = records(results)
    warm = [r for r in recs if r["cache"] == "warm"]
    table, worst = against.floor_section(warm)
    print("\nthe restore window against the floor (reading the file once + N ranks copying what they keep):")
    print("\n".join(table + worst))
    for target, measured, ok, figure in [] if results["quick"] else target_rows(warm):
        print(f"  target {'met   ' if ok else 'MISSED'} {target}: {figure:.2f} ({measured})")
    for r in (r for r in warm if (r["entry"], r["mode"]) == ("whole", "ours-true")):
        where = f"{r['params'] / 1e6:.0f}M N={r['devices']}"
        print(f"  whole process, {where}: ours-true {_num(r['whole_s'])} s = {_num(r['vs_upstream'])} x upstream's")
    for r in (r for r in recs if r["cache"] == "cold" and r["mode"] not in BASELINES):
        where = f"{r['params'] / 1e6:.0f}M N={r['devices']} {r['entry']:8s} {r['mode']:18s}"
        if r["entry"] == "whole":
            print(
                f"  cold {where} whole {_spread(r['whole_s'], r['whole_range_s'])} s (warm {_num(r['warm_whole_s'])}),"
                f" {_num(r['vs_upstream'])} x upstream's cold"
            )
            continue
        goal = "–" if r["goal_met"] is None else "met" if r["goal_met"] else "MISSED"
        print(
            f"  cold {where} window {_spread(r['window_s'], r['window_range_s'])} s (warm {_num(r['warm_window_s'])},"
            f" goal {_num(r['goal_window_s'])}: {goal}), {_num(r['vs_upstream'])} x upstream's cold;"
            f" S / rate {_num(r['cold_read_s'])} s"
        )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a run's results.json")
    parser.add_argument("--output-dir", type=Path, help="where to write (default: next to results.json)")
    parser.add_argument("--docs", action="store_true", help="also write docs/, as the run would have")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    written = write(results, args.output_dir or args.results.parent, args.docs)
    print("wrote " + ", ".join(map(str, written)))
    print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
