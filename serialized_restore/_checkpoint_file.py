"""What is wrong with a checkpoint file that failed to load, from a cheap look at its bytes (never unpickled)."""

from __future__ import annotations

import os
import zipfile

from serialized_restore._readers import local_path

# small archive members worth a checksum test: the pickle and torch's format records
_CHECKED_MEMBERS = ("data.pkl", ".format_version", "version", "byteorder", ".storage_alignment")
_CHECKED_MEMBER_BYTES = 64 * 2**20


def explain_failure(checkpoint_path: str, err: BaseException) -> str | None:
    """What a failed load of ``checkpoint_path`` most likely means, or ``None`` when the file looks sound."""
    problem = file_problem(checkpoint_path)
    if problem is not None:
        if "weights_only" in str(err):
            problem += " Loading it with `weights_only=False` would not help: it is damaged or not a checkpoint."
        return problem
    if isinstance(err, KeyError) and err.args in (("pytorch-lightning_version",), ("state_dict",)):
        return (
            f"{checkpoint_path!r} is not a Lightning checkpoint (it has no {err.args[0]!r} key): it looks like a"
            " bare `state_dict` saved with `torch.save(model.state_dict(), path)`. Load it into the model with"
            " `model.load_state_dict(torch.load(path))` before calling the Trainer, instead of passing it as"
            " `ckpt_path`."
        )
    return None


def file_problem(path: str) -> str | None:
    """What is wrong with the file at ``path`` itself, or ``None`` if nothing cheap to see is (or it is remote)."""
    local = local_path(path)
    if local is None:
        return None
    if not os.path.lexists(local):
        where = "" if os.path.isabs(local) else f" (relative to the working directory {os.getcwd()!r})"
        return f"{path!r} does not exist{where}."
    if os.path.isdir(local):
        files = sorted(name for name in os.listdir(local) if name.endswith(".ckpt"))[:3]
        inside = f" It contains {', '.join(map(repr, files))}." if files else ""
        return f"{path!r} is a directory, not a checkpoint file: pass the path of a checkpoint file.{inside}"
    try:
        size = os.path.getsize(local)
        with open(local, "rb") as f:
            head = f.read(16)
    except OSError as err:
        return f"{path!r} cannot be read: {err}."
    if size == 0:
        return f"{path!r} is empty (0 bytes): the save that wrote it was probably interrupted, or the disk was full."
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(local):
            return (
                f"{path!r} is truncated or damaged: it starts as a PyTorch checkpoint (a zip archive) but the end of"
                f" the archive is missing ({size} bytes). The save or the copy that wrote it was probably cut short."
            )
        return _archive_problem(path, local)
    if head.startswith(b"\x80"):
        return None  # a pickle: torch's legacy (pre-1.6) format, which torch.load reads
    return (
        f"{path!r} is not a PyTorch checkpoint: it is neither a zip archive nor a pickle (it starts with"
        f" {head[:12]!r})."
    )


def _archive_problem(path: str, local: str) -> str | None:
    try:
        with zipfile.ZipFile(local) as archive:
            for info in archive.infolist():
                if info.filename.endswith(_CHECKED_MEMBERS) and info.file_size <= _CHECKED_MEMBER_BYTES:
                    with archive.open(info) as member:
                        while member.read(2**20):
                            pass
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{path!r} is corrupted: {err}."
    return None
