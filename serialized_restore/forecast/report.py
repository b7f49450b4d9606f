"""A forecast as a person reads it (:func:`render`) and as a program does (:func:`to_json`)."""

from __future__ import annotations

import textwrap
from dataclasses import asdict
from typing import Any

from serialized_restore._files import format_bytes
from serialized_restore._host import Available
from serialized_restore.forecast.model import Forecast, Resume


def _fits(added: int, available: Available) -> bool | None:
    return None if available.bytes is None else added <= available.bytes


def to_json(forecast: Forecast, available: Available) -> dict[str, Any]:
    """The forecast as a JSON object: ``checkpoint_bytes``, ``added_bytes_per_node`` (the entry's measure) and parts."""
    table = asdict(forecast.table)

    def part(resume: Resume | None) -> dict[str, Any] | None:
        if resume is None:
            return None
        return {
            "label": resume.label,
            "weights_bytes": resume.weights,
            "optimizer_bytes": resume.optimizer,
            "rest_bytes": resume.rest,
            "held_bytes": resume.held,
            "raw_bytes": resume.raw,
            "net_bytes": resume.net,
            "kept_bytes": resume.kept,
            "added_bytes": forecast.added(resume),
            "fits": _fits(forecast.added(resume), available),
        }

    return {
        "checkpoint": forecast.table.path,
        "checkpoint_bytes": forecast.table.checkpoint_bytes,
        "plannable": True,
        "job": {
            "devices": forecast.devices,
            "nodes": forecast.nodes,
            "entry": forecast.entry,
            "strategy": forecast.strategy,
            "k": forecast.k,
            "accelerator": forecast.accelerator,
        },
        "measure": forecast.measure,
        "added_bytes_per_node": {
            "upstream": forecast.added(forecast.upstream),
            "serialized": forecast.added(forecast.serialized),
        },
        "parts": {
            "upstream": part(forecast.upstream),
            "serialized": part(forecast.serialized),
            "serialized_eager": part(forecast.serialized_eager),
        },
        "page_cache_bytes_per_node": forecast.page_cache,
        "model": {
            "containers_per_rank": forecast.containers_per_rank,
            "serialized_fixed_per_rank": forecast.fixed_per_rank,
            "kept_per_rank": forecast.kept_per_rank,
            "setup_transient_per_rank": forecast.setup_transient_per_rank,
        },
        "memory": {"available_bytes": available.bytes, "source": available.source},
        "table": {**table, "tensor_bytes": forecast.table.tensor_bytes},
        "notes": forecast.table.notes + forecast.notes,
    }


def _times(count: int, s: int) -> str:
    return f"{format_bytes(count)} ({count / s:.2f} x S)" if s else format_bytes(count)


def render(forecast: Forecast, available: Available) -> str:
    """The forecast as a table a person reads at a glance, then what its figures mean, wrapped."""
    return "\n".join(_table(forecast, available) + [_wrapped(text) for text in _explanations(forecast)])


def _wrapped(text: str) -> str:
    return textwrap.fill(text, 118, initial_indent="  ", subsequent_indent="    ")


def _table(forecast: Forecast, available: Available) -> list[str]:
    t, s = forecast.table, forecast.table.checkpoint_bytes
    fit = forecast.entry == "fit"
    keys = ", ".join(f"{key} {format_bytes(v)}" for key, v in t.optimizer_by_key.items())
    rest = ", ".join(f"{key} {format_bytes(v)}" for key, v in t.rest_by_key.items() if v) or "no tensors"
    where = ", ".join(f"{loc}" for loc in t.locations) or "none"
    lines = [
        f"serialized-restore forecast: {t.path}",
        f"  checkpoint  S = {format_bytes(s)}, {t.tensors} tensors in {t.storages} storages saved on {where}; read"
        f" {format_bytes(t.bytes_read)} of it ({t.filesystem}{'' if t.seekable else ', cannot seek'})",
        f"              weights {format_bytes(t.weights_bytes)}; optimizer state {format_bytes(t.optimizer_bytes)}"
        f"{f' ({keys})' if keys else ''}; the rest {format_bytes(t.rest_bytes)} ({rest})",
        f"  resume      trainer.{forecast.entry}, {forecast.strategy}, {forecast.devices} local ranks per node x"
        f" {forecast.nodes} node{'s' if forecast.nodes > 1 else ''}, {forecast.accelerator}; serialized: k ="
        f" {forecast.k}",
        f"  memory      {format_bytes(available.bytes) if available.bytes is not None else 'unknown'} available to"
        f" the job: {available.source}",
        "",
        "Host memory the resume adds per node, above the same job started without a checkpoint"
        + (" (net of the optimizer state the job keeps; the raw peak beside it):" if fit else ":"),
        "",
    ]
    header = ["", "weights", "optimizer state", "the rest", "added" + (" (net)" if fit else "")]
    header += ["raw peak"] if fit else []
    header += ["fits?"]
    rows = [header]
    for resume in (forecast.upstream, forecast.serialized, forecast.serialized_eager):
        if resume is None:
            continue
        added = forecast.added(resume)
        fits = _fits(added, available)
        left = f", {format_bytes(available.bytes - added)} left" if available.bytes is not None and fits else ""
        row = [resume.label, format_bytes(resume.weights), format_bytes(resume.optimizer), format_bytes(resume.rest)]
        row += [_times(added, s)] + ([_times(resume.raw, s)] if fit else [])
        row += [("yes" + left) if fits else "NO" if fits is False else "?"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  " + "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return lines + [""]


def _explanations(forecast: Forecast) -> list[str]:
    t, n = forecast.table, forecast.devices
    texts = [
        "weights / optimizer state / the rest: the checkpoint's bytes in the node's private memory at the restore's"
        " peak (the rest includes the unpickled containers).",
    ]
    transient = format_bytes(forecast.setup_transient_per_rank)
    own = (
        f", which includes DDP's setup copy of the weights ({n} x {transient}): bytes a restore holds at another"
        " moment add only what exceeds it"
        if forecast.setup_transient_per_rank
        else " (its own transients not modeled: T = 0)"
    )
    if forecast.entry == "fit":
        texts.append(
            "net: above what the job holds anyway once it has built its optimizer state"
            f" ({format_bytes(forecast.upstream.kept)} per node kept: {n} x {format_bytes(forecast.kept_per_rank)});"
            f" raw: above the job's own peak{own}."
        )
    else:
        texts.append(f"added (raw): above the job's own peak{own}.")
    texts.append(
        f"page cache: every mode reads the file through it, {format_bytes(forecast.page_cache)} once per node, shared"
        " and reclaimable: not in these figures (the benchmark's measure is private memory), but a cgroup's limit"
        " counts it and reclaims it under pressure (slower, not an OOM kill)."
    )
    texts.append(
        "fits: the added figure against the memory available; the job's own memory (model, data, gradients) must"
        " fit in what is left. The model and its inputs: docs/forecast.md."
    )
    texts += [f"note: {note}." for note in t.notes + forecast.notes]
    if t.opaque_globals:
        shown = ", ".join(t.opaque_globals[:5]) + (", ..." if len(t.opaque_globals) > 5 else "")
        texts.append(f"note: globals not imported, described as opaque objects: {shown}.")
    return texts
