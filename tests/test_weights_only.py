"""Every way a checkpoint can be named is read with the ``weights_only`` upstream Lightning reads it with: a local
path, a ``file://`` URL, a remote fsspec URL, an ``http://`` URL and a ``CheckpointIO`` of the user's own. Each case
runs upstream's Trainer and the package's side by side, in this process, on a checkpoint whose hyperparameters hold
an object that ``weights_only=True`` refuses: both load it, or both refuse it with the same error."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from harness.models import dataloader, make_model_class
from harness.trainers import quiet_cpu_trainer_kwargs
from serialized_restore.lightning import Trainer as SerializedTrainer

pytestmark = pytest.mark.timeout(120)


class Tag:
    """A plain object in the hyperparameters: ``torch.load(weights_only=True)`` refuses to unpickle it."""

    def __init__(self, name: str) -> None:
        self.name = name


class TaggedModel(make_model_class("lightning")):  # type: ignore[misc]
    def __init__(self, tag: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


class OwnCheckpointIO(TorchCheckpointIO):
    """A ``CheckpointIO`` of the user's own (here: upstream's reading, under another class)."""


@pytest.fixture(scope="module")
def tagged_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose hyperparameters hold a ``Tag``."""
    path = tmp_path_factory.mktemp("tagged") / "tagged.ckpt"
    trainer = pl.Trainer(
        **quiet_cpu_trainer_kwargs(str(path.parent), 1, "auto", max_steps=1, enable_checkpointing=False)
    )
    trainer.fit(TaggedModel(Tag("x")), train_dataloaders=dataloader())
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def http_url(tagged_checkpoint: Path) -> Iterator[str]:
    """The checkpoint served over HTTP on 127.0.0.1."""
    payload = tagged_checkpoint.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _head(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802
            self._head()

        def do_GET(self) -> None:  # noqa: N802
            self._head()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/tagged.ckpt"
    server.shutdown()
    server.server_close()


def _validate(trainer_cls: type, path: str, tmp_path: Path, weights_only: Any, io: bool) -> str:
    """``validate(ckpt_path=path)`` with a fresh Trainer of ``trainer_cls`` (the package's with the option on):
    ``"loaded"``, or the error's type and first line."""
    extra = {"serialized_checkpoint_loading": True} if trainer_cls is SerializedTrainer else {}
    plugins = [OwnCheckpointIO()] if io else []
    trainer = trainer_cls(**quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", plugins=plugins), **extra)
    kwargs = {} if weights_only == "unset" else {"weights_only": weights_only}
    try:
        trainer.validate(TaggedModel(), dataloaders=dataloader(), ckpt_path=path, verbose=False, **kwargs)
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "loaded"


@pytest.mark.parametrize("weights_only", ["unset", True, False])
@pytest.mark.parametrize("where", ["local", "file://", "memory://", "http://", "own CheckpointIO"])
def test_each_path_reads_with_upstreams_weights_only(
    where: str, weights_only: Any, tagged_checkpoint: Path, http_url: str, tmp_path: Path, monkeypatch
) -> None:
    """Both Trainers end alike: loaded, or the same error (an ``http://`` URL unset loads, as upstream defaults to
    ``weights_only=False`` for URLs; every other unset path refuses the object, as torch defaults to ``True``)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # where upstream's URL read caches the file
    path = str(tagged_checkpoint)
    if where == "file://":
        path = "file://" + path
    elif where == "memory://":
        path = "memory://checkpoints/tagged.ckpt"
        with fsspec.open(path, "wb") as f:
            f.write(tagged_checkpoint.read_bytes())
    elif where == "http://":
        path = http_url
    io = where == "own CheckpointIO"
    upstream = _validate(pl.Trainer, path, tmp_path / "upstream", weights_only, io)
    ours = _validate(SerializedTrainer, path, tmp_path / "ours", weights_only, io)
    assert ours == upstream
    refused = weights_only is True or (weights_only == "unset" and where != "http://")
    assert (upstream != "loaded") == refused, upstream
    if refused:
        assert upstream.startswith("UnpicklingError"), upstream
    assert torch.load(tagged_checkpoint, weights_only=False)["hyper_parameters"]["tag"].name == "x"
