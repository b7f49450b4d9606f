"""Each restore the benchmark measures against the hardware's floor, and against what ``serialized-restore forecast``
predicted for it."""

from __future__ import annotations

from typing import Any

from benchmarks.modes import BASELINES

FLOOR_MODES = ("upstream", "ours-true", "ours-1")  # upstream, and the add-on with True and with k = 1
PREDICTED = ("upstream", "ours-true")  # the modes `serialized-restore forecast` predicts: upstream's and True's


def _forecast(checkpoint: dict[str, Any], devices: int, entry: str) -> Any:
    """``serialized-restore forecast``'s prediction for this checkpoint (read from its tensor table), or ``None``
    where the file is not at hand (a report rebuilt elsewhere)."""
    from serialized_restore.forecast import CannotForecast, predict, read_table

    try:
        return predict(read_table(checkpoint["path"]), devices, 1, entry, "ddp")
    except (OSError, CannotForecast):
        return None


def prediction_section(recs: list[dict[str, Any]]) -> list[str]:
    """What ``serialized-restore forecast`` predicted against what was measured, upstream's and True's, every size
    and N."""
    from benchmarks.report import _num, _section, _size, _table  # the page's own formats

    rows, worst = [], {}
    for r in recs:
        if r.get("predicted_bytes") is None or r.get("headline_bytes") is None:
            continue
        error = (r["predicted_bytes"] - r["headline_bytes"]) / r["checkpoint_bytes"]
        relative = (r["predicted_bytes"] - r["headline_bytes"]) / r["headline_bytes"] if r["headline_bytes"] else None
        rows.append([_size(r["params"], r["checkpoint_bytes"]), r["devices"], r["entry"], f"`{r['mode']}`"])
        rows[-1] += [_num(r["predicted_x_s"]), _num(r["headline_x_s"]), _num(error, True)]
        rows[-1] += [f"{relative:+.0%}" if relative is not None and abs(r["headline_x_s"]) >= 0.1 else "–"]
        if abs(error) > abs(worst.get(r["mode"], (0.0, ""))[0]):
            worst[r["mode"]] = (error, f"{r['params'] / 1e6:.0f}M, N={r['devices']}, {r['entry']}")
    if not rows:
        return []
    text = (
        "`serialized-restore forecast CHECKPOINT --devices N --entry ENTRY` (its model: [forecast.md](forecast.md))"
        " against the measured headline (fit: net; validate: raw), in x S; the relative error where the figure is"
        " 0.1 x S or more (below, a few MiB of fixed costs per rank are a large share of it)."
    )
    summary = "Worst case: " + "; ".join(f"`{m}` {e:+.2f} x S ({w})" for m, (e, w) in worst.items()) + "."
    header = "model, S | N | entry | mode | predicted (x S) | measured (x S) | error (x S) | relative"
    return _section("Predicted by `serialized-restore forecast`", text, _table(header, rows), summary)


def annotate(rec: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """Add to a record of a predicted mode what ``serialized-restore forecast`` predicted for it (``None``
    otherwise)."""
    rec.update(predicted_bytes=None, predicted_x_s=None)
    if rec["mode"] in PREDICTED and rec["entry"] in ("fit", "validate") and rec["mode"] not in BASELINES:
        forecast = _forecast(checkpoint, rec["devices"], rec["entry"])
        if forecast is not None:
            rec["predicted_bytes"] = forecast.added(
                forecast.upstream if rec["mode"] == "upstream" else forecast.serialized
            )
            rec["predicted_x_s"] = rec["predicted_bytes"] / checkpoint["size_bytes"]


def floor_section(recs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The windows of upstream and the add-on at k = 1 and k = N over the floor, at every size, N and entry point
    (the restore's own time over the floor with its range over the repeats); and each mode's worst case."""
    from benchmarks.report import _num, _size, _spread, _table  # the page's own formats

    modes = [m for m in FLOOR_MODES if any(r["mode"] == m for r in recs)]
    find = {(r["params"], r["devices"], r["entry"], r["mode"]): r for r in recs}
    rows = []
    for params, n, entry in sorted({(r["params"], r["devices"], r["entry"]) for r in recs if r["floor_s"]}):
        found = [find.get((params, n, entry, m), {}) for m in modes]
        if not any(found):
            continue
        one = next(r for r in found if r)
        rows.append([_size(params, one["checkpoint_bytes"]), n, entry])
        rows[-1] += [_num(one[key], digits=3) for key in ("read_s", "copy_s", "floor_s")]
        rows[-1] += [
            text
            for r in found
            for text in (
                _num(r.get("window_s")),
                _num(r.get("window_over_floor"), True),
                _spread(r.get("restore_over_floor"), r.get("restore_over_floor_range")),
            )
        ]
    worst = []
    for mode in modes:
        if mine := [r for r in recs if r["mode"] == mode and r["window_over_floor"]]:
            w = max(mine, key=lambda r: r["window_over_floor"])
            where = f"{w['params'] / 1e6:.0f}M, N={w['devices']}, {w['entry']}"
            ratio = f"{w['window_over_floor']:.1f} x"
            own = [
                r["restore_over_floor"]
                for r in mine
                if r["restore_over_floor"] is not None and r["params"] == w["params"]
            ]
            net = f"; the restore's own, at that size: {max(own):.1f} x at most" if own else ""
            worst.append(f"`{mode}` {ratio} ({where}: {w['window_s']:.2f} s, floor {w['floor_s']:.3f} s{net})")
    header = "model, S | N | entry | read (s) | copy (s) | floor (s)" + "".join(
        f" | `{m}` window (s) | x floor | own x floor" for m in modes
    )
    return _table(header, rows), ["Worst case: " + "; ".join(worst) + "."] if worst else []
