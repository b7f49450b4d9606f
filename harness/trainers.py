"""The Trainer settings every test, benchmark and demo job shares: CPU, quiet, nothing the job does not measure."""

from __future__ import annotations

from typing import Any


def quiet_cpu_trainer_kwargs(out: str, devices: int, strategy: Any, **overrides: Any) -> dict[str, Any]:
    """``Trainer(**...)`` arguments for a CPU job with no logger, progress bar, model summary or sanity validation,
    writing under ``out``; ``overrides`` replace or add arguments."""
    return {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": out,
        **overrides,
    }
