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

from serialized_restore._readers import (
    choose_reader,
    copy_kept_out_of_mapping,
    local_path,
    read_checkpoint,
    storages_of,
)


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


def test_local_path() -> None:
    """Local paths and file:// URLs map to a path; remote URLs and file objects do not."""
    assert local_path("a/b.ckpt") == "a/b.ckpt"
    assert local_path(Path("a/b.ckpt")) == "a/b.ckpt"
    assert local_path("file:///x/y.ckpt") == "/x/y.ckpt"
    assert local_path("s3://bucket/y.ckpt") is None
    assert local_path(object()) is None


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


def test_only_the_state_an_optimizer_keeps_is_copied_out_of_the_mapping(tmp_path: Path) -> None:
    """After ``load_state_dict`` of memory-mapped state, exactly the tensors the optimizer kept are copied: into
    private memory, values equal, aliases kept together; state the optimizer does not hold is not copied."""
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    trained = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    trained.step()
    torch.save({"optimizer": trained.state_dict(), "extra": torch.ones(1000)}, tmp_path / "o.pt")
    mapped = torch.load(tmp_path / "o.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped["optimizer"])
    assert mapped["extra"].untyped_storage().data_ptr() not in storages

    fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    fresh.load_state_dict(mapped["optimizer"])
    held = [s["exp_avg"] for s in fresh.state.values()]
    assert all(t.untyped_storage().data_ptr() in storages for t in held)  # Adam on CPU keeps the mapped tensors
    copied = copy_kept_out_of_mapping([fresh], storages)
    # exp_avg and exp_avg_sq of both parameters and the two step counters: what Adam keeps, and nothing else
    assert copied == 2 * (4 + 3) * 4 + 2 * 4
    for state, expected in zip(fresh.state.values(), trained.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert state[key].untyped_storage().data_ptr() not in storages
            assert torch.equal(state[key], expected[key])
    assert copy_kept_out_of_mapping([fresh], storages) == 0  # nothing mapped is left


def test_state_an_optimizer_dropped_is_not_copied_and_views_stay_views(tmp_path: Path) -> None:
    """Of mapped state, what the optimizer no longer holds (a sharded optimizer's other shards) is not copied, and
    kept tensors that were views of one storage (in tuples too) are copied as one storage and stay views of it."""
    flat = torch.arange(12.0)
    shared = {"views": (flat[:6], flat[6:]), "alone": torch.ones(5)}
    torch.save({"kept": shared, "dropped": torch.zeros(1000)}, tmp_path / "s.pt")
    mapped = torch.load(tmp_path / "s.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.state[optimizer.param_groups[0]["params"][0]] = mapped["kept"]  # what load_state_dict would keep
    copied = copy_kept_out_of_mapping([optimizer], storages)
    assert copied == 12 * 4 + 5 * 4  # the views' storage once, the lone tensor; nothing of "dropped"
    (state,) = optimizer.state.values()
    first, second = state["views"]
    assert isinstance(state["views"], tuple) and first.untyped_storage().data_ptr() not in storages
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([first, second]), flat) and torch.equal(state["alone"], torch.ones(5))
    assert mapped["dropped"].untyped_storage().data_ptr() in storages  # still the file's: never copied


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def test_a_missing_file_is_read_eagerly_without_a_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A local path with no file behind it goes to the eager read with no reason logged, so upstream's own
    `FileNotFoundError` is the only word about it."""
    missing = str(tmp_path / "missing.ckpt")
    assert choose_reader(_strategy(), missing, "mmap") == ("eager", None)
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
    assert choose_reader(_strategy(), str(garbage), "mmap") == ("eager", None)
    with caplog.at_level(logging.INFO):
        with pytest.raises(pickle.UnpicklingError):
            _read(_strategy(), str(garbage), True, "mmap")
    assert "eagerly" not in caplog.text
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    chosen, reason = choose_reader(_strategy(), str(legacy), "mmap")
    assert chosen == "eager" and reason is not None and "zip format" in reason
