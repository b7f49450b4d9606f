"""`serialized_checkpoint_loading` values and the environment settings: accepted values and their errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from serialized_restore import SerializedLoading, Trainer
from serialized_restore.lightning import Trainer as UnifiedTrainer
from serialized_restore.settings import ENVIRONMENT_OVERRIDES, settings_for


@pytest.mark.parametrize(("value", "expected"), [(True, None), (1, 1), (2, 2), (64, 64), (np.int64(3), 3)])
def test_accepted_values(value: object, expected: object) -> None:
    """True leaves the ranks at a time to each stage (`max_concurrent=None`), a positive int bounds them in every
    stage: each stands for the settings object with that `max_concurrent`; False turns the option off."""
    assert settings_for(value) == SerializedLoading(max_concurrent=expected)  # type: ignore[arg-type]
    assert settings_for(False) is None


@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, "yes", "True", "auto", None, [1]])
def test_rejected_values_raise_at_construction(value: object) -> None:
    """Anything else raises ValueError at `Trainer(...)`, quoting the value and listing what is accepted."""
    for trainer_cls in (Trainer, UnifiedTrainer):
        with pytest.raises(ValueError) as info:
            trainer_cls(serialized_checkpoint_loading=value, logger=False)
        assert f"serialized_checkpoint_loading={value!r}" in str(info.value)
        assert "positive int" in str(info.value) and "SerializedLoading" in str(info.value)


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("SERIALIZED_RESTORE_TURN_TIMEOUT", "soon", "expected a positive number of seconds"),
        ("SERIALIZED_RESTORE_TURN_TIMEOUT", "-5", "expected a positive number of seconds"),
        ("SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT", "nan", "expected a positive number of seconds"),
        ("SERIALIZED_RESTORE_READER", "lazy", "expected one of auto, mmap, eager"),
    ],
)
def test_bad_environment_settings_raise(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, fragment: str) -> None:
    """A malformed setting in the environment is refused at construction with the variable and its value."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=fragment) as info:
        Trainer(serialized_checkpoint_loading=True, logger=False)
    assert f"`{name}={raw!r}` is not supported" in str(info.value)


