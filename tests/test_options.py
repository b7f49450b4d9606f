"""`serialized_checkpoint_loading` values and the environment settings: accepted values and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from serialized_restore import SerializedLoading, Trainer
from serialized_restore._environment import ENVIRONMENT_OVERRIDES, options_from
from serialized_restore._memory import SAFETY_MARGIN, plan_auto
from serialized_restore._options import RestoreOptions
from serialized_restore.lightning import Trainer as UnifiedTrainer


@pytest.mark.parametrize(("value", "expected"), [(False, None), (True, 1), (1, 1), (2, 2), (64, 64), (np.int64(3), 3)])
def test_accepted_values(value: object, expected: object) -> None:
    """False turns the option off, True means one rank at a time, a positive int bounds concurrent ranks."""
    parsed = RestoreOptions.parse(value)
    assert parsed.max_concurrent == expected
    assert parsed.enabled is (value is not False) and not parsed.auto


def test_auto_is_accepted() -> None:
    """ "auto" turns the option on with k chosen at restore time."""
    parsed = RestoreOptions.parse("auto")
    assert parsed.enabled and parsed.auto and parsed.max_concurrent is None


def test_auto_without_psutil_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where psutil is not installed (Lightning does not require it), "auto" needs a memory figure: without one,
    `Trainer(...)` raises ModuleNotFoundError with the install hint; with one, or for any other value, psutil is
    not needed."""
    from lightning_utilities.core.imports import RequirementCache

    import serialized_restore._options as options

    monkeypatch.setattr(options, "PSUTIL_AVAILABLE", RequirementCache("psutil-not-installed"))
    with pytest.raises(
        ModuleNotFoundError,
        match=r"`Trainer\(serialized_checkpoint_loading='auto'\)` measures.*"
        r"pip install",
    ):
        Trainer(serialized_checkpoint_loading="auto", logger=False)
    assert RestoreOptions.parse(True).enabled
    assert RestoreOptions.parse(SerializedLoading(max_concurrent="auto", available_memory=2**34)).auto
    monkeypatch.setenv("SERIALIZED_RESTORE_AVAILABLE_MEMORY", str(2**34))
    assert Trainer(serialized_checkpoint_loading="auto", logger=False).serialized_checkpoint_loading == "auto"


@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, "yes", "True", "AUTO", None, [1]])
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
        ("SERIALIZED_RESTORE_TURN_TIMEOUT", "soon", "is not a number of seconds"),
        ("SERIALIZED_RESTORE_TURN_TIMEOUT", "-5", "must be a positive number"),
        ("SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT", "0", "must be a positive number"),
        ("SERIALIZED_RESTORE_READER", "lazy", "Accepted values: auto, mmap, eager"),
        ("SERIALIZED_RESTORE_AVAILABLE_MEMORY", "lots", "is not a number of bytes"),
    ],
)
def test_bad_environment_settings_raise(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, fragment: str) -> None:
    """A malformed setting in the environment is refused at construction with the variable and its value."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=fragment) as info:
        value = "auto" if name == "SERIALIZED_RESTORE_AVAILABLE_MEMORY" else True
        Trainer(serialized_checkpoint_loading=value, logger=False)
    assert name in str(info.value) and repr(raw.lower() if name.endswith("READER") else raw) in str(info.value)


def test_environment_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timeouts and reader come from the environment, with documented defaults, for the add-on's Trainer and
    Fabric only: what is proposed to Lightning (`RestoreOptions.parse`) does not read the environment."""
    defaults = options_from(True)
    assert (defaults.turn_timeout, defaults.heartbeat_timeout, defaults.reader) == (1800.0, 60.0, "auto")
    monkeypatch.setenv("SERIALIZED_RESTORE_TURN_TIMEOUT", "12.5")
    monkeypatch.setenv("SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT", "3")
    monkeypatch.setenv("SERIALIZED_RESTORE_READER", "Eager")
    monkeypatch.setenv("SERIALIZED_RESTORE_AVAILABLE_MEMORY", "1024")
    parsed = options_from(2)
    assert (parsed.turn_timeout, parsed.heartbeat_timeout, parsed.reader) == (12.5, 3.0, "eager")
    assert parsed.available_memory == 1024
    assert Trainer(serialized_checkpoint_loading=2, logger=False)._serialized_loading == parsed
    assert RestoreOptions.parse(2) == RestoreOptions.parse(2).__class__(value=2, max_concurrent=2)


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


@pytest.mark.parametrize(
    ("available", "reader", "expected"),
    [
        (10 * 2**30, "eager", 4),  # room for every local rank
        (int(2.6 * 2**30), "eager", 2),  # 2.6 GiB x 0.8 = 2.08 GiB: two 1 GiB turns
        (int(1.3 * 2**30), "eager", 1),
        (int(1.2 * 2**30), "mmap", 4),  # a mapped turn needs about a tenth of the file privately
        (int(0.5 * 2**30), "eager", 0),  # not even one turn fits
    ],
)
def test_auto_plan_from_injected_available_memory(
    monkeypatch: pytest.MonkeyPatch, available: int, reader: str, expected: int
) -> None:
    """ "auto" picks k from available memory x (1 - margin) / per-turn need, clamped to the local world size."""
    plan = plan_auto(checkpoint_size=2**30, reader=reader, local_world_size=4, available_memory=available)
    assert plan.max_concurrent == expected
    assert plan.available == available and plan.available_source == "given"
    assert f"{SAFETY_MARGIN:.0%} kept as margin" in plan.describe()


def test_settings_object_is_accepted_and_returned_as_given() -> None:
    """`SerializedLoading(...)` sets everything in one typed object; the Trainer reports it back unchanged."""
    settings = SerializedLoading(max_concurrent=2, reader="eager", turn_timeout=600, heartbeat_timeout=5, tmpdir="/d")
    trainer = Trainer(serialized_checkpoint_loading=settings, logger=False)
    assert trainer.serialized_checkpoint_loading is settings
    parsed = RestoreOptions.parse(settings)
    assert (parsed.max_concurrent, parsed.reader, parsed.turn_timeout, parsed.heartbeat_timeout, parsed.tmpdir) == (
        2, "eager", 600.0, 5.0, "/d"
    )  # fmt: skip
    auto = RestoreOptions.parse(SerializedLoading(max_concurrent="auto"))
    assert auto.auto and auto.enabled and auto.max_concurrent is None
    # the shorthands mean the object with that field
    assert RestoreOptions.parse(True) == RestoreOptions.parse(SerializedLoading()).__class__(
        value=True, max_concurrent=1
    )


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("max_concurrent", 0, "expected a positive int or 'auto'"),
        ("max_concurrent", "AUTO", "expected a positive int or 'auto'"),
        ("max_concurrent", True, "expected a positive int or 'auto'"),
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


def test_environment_overrides_the_settings_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable, when set, wins over the field it overrides (for operators); every one is listed."""
    settings = SerializedLoading(turn_timeout=600, reader="mmap", tmpdir="/from/code")
    monkeypatch.setenv("SERIALIZED_RESTORE_TURN_TIMEOUT", "30")
    monkeypatch.setenv("SERIALIZED_RESTORE_TMPDIR", "/from/env")
    parsed = options_from(settings)
    assert (parsed.turn_timeout, parsed.reader, parsed.tmpdir) == (30.0, "mmap", "/from/env")
    assert RestoreOptions.parse(settings).tmpdir == "/from/code"
    assert sorted(ENVIRONMENT_OVERRIDES) == [
        "SERIALIZED_RESTORE_AVAILABLE_MEMORY",
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
