"""The report's plots, from its records (``report.records``) and, for the timeline, the largest size's jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.modes import MODES

GIB = 2**30
OURS_AT_MOST, FSDP_AT_MOST = 0.3, 0.1  # x S: the targets' bounds, drawn as dashed lines
STYLE = {  # mode: (color, marker, line)
    "upstream": ("tab:red", "o", "-"),
    "mmap-plugin": ("tab:brown", "P", "-."),
    "ours-off": ("tab:orange", "x", ":"),
    "ours-true": ("tab:green", "s", "-"),
    "ours-1": ("tab:blue", "d", "-"),
    "ours-2": ("tab:olive", "^", "-"),
    "ours-true-eager": ("tab:cyan", "v", "--"),
    "proposal-2021": ("tab:purple", "D", "--"),
    "fsdp-upstream": ("tab:red", "o", "--"),
    "fsdp-ours": ("tab:green", "s", "--"),
    "fsdp-baseline": ("0.45", ".", "--"),
}


def _style(mode: str, marker: bool = True) -> dict[str, Any]:
    color, mark, line = STYLE.get(mode, ("0.45", ".", ":"))
    return {"color": color, "ls": line, "label": mode, **({"marker": mark} if marker else {})}


def plot(recs: list[dict[str, Any]], results: dict[str, Any], out: Path) -> list[Path]:
    """``restore_memory``, ``restore_time``, ``restore_timeline`` and ``restore_fsdp.png`` for the largest size, and
    with several sizes ``restore_sizes.png``, in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r["checkpoint_bytes"] for r in recs if r["entry"] != "whole"})
    if not sizes:
        return []
    largest = [r for r in recs if r["checkpoint_bytes"] == sizes[-1] and r["entry"] != "whole"]
    entries = [e for e in ("fit", "validate") if any(r["entry"] == e for r in largest)]
    devices = sorted({r["devices"] for r in largest})
    title = f"{largest[0]['params'] / 1e6:.0f}M-parameter MLP + Adam, S = {sizes[-1] / GIB:.2f} GiB; gloo on CPU,"
    title += f" {results['machine']['cores']} cores"
    written = []

    def series(family: tuple[str, ...], entry: str, value: Any) -> dict[str, list[tuple[int, float]]]:
        found: dict[str, list[tuple[int, float]]] = {}
        for r in sorted(largest, key=lambda r: r["devices"]):
            if MODES[r["mode"]].family in family and r["entry"] == entry and value(r) is not None:
                found.setdefault(r["mode"], []).append((r["devices"], value(r)))
        return found

    def figure(
        panels: list[tuple[str, str, Any]],
        family: tuple[str, ...],
        name: str,
        suptitle: str,
        ylabel: str,
        bound: float = 0.0,
        diagonal: bool = False,
        floor: bool = False,
    ) -> None:
        panels = [p for p in panels if p[0] in entries]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False, sharey=bool(bound))
        for ax, (entry, label, value) in zip(axes[0], panels):
            if diagonal:
                ax.plot(devices, devices, color="0.7", lw=1, ls=":", label="N x S")
            for mode, pts in series(family, entry, value).items():
                ax.plot(*zip(*pts), **_style(mode))
            if floor and (pts := sorted({(r["devices"], r["floor_s"]) for r in largest if r["entry"] == entry})):
                ax.plot(*zip(*[p for p in pts if p[1]]), color="black", ls="--", marker=".", label="floor")
            if bound:
                ax.axhline(bound, color="tab:green", lw=0.8, ls="--", alpha=0.6)
                ax.axhline(0, color="0.3", lw=0.6)
            ax.set(title=label, xlabel="local ranks N", xticks=devices)
            ax.title.set_fontsize(10)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][0].legend(fontsize=8, loc="upper left")
        fig.suptitle(suptitle, fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    def x_s(key: str) -> Any:
        return lambda r: None if r.get(key) is None else r[key] / r["checkpoint_bytes"]

    memory = [
        ("fit", "fit (net): above baseline + optimizer state kept", x_s("overhead_net_bytes")),
        ("fit", "fit (raw): above baseline", x_s("overhead_bytes")),
        ("validate", "validate: above baseline", x_s("overhead_bytes")),
    ]
    figure(
        memory,
        ("ddp",),
        "restore_memory.png",
        f"{title}\ndashed green: {OURS_AT_MOST} x S",
        "restore overhead / S\n(peak node anonymous memory in the window)",
        OURS_AT_MOST,
        diagonal=True,
    )
    times = [(e, f"{e}: restore window; dashed black: the floor", lambda r: r["window_s"]) for e in ("fit", "validate")]
    figure(times, ("ddp",), "restore_time.png", title, "seconds", floor=True)
    if any(MODES[r["mode"]].family == "fsdp" for r in largest):
        panels = [
            ("fit", "FSDP, fit (net): above fsdp-baseline", x_s("overhead_net_bytes")),
            ("validate", "FSDP, validate (raw): above fsdp-baseline", x_s("overhead_bytes")),
        ]
        figure(panels, ("fsdp",), "restore_fsdp.png", title, "restore overhead / S", FSDP_AT_MOST)

    # node memory over time at the largest N, each mode's first job
    runs = [r for r in results["sizes"][-1]["runs"] if r["devices"] == devices[-1] and r["repeat"] == 0]
    runs = [r for r in runs if r.get("cache", "warm") == "warm"]
    fig, axes = plt.subplots(1, len(entries), figsize=(6.5 * len(entries), 4.6), sharey=True, squeeze=False)
    for ax, entry in zip(axes[0], entries):
        for run in runs:
            if run["entry"] == entry and MODES[run["mode"]].family == "ddp" and run["timeline"]:
                t, anon = zip(*run["timeline"])
                ax.plot(t, [a / GIB for a in anon], lw=1.2, **_style(run["mode"], marker=False))
                ax.axvline(run["window"], color=_style(run["mode"])["color"], lw=0.8, ls=":")
        ax.set(
            title=f"{entry}, N={devices[-1]}: node anonymous memory (dotted: end of each window)",
            ylabel="GiB",
            xlabel="seconds since the start of the restore window",
        )
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "restore_timeline.png", dpi=110)
    plt.close(fig)
    written.append(out / "restore_timeline.png")
    if len(sizes) > 1:
        written.append(_plot_sizes(plt, recs, sizes, out))
    return written