def test_environment_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timeouts and reader come from the environment, with documented defaults, for the add-on's Trainer and
    Fabric only: without the environment, `settings_for` reads nothing else."""
    defaults = settings_for(True, environ=os.environ)
    assert defaults is not None
    assert (defaults.turn_timeout, defaults.heartbeat_timeout, defaults.reader) == (1800.0, None, "auto")
    monkeypatch.setenv("SERIALIZED_RESTORE_TURN_TIMEOUT", "12.5")
    monkeypatch.setenv("SERIALIZED_RESTORE_READER", "Eager")
    parsed = settings_for(2, environ=os.environ)
    assert parsed is not None and parsed.max_concurrent == 2
    assert (parsed.turn_timeout, parsed.heartbeat_timeout, parsed.reader) == (12.5, None, "eager")
    assert Trainer(serialized_checkpoint_loading=2, logger=False)._checkpoint_connector._settings == parsed
    assert settings_for(2) == SerializedLoading(max_concurrent=2)


def test_trainer_is_a_lightning_trainer() -> None:
    """Both flavours subclass their upstream Trainer and report the value they were built with."""
    import lightning.pytorch
    import pytorch_lightning

    trainer = Trainer(serialized_checkpoint_loading=2, logger=False)
    assert isinstance(trainer, pytorch_lightning.Trainer)
    assert trainer.serialized_checkpoint_loading == 2
    unified = UnifiedTrainer(logger=False)
    assert isinstance(unified, lightning.pytorch.Trainer)
    assert unified.serialized_checkpoint_loading is False


def test_settings_object_is_accepted_and_returned_as_given() -> None:
    """`SerializedLoading(...)` sets everything in one typed object; the Trainer reports it back unchanged."""
    settings = SerializedLoading(max_concurrent=2, reader="eager", turn_timeout=600, tmpdir="/d")
    trainer = Trainer(serialized_checkpoint_loading=settings, logger=False)
    assert trainer.serialized_checkpoint_loading is settings
    assert trainer._checkpoint_connector._settings is settings


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("max_concurrent", 0, "expected a positive int"),
        ("max_concurrent", "auto", "expected a positive int"),
        ("max_concurrent", True, "expected a positive int"),
        ("reader", "lazy", "expected one of auto, mmap, eager"),
        ("turn_timeout", 0, "expected a positive number of seconds"),
        ("heartbeat_timeout", "60", "expected a positive number of seconds"),
        ("tmpdir", 3, "expected a directory path or None"),
    ],
)
def test_settings_object_refuses_bad_fields(field: str, value: object, fragment: str) -> None:
    """Each field is checked when the object is built, and the error names the field and its value."""
    with pytest.raises(ValueError, match=fragment) as info:
        SerializedLoading(**{field: value})
    assert f"SerializedLoading({field}={value!r})" in str(info.value)


@pytest.mark.parametrize("where", ["field", "environment"])
def test_the_heartbeat_setting_is_accepted_with_a_deprecation_warning_and_no_effect(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """``heartbeat_timeout`` (field or variable) still builds a Trainer, warns that it is deprecated and why (a rank
    that stops is found at the turn timeout), and changes nothing else; a bad value is still refused."""
    with pytest.warns(DeprecationWarning, match=r"heartbeat_timeout=\.\.\.\)` is deprecated and has no effect.*turn"):
        if where == "field":
            trainer = Trainer(serialized_checkpoint_loading=SerializedLoading(heartbeat_timeout=5), logger=False)
        else:
            monkeypatch.setenv("SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT", "5")
            trainer = Trainer(serialized_checkpoint_loading=True, logger=False)
    settings = trainer._checkpoint_connector._settings
    assert (settings.turn_timeout, settings.max_concurrent) == (1800.0, None)
    with pytest.raises(ValueError, match="expected a positive number of seconds"):
        SerializedLoading(heartbeat_timeout=0)


def test_environment_overrides_the_settings_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable, when set, wins over the field it overrides (for operators); every one is listed."""
    settings = SerializedLoading(turn_timeout=600, reader="mmap", tmpdir="/from/code")
    monkeypatch.setenv("SERIALIZED_RESTORE_TURN_TIMEOUT", "30")
    monkeypatch.setenv("SERIALIZED_RESTORE_TMPDIR", "/from/env")
    parsed = settings_for(settings, environ=os.environ)
    assert parsed is not None and (parsed.turn_timeout, parsed.reader, parsed.tmpdir) == (30.0, "mmap", "/from/env")
    assert settings_for(settings) is settings and settings.tmpdir == "/from/code"
    assert sorted(ENVIRONMENT_OVERRIDES) == [
        "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT",
        "SERIALIZED_RESTORE_READER",
        "SERIALIZED_RESTORE_TMPDIR",
        "SERIALIZED_RESTORE_TURN_TIMEOUT",
    ]


@pytest.mark.parametrize("trainer_cls", [Trainer, UnifiedTrainer])
def test_signature_is_upstreams_plus_ours(trainer_cls: type) -> None:
    """`inspect.signature(Trainer)` lists upstream's parameters, with their types and defaults, then ours."""
    import inspect

    upstream = inspect.signature(trainer_cls.__mro__[2].__init__).parameters
    ours = inspect.signature(trainer_cls).parameters
    assert list(ours) == [name for name in upstream if name != "self"] + ["serialized_checkpoint_loading"]
    assert all(ours[name].default == upstream[name].default for name in upstream if name != "self")
    assert ours["serialized_checkpoint_loading"].default is False
    assert ours["serialized_checkpoint_loading"].kind is inspect.Parameter.KEYWORD_ONLY


def test_a_subclass_of_the_trainer_keeps_the_signature_and_the_option() -> None:
    """A user's subclass without an `__init__` of its own keeps the full signature and the option."""
    import inspect

    class MyTrainer(Trainer):
        pass

    assert list(inspect.signature(MyTrainer).parameters)[-1] == "serialized_checkpoint_loading"
    assert MyTrainer(serialized_checkpoint_loading=3, logger=False).serialized_checkpoint_loading == 3
