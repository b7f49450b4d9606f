"""What differs between the Lightning releases the package supports, each difference decided once, here."""

from __future__ import annotations

from lightning_utilities.core.imports import compare_version

# before 2.5 (both flavours alike), stage 1 restores callbacks only when fitting
RESTORES_CALLBACKS_ONLY_WHEN_FITTING = not (
    compare_version("lightning", lambda installed, required: installed >= required, "2.5.0")
    or compare_version("pytorch_lightning", lambda installed, required: installed >= required, "2.5.0")
)
