"""``_files``: what is wrong with a checkpoint file, said from its bytes, for every kind of bad file."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from serialized_restore._files import explain_failure, file_problem, local_path


def _checkpoint(path: Path) -> Path:
    torch.save({"state_dict": {"w": torch.zeros(64)}, "pytorch-lightning_version": "2.6.6"}, path)
    return path


def test_a_missing_path_says_it_does_not_exist_and_where_a_relative_one_was_looked_for(tmp_path, monkeypatch):
    """A missing absolute path is named as missing; a relative one also names the working directory it is relative
    to."""
    assert file_problem(str(tmp_path / "missing.ckpt")) == f"{str(tmp_path / 'missing.ckpt')!r} does not exist."
    monkeypatch.chdir(tmp_path)
    assert f"(relative to the working directory {str(tmp_path)!r})" in (file_problem("missing.ckpt") or "")


def test_a_directory_names_the_checkpoints_inside_it(tmp_path):
    """A directory is refused as not a file, naming up to three ``.ckpt`` files in it."""
    for name in ("epoch=3.ckpt", "last.ckpt", "notes.txt"):
        (tmp_path / name).write_text("x")
    problem = file_problem(str(tmp_path)) or ""
    assert "is a directory, not a checkpoint file" in problem and "'epoch=3.ckpt', 'last.ckpt'." in problem
    assert "notes.txt" not in problem


def test_an_empty_file_says_the_save_was_cut_short(tmp_path):
    """A file of 0 bytes is called empty, with the likely cause."""
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert "is empty (0 bytes)" in (file_problem(str(tmp_path / "empty.ckpt")) or "")


def test_a_truncated_archive_says_the_end_is_missing(tmp_path):
    """A zip checkpoint cut in half is truncated: it starts as a checkpoint but the end of the archive is missing."""
    whole = _checkpoint(tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(whole[: len(whole) // 2])
    problem = file_problem(str(tmp_path / "cut.ckpt")) or ""
    assert "is truncated or damaged" in problem and f"({len(whole) // 2} bytes)" in problem


def test_a_corrupted_record_is_named_by_its_checksum(tmp_path):
    """A flipped byte inside the archive's pickle fails its CRC check and is reported as corrupted."""
    path = _checkpoint(tmp_path / "bad.ckpt")
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    # the member's data starts after its local header (30 bytes, its name, its extra field: torch pads it)
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    offset = info.header_offset + 30 + name_length + extra_length + 5
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "is corrupted: Bad CRC-32" in (file_problem(str(path)) or "")


@pytest.mark.parametrize("content", [os.urandom(4096), b"epoch: 3\nval_loss: 0.1\n"], ids=["random", "text"])
def test_random_bytes_and_text_are_not_a_checkpoint_and_get_no_format_hint(tmp_path, content):
    """Random bytes or a text file are neither a zip archive nor a pickle; the explanation quotes the first bytes and
    never suggests torch's legacy format (``_use_new_zipfile_serialization``), which only a pickle would fit."""
    if content[:1] in (b"\x80", b"P"):
        content = b"\x00" + content
    path = tmp_path / "noise.ckpt"
    path.write_bytes(content)
    explanation = explain_failure(str(path), RuntimeError("Weights only load failed ... weights_only=False"))
    assert explanation is not None and "is not a PyTorch checkpoint" in explanation
    assert repr(content[:12]) in explanation
    assert "_use_new_zipfile_serialization" not in explanation
    assert "Loading it with `weights_only=False` would not help: it is damaged or not a checkpoint." in explanation


def test_sound_files_and_remote_paths_are_left_to_the_original_message(tmp_path):
    """A sound zip checkpoint, a legacy (pickle) checkpoint and a remote URL give no explanation of the file."""
    assert file_problem(str(_checkpoint(tmp_path / "ok.ckpt"))) is None
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    assert file_problem(str(legacy)) is None
    assert file_problem("s3://bucket/epoch=3.ckpt") is None
    assert explain_failure(str(legacy), RuntimeError("size mismatch")) is None


def test_a_bare_state_dict_is_named_as_such(tmp_path):
    """A Lightning restore of a sound file that lacks Lightning's keys says it looks like a bare ``state_dict`` and
    how to load one."""
    path = _checkpoint(tmp_path / "weights.pt")
    explanation = explain_failure(str(path), KeyError("pytorch-lightning_version")) or ""
    assert "is not a Lightning checkpoint (it has no 'pytorch-lightning_version' key)" in explanation
    assert "model.load_state_dict(torch.load(path))" in explanation


def test_local_path() -> None:
    """Local paths and file:// URLs map to a path; remote URLs and file objects do not."""
    assert local_path("a/b.ckpt") == "a/b.ckpt"
    assert local_path(Path("a/b.ckpt")) == "a/b.ckpt"
    assert local_path("file:///x/y.ckpt") == "/x/y.ckpt"
    assert local_path("s3://bucket/y.ckpt") is None
    assert local_path(object()) is None
