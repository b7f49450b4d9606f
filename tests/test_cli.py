"""`--trainer.serialized_checkpoint_loading` through a real `LightningCLI`: typed, refused at parse time when bad."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from serialized_restore import SerializedLoading
from serialized_restore.lightning import Trainer

pytest.importorskip("jsonargparse")


def _cli(*args: str) -> LightningCLI:
    return LightningCLI(
        BoringModel,
        trainer_class=Trainer,
        run=False,
        save_config_callback=None,
        args=["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false", *args],
    )


@pytest.mark.parametrize(("given", "expected"), [("true", True), ("yes", True), ("false", False), ("2", 2)])
def test_accepted_values_from_the_command_line(given: str, expected: object) -> None:
    """The values the Trainer accepts parse to themselves (`yes`/`no` are jsonargparse's spelling of a bool)."""
    cli = _cli(f"--trainer.serialized_checkpoint_loading={given}")
    got = cli.trainer.serialized_checkpoint_loading
    assert got == expected and isinstance(got, type(expected)) and isinstance(got, bool) == isinstance(expected, bool)


def test_settings_object_from_a_yaml_config(tmp_path: Path) -> None:
    """A YAML config can give the settings object field by field."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  serialized_checkpoint_loading:\n    max_concurrent: 2\n    reader: eager\n    turn_timeout: 600\n"
    )
    cli = _cli(f"--config={config}")
    assert cli.trainer.serialized_checkpoint_loading == SerializedLoading(
        max_concurrent=2, reader="eager", turn_timeout=600.0
    )


@pytest.mark.parametrize("given", ["2.0", "auto", "maybe"])
def test_values_of_another_type_are_refused_at_parse_time(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A value that is no bool, int or settings object is a usage error naming the argument, before any
    Trainer is built."""
    with pytest.raises(SystemExit) as info:
        _cli(f"--trainer.serialized_checkpoint_loading={given}")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert 'Parser key "trainer.serialized_checkpoint_loading"' in err and f"Given value: {given}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("given", ["0", "-1"])
def test_a_count_below_one_is_refused_when_the_trainer_is_built(given: str) -> None:
    """An int below 1 parses (the annotation is `int`, so that no process imports jsonargparse for it) and is refused
    by `Trainer(...)` with the error code gets, naming the value."""
    with pytest.raises(ValueError, match=rf"serialized_checkpoint_loading={given}\)` is not supported"):
        _cli(f"--trainer.serialized_checkpoint_loading={given}")
