"""How checkpoint bytes are read: mmap eligibility, fallbacks, `weights_only` semantics and private copies."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.strategies import SingleDeviceStrategy

from serialized_restore._restore.readers import choose_reader, read_checkpoint


class _Custom:
    """Not allow-listed for `weights_only=True` loading."""

    def __init__(self) -> None:
        self.value = 3


class _OtherIO(TorchCheckpointIO):
    pass


def _strategy(checkpoint_io: TorchCheckpointIO | None = None) -> SingleDeviceStrategy:
    return SingleDeviceStrategy(device=torch.device("cpu"), checkpoint_io=checkpoint_io or TorchCheckpointIO())


def _save(path: Path, **kwargs: object) -> dict:
    checkpoint = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1}
    torch.save(checkpoint, path, **kwargs)
    return checkpoint


def _read(strategy: Any, path: str, weights_only: bool, requested: str) -> Any:
    """As a plan reads: the reader ``choose_reader`` picks for ``requested``, then ``read_checkpoint``."""
    return read_checkpoint(strategy, path, weights_only, *choose_reader(strategy, path, requested))


def test_zip_checkpoint_is_memory_mapped(tmp_path: Path) -> None:
    """A local zip checkpoint read by the stock CheckpointIO is memory-mapped and equals the saved content."""
    saved = _save(tmp_path / "a.ckpt")
    loaded = _read(_strategy(), str(tmp_path / "a.ckpt"), True, "auto")
    assert loaded.reader == "mmap"
    assert loaded.bytes_read == (tmp_path / "a.ckpt").stat().st_size
    assert torch.equal(loaded.checkpoint["state_dict"]["w"], saved["state_dict"]["w"])
    assert loaded.checkpoint["epoch"] == 1


@pytest.mark.parametrize("case", ["legacy", "custom_io", "eager"])
def test_fallback_to_eager(tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str) -> None:
    """Legacy (non-zip) files, a custom CheckpointIO or reader="eager" are read through the strategy, as upstream."""
    path = tmp_path / "a.ckpt"
    saved = _save(path, _use_new_zipfile_serialization=case != "legacy")
    strategy = _strategy(_OtherIO() if case == "custom_io" else None)
    with caplog.at_level(logging.INFO):
        loaded = _read(strategy, str(path), True, "eager" if case == "eager" else "mmap")
    assert loaded.reader == "eager"
    assert torch.equal(loaded.checkpoint["state_dict"]["w"], saved["state_dict"]["w"])
    if case != "eager":
        assert "eagerly instead of memory-mapped" in caplog.text
        assert choose_reader(strategy, str(path), "mmap")[1] is not None


@pytest.mark.parametrize("reader", ["mmap", "eager"])
def test_weights_only_keeps_its_meaning(tmp_path: Path, reader: str) -> None:
    """weights_only=True refuses a non-allow-listed object with both readers; False loads it."""
    path = tmp_path / "a.ckpt"
    torch.save({"state_dict": {}, "extra": _Custom()}, path)
    with pytest.raises(Exception, match="weights_only"):
        _read(_strategy(), str(path), True, reader)
    loaded = _read(_strategy(), str(path), False, reader)
    assert loaded.checkpoint["extra"].value == 3


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def test_a_missing_file_is_read_eagerly_without_a_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A local path with no file behind it goes to the eager read with no reason logged, so upstream's own
    `FileNotFoundError` is the only word about it."""
    missing = str(tmp_path / "missing.ckpt")
    assert choose_reader(_strategy(), missing, "mmap") == ("eager", "")
    with caplog.at_level(logging.INFO):
        with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
            _read(_strategy(), missing, True, "mmap")
    assert "eagerly" not in caplog.text


def test_a_file_that_is_no_checkpoint_is_read_eagerly_without_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that is neither a zip archive nor a pickle (random bytes) gets no reader line: upstream's own error is
    the only word about it; a legacy (pickle) checkpoint still says why it is read eagerly."""
    garbage = tmp_path / "random.ckpt"
    garbage.write_bytes(bytes(range(7, 200)) * 10)
    assert choose_reader(_strategy(), str(garbage), "mmap") == ("eager", "")
    with caplog.at_level(logging.INFO):
        with pytest.raises(pickle.UnpicklingError):
            _read(_strategy(), str(garbage), True, "mmap")
    assert "eagerly" not in caplog.text
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    chosen, reason = choose_reader(_strategy(), str(legacy), "mmap")
    assert chosen == "eager" and reason is not None and "zip format" in reason
