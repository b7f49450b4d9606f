"""The ``Trainer`` subclass: upstream's Trainer plus ``serialized_checkpoint_loading``."""

from __future__ import annotations

import functools
import inspect
import os
import typing
from typing import Any, Callable, ClassVar

from serialized_restore._lightning.names import Owner, flavour_of
from serialized_restore._lightning.versions import check_supported
from serialized_restore.settings import PARAMETER, SerializedCheckpointLoading, settings_for


class SerializedRestoreTrainerMixin:
    """Adds ``serialized_checkpoint_loading`` to a Lightning ``Trainer``; every other argument is upstream's.

    Args:
        serialized_checkpoint_loading: ``False`` (default) restores exactly as upstream. ``True``: the local ranks
            of each node restore one at a time, nodes in parallel, each freeing what it no longer needs as soon as
            it is restored. A positive int ``k``: at most ``k`` local ranks of a node restore at once. A
            :class:`~serialized_restore.SerializedLoading` sets every setting in one typed object.
    """

    # the flavour's serialized connector, set by each flavour module (a module-level class, so that ``ddp_spawn`` can
    # pickle it)
    _connector_class: ClassVar[type]

    def __init__(
        self, *args: Any, serialized_checkpoint_loading: SerializedCheckpointLoading = False, **kwargs: Any
    ) -> None:
        check_supported(flavour_of(self), Owner.TRAINER)
        settings = settings_for(serialized_checkpoint_loading, Owner.TRAINER, os.environ)
        super().__init__(*args, **kwargs)
        self._serialized_loading = serialized_checkpoint_loading
        self._checkpoint_connector = self._connector_class(self, settings)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the flavour's Trainer itself; its subclasses inherit the result
        if SerializedRestoreTrainerMixin in cls.__bases__:
            cls.__init__ = _with_upstream_signature(cls)  # type: ignore[method-assign, misc]

    @property
    def _checkpoint_connector(self) -> Any:
        return self.__dict__["_serialized_connector"]

    @_checkpoint_connector.setter
    def _checkpoint_connector(self, connector: Any) -> None:
        # a framework (NeMo, SageMaker HyperPod) may replace the connector with Lightning's own: upstream's restore
        self.__dict__["_serialized_connector"] = connector
        value = self.__dict__.get("_serialized_loading", False)
        if value is not False and not isinstance(connector, self._connector_class):
            Owner.TRAINER.info(self)(
                f"`Trainer(serialized_checkpoint_loading={value!r})` has no effect: the Trainer's checkpoint"
                f" connector was replaced by {type(connector).__qualname__}, which restores as upstream."
            )

    @property
    def serialized_checkpoint_loading(self) -> SerializedCheckpointLoading:
        """The value the Trainer was built with, as given."""
        return self._serialized_loading  # type: ignore[return-value]


def _with_upstream_signature(cls: type) -> Callable[..., None]:
    """An ``__init__`` whose signature is upstream's plus ours, for ``inspect.signature``, IDEs and LightningCLI."""
    upstream = next(b for b in cls.__mro__[1:] if "__init__" in b.__dict__ and b is not SerializedRestoreTrainerMixin)
    upstream_init = upstream.__dict__["__init__"]
    mixin_init = SerializedRestoreTrainerMixin.__init__

    @functools.wraps(upstream_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        mixin_init(self, *args, **kwargs)

    hints = typing.get_type_hints(upstream_init)
    signature = inspect.signature(upstream_init)
    ours = inspect.Parameter(
        PARAMETER, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=SerializedCheckpointLoading
    )
    parameters = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
    # upstream takes keyword arguments only, after `self`; ours goes last
    __init__.__signature__ = signature.replace(parameters=[*parameters, ours])  # type: ignore[attr-defined]
    __init__.__annotations__ = {**hints, PARAMETER: SerializedCheckpointLoading}
    __init__.__doc__ = (upstream_init.__doc__ or "") + "\n\n" + (SerializedRestoreTrainerMixin.__doc__ or "")
    del __init__.__wrapped__  # type: ignore[attr-defined]  # the signature is the one set above, not upstream's
    return __init__