def _plot_sizes(plt: Any, recs: list[dict[str, Any]], sizes: list[int], out: Path) -> Path:
    """The headline overhead / S of the modes measured at every size, against S."""
    fig, axes = plt.subplots(1, 2, figsize=(11.2, 4.6), sharey=True, squeeze=False)
    for ax, entry in zip(axes[0], ("fit", "validate")):
        keys = {(r["mode"], r["devices"]) for r in recs if r["entry"] == entry and r["headline_x_s"] is not None}
        keys = sorted(keys, key=lambda k: (list(MODES).index(k[0]), k[1]))
        for mode, n in keys:
            pts = [
                (r["checkpoint_bytes"] / GIB, r["headline_x_s"])
                for r in recs
                if (r["mode"], r["devices"], r["entry"]) == (mode, n, entry) and r["headline_x_s"] is not None
            ]
            if len(pts) == len(sizes):
                line = ["-", "--", ":", "-."][sorted({k[1] for k in keys}, reverse=True).index(n) % 4]
                ax.plot(*zip(*sorted(pts)), **{**_style(mode), "ls": line, "label": f"{mode}, N={n}"})
        ax.axhline(FSDP_AT_MOST, color="tab:green", lw=0.8, ls="--", alpha=0.6)
        ax.axhline(0, color="0.3", lw=0.6)
        ax.set(xscale="log", xlabel="checkpoint size S (GiB)", xticks=[s / GIB for s in sizes])
        ax.set_xticklabels([f"{s / GIB:.2f}" for s in sizes])
        ax.minorticks_off()
        ax.set_title(f"{entry} ({'net' if entry == 'fit' else 'raw'}): restore overhead / S", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("restore overhead / S")
    axes[0][0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"Headline overheads at every checkpoint size; dashed green: {FSDP_AT_MOST} x S", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "restore_sizes.png", dpi=110)
    plt.close(fig)
    return out / "restore_sizes.png"


def plot_cold(recs: list[dict[str, Any]], results: dict[str, Any], out: Path) -> list[Path]:
    """``restore_cold.png`` where there are cold records: the restore window cold (solid) and warm (dotted) of every
    mode and N against S, one panel per entry point, with S over the storage's sequential read rate (dashed black)."""
    cold = [r for r in recs if r["cache"] == "cold" and r["entry"] != "whole" and r["mode"] in STYLE]
    if not cold:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    warm = {(r["params"], r["devices"], r["entry"], r["mode"]): r for r in recs if r["cache"] == "warm"}
    entries = [e for e in ("fit", "validate") if any(r["entry"] == e for r in cold)]
    all_n = sorted({r["devices"] for r in cold}, reverse=True)
    fig, axes = plt.subplots(1, len(entries), figsize=(6.2 * len(entries), 4.8), squeeze=False, sharey=True)
    for ax, entry in zip(axes[0], entries):
        mine = [r for r in cold if r["entry"] == entry]
        for mode, n in sorted({(r["mode"], r["devices"]) for r in mine}, key=lambda k: (list(MODES).index(k[0]), k[1])):
            found = [r for r in mine if (r["mode"], r["devices"]) == (mode, n)]
            warm_s = [warm.get((r["params"], n, entry, mode), {}).get("window_s") for r in found]
            pts = sorted((r["checkpoint_bytes"] / GIB, r["window_s"], w) for r, w in zip(found, warm_s))
            line = ["-", "--", "-.", ":"][all_n.index(n) % 4]
            style = {**_style(mode), "ls": line, "label": f"{mode}, N={n}"}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            if known := [(p[0], p[2]) for p in pts if p[2] is not None]:
                ax.plot(*zip(*known), color=style["color"], ls=":", lw=0.8, marker=".", alpha=0.6)
        rate = sorted({(r["checkpoint_bytes"] / GIB, r["cold_read_s"]) for r in mine if r["cold_read_s"]})
        if rate:
            ax.plot(*zip(*rate), color="black", ls="--", marker=".", label="S / read rate")
        ax.set(xlabel="checkpoint size S (GiB)", title=f"{entry}: restore window from storage (cold)")
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("seconds (solid: cold; dotted: the same mode warm)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Cold resumes: the checkpoint dropped from the page cache before each job; gloo on CPU,"
                 f" {results['machine']['cores']} cores", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "restore_cold.png", dpi=110)
    plt.close(fig)
    return [out / "restore_cold.png"]
