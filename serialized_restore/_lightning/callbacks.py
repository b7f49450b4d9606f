"""While a serialized restore runs, the checkpoint callbacks that would save in ``on_exception`` do not: a failure
before the restore ends would save a partly restored model, possibly over the checkpoint it is restored from."""

from __future__ import annotations

import inspect
from typing import Any

from serialized_restore._lightning.names import lightning_names


def guard_checkpoint_callbacks(trainer: Any) -> list[Any]:
    """(each rank, as a serialized restore starts) Until :func:`release`, the checkpoint callbacks that would save in
    ``on_exception`` warn instead: a failure before the restore ends would save a partly restored model."""
    names = lightning_names(trainer)
    checkpoint_cls, model_checkpoint_cls, callback_cls = names.Checkpoint, names.ModelCheckpoint, names.Callback

    def saves_on_exception(callback: Any) -> bool:
        own = getattr(type(callback), "on_exception", None)
        if own is callback_cls.on_exception or not inspect.isfunction(own):
            # not a method of its class (a `Mock(spec=ModelCheckpoint)`): called as upstream calls it
            return False
        if own is model_checkpoint_cls.on_exception:
            return bool(getattr(callback, "save_on_exception", False))
        return True

    guarded = [cb for cb in trainer.callbacks if isinstance(cb, checkpoint_cls) and saves_on_exception(cb)]
    warned: list[bool] = []

    def on_exception(*args: Any, **kwargs: Any) -> None:
        if not warned:
            warned.append(True)
            names.rank_zero_warn(
                f"The checkpoint restore did not complete, so {', '.join(type(cb).__name__ for cb in guarded)} will"
                " not save a checkpoint of the partly restored model."
            )

    for callback in guarded:
        callback.on_exception = on_exception  # the instance's: the class's shows through again once released
    return guarded


def release(callbacks: list[Any]) -> None:
    """(each rank) Give ``callbacks`` their own ``on_exception`` back."""
    for callback in callbacks:
        callback.__dict__.pop("on_exception", None)
