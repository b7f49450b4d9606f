"""Every stage a restore runs, declared once, in the order a restore meets them. A stage is run by every rank, in
turns or all at once (``_coordination/turns.py``); its name is what logs, errors and failure records show, and keeps
its keys apart from every other stage's in the restore's namespace."""

from __future__ import annotations

import enum


class Stage(str, enum.Enum):
    # a remote checkpoint: local rank 0 of each node downloads it, then every rank checks the copy it is given
    FETCH = "fetch checkpoint"
    CHECK = "check local copy"
    # the Trainer's first stage: read the file, LightningModule and callback hooks, weights, datamodule, callbacks
    MODULES = "restore modules and callbacks"
    # FSDP (Trainer and Fabric), every rank together: rank 0 re-keys the optimizer state before the collectives
    PREPARE_OPTIMIZER_STATE = "prepare optimizer state for FSDP"
    # the Trainer's second stage: precision plugin, loops, optimizers, lr schedulers
    TRAINING_STATE = "restore training state"
    # Fabric's load: read and restore in the rank's turn, then copy what it keeps out of the mapping
    LOAD = "load checkpoint"
    COPY = "copy what is kept"

    __str__ = str.__str__  # the name, in messages and records
