"""The differences between Lightning releases (``serialized_restore/_lightning/versions.py``): each decision matches
what the installed release does, checked against upstream's own Trainer, Fabric and CheckpointIO on real checkpoint
files; an unsupported release is refused when the Trainer or Fabric is built. ``scripts/lightning_matrix.sh`` runs this
module on every supported release."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from packaging.version import Version

import serialized_restore
from harness.models import dataloader, lightning_module, make_callback_class, make_model_class
from harness.trainers import quiet_cpu_trainer_kwargs
from serialized_restore._lightning.names import STANDALONE, UNIFIED, Owner
from serialized_restore._lightning.versions import (
    SUPPORTED,
    SUPPORTED_RANGE,
    UnsupportedLightningError,
    installed_version,
    passes_weights_only,
    read_weights_only,
    restores_callbacks_only_when_fitting,
)
from serialized_restore._restore.readers import read_checkpoint

FLAVOURS = {"pytorch_lightning": STANDALONE, "lightning": UNIFIED}
OURS = {"pytorch_lightning": "serialized_restore.pytorch_lightning", "lightning": "serialized_restore.lightning"}
FABRICS = {"pytorch_lightning": ("lightning_fabric", "serialized_restore.fabric"), "lightning": ("lightning.fabric",
           "serialized_restore.lightning")}  # fmt: skip


class _NotAllowlisted:
    """An object `torch.load(weights_only=True)` refuses to unpickle."""


def _outcome(read: Callable[[], Any]) -> tuple[str, str]:
    try:
        checkpoint = read()
    except Exception as err:  # noqa: BLE001 - the type is the outcome compared
        return "raised", type(err).__name__
    return "read", type(checkpoint["extra"]).__name__


@pytest.mark.parametrize(
    ("module", "owner", "ours"),
    [
        ("pytorch_lightning", "Trainer", "serialized_restore.pytorch_lightning"),
        ("lightning.pytorch", "Trainer", "serialized_restore.lightning"),
        ("lightning_fabric", "Fabric", "serialized_restore.fabric"),
        ("lightning.fabric", "Fabric", "serialized_restore.lightning"),
    ],
)
@pytest.mark.parametrize("version", ["2.3.3", "2.7.0", "3.0.0.dev0"])
def test_an_unsupported_release_is_refused_when_the_trainer_or_fabric_is_built(
    monkeypatch: pytest.MonkeyPatch, module: str, owner: str, ours: str, version: str
) -> None:
    """`Trainer(...)` / `Fabric(...)` on a Lightning outside the supported range raises one error naming the range
    and the installed version, before upstream's constructor runs; the installed release is accepted."""
    cls = getattr(importlib.import_module(ours), owner)
    cls(accelerator="cpu", devices=1, **({"logger": False} if owner == "Trainer" else {}))
    monkeypatch.setattr(sys.modules[module], "__version__", version)
    with pytest.raises(UnsupportedLightningError) as info:
        cls(accelerator="cpu", devices=1, serialized_checkpoint_loading=True)
    message = str(info.value)
    assert SUPPORTED_RANGE in message and f"`{module}` is {version}" in message, message
    assert f"upstream's `{module}.{owner}`" in message, message
    assert isinstance(info.value, serialized_restore.UnsupportedLightningError)  # exported, for `except`


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_the_installed_release_is_supported_and_weights_only_is_passed_where_it_is_taken(flavour: str) -> None:
    """The installed release is in the range; `weights_only` is passed on exactly where the release's entry points
    take it (2.6 on), for the Trainer and for Fabric."""
    decided = FLAVOURS[flavour]
    assert Version(installed_version(decided)) in SUPPORTED
    pl = lightning_module(flavour)
    fabric = importlib.import_module(FABRICS[flavour][0])
    connector = importlib.import_module(f"{pl.__name__}.trainer.connectors.checkpoint_connector")._CheckpointConnector
    assert passes_weights_only(decided) == ("weights_only" in inspect.signature(connector.resume_start).parameters)
    assert passes_weights_only(decided) == ("weights_only" in inspect.signature(pl.Trainer.fit).parameters)
    assert passes_weights_only(decided, Owner.FABRIC) == (
        "weights_only" in inspect.signature(fabric.Fabric.load).parameters
    )
    assert passes_weights_only(decided) == (Version(installed_version(decided)).release >= (2, 6))


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_checkpoint_is_read_with_the_weights_only_the_release_reads_with(flavour: str, tmp_path: Path) -> None:
    """A file that `weights_only=True` refuses is read (or refused) by the memory-mapped and eager readers exactly
    as the release's own `TorchCheckpointIO` reads it when no `weights_only` is given."""
    path = str(tmp_path / "with-object.ckpt")
    torch.save({"state_dict": {"w": torch.ones(3)}, "extra": _NotAllowlisted()}, path)
    pl = lightning_module(flavour)
    strategy = pl.Trainer(accelerator="cpu", devices=1, logger=False).strategy
    upstream = _outcome(lambda: pl.plugins.io.TorchCheckpointIO().load_checkpoint(path))
    assert _outcome(lambda: read_checkpoint(strategy, path, None, "mmap").checkpoint) == upstream
    assert _outcome(lambda: read_checkpoint(strategy, path, None, "eager").checkpoint) == upstream
    expected = None if passes_weights_only(FLAVOURS[flavour], Owner.FABRIC) else False
    assert read_weights_only(FLAVOURS[flavour], None) is expected
    if passes_weights_only(FLAVOURS[flavour]):
        # a release that passes weights_only reads with the user's value
        def mapped(weights_only: bool) -> tuple[str, str]:
            return _outcome(lambda: read_checkpoint(strategy, path, weights_only, "mmap").checkpoint)

        assert mapped(False) == ("read", "_NotAllowlisted") and mapped(True) == ("raised", "UnpicklingError")


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_validate_restores_callbacks_as_the_release_does(flavour: str, tmp_path: Path) -> None:
    """`validate(ckpt_path=...)` with the option on calls the callback hooks upstream's calls, in the same order:
    before 2.5 the callbacks' state is restored only when fitting."""
    pl = lightning_module(flavour)
    model_cls, callback_cls = make_model_class(flavour), make_callback_class(flavour)
    kwargs = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1, enable_checkpointing=False)
    trainer = pl.Trainer(**kwargs, callbacks=[callback_cls()])
    trainer.fit(model_cls(), train_dataloaders=dataloader())
    path = str(tmp_path / "epoch1.ckpt")
    trainer.save_checkpoint(path)
    hooks = {}
    for name, trainer_cls, extra in [
        ("upstream", pl.Trainer, {}),
        ("ours", importlib.import_module(OURS[flavour]).Trainer, {"serialized_checkpoint_loading": True}),
    ]:
        callback = callback_cls()
        trainer_cls(**kwargs, callbacks=[callback], **extra).validate(model_cls(), dataloader(), ckpt_path=path)
        hooks[name] = [record["hook"] for record in callback.records]
    assert hooks["ours"] == hooks["upstream"], hooks
    only_when_fitting = restores_callbacks_only_when_fitting(FLAVOURS[flavour])
    assert ("callback.load_state_dict" in hooks["upstream"]) is not only_when_fitting, hooks


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_fabric_load_takes_what_the_releases_load_takes(flavour: str, tmp_path: Path) -> None:
    """`fabric.load` with the option on accepts `weights_only` where upstream's does and refuses it with upstream's
    `TypeError` where upstream's does; without it, both load the same weights."""
    upstream_module, ours_module = FABRICS[flavour]
    upstream_cls = importlib.import_module(upstream_module).Fabric
    ours_cls = importlib.import_module(ours_module).Fabric
    path = tmp_path / "fabric.ckpt"
    saved = torch.nn.Linear(4, 2)
    upstream_cls(accelerator="cpu", devices=1).save(path, {"model": saved})
    for kwargs in ({}, {"weights_only": True}):
        outcomes = []
        ours = ours_cls(accelerator="cpu", devices=1, serialized_checkpoint_loading=True)
        for fabric in (upstream_cls(accelerator="cpu", devices=1), ours):
            model = torch.nn.Linear(4, 2)
            try:
                fabric.load(path, {"model": model}, **kwargs)
            except TypeError as err:
                outcomes.append(("raised", str(err)))
                continue
            torch.testing.assert_close(model.state_dict(), saved.state_dict(), rtol=0, atol=0)
            outcomes.append(("loaded", ""))
        assert outcomes[0] == outcomes[1], outcomes
        assert outcomes[0][0] == (
            "loaded" if not kwargs or passes_weights_only(FLAVOURS[flavour], Owner.FABRIC) else "raised"
        )


def test_setup_requires_the_supported_range() -> None:
    """`setup.py` requires (both distributions, every extra) the range `Trainer(...)` and `Fabric(...)` accept."""
    text = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'LIGHTNING = "{SUPPORTED_RANGE}"' in text
    assert text.count("lightning{LIGHTNING}") == 4 and "lightning>=" not in text


@pytest.mark.parametrize(
    ("module", "package", "extra"),
    [
        ("serialized_restore.lightning", "lightning", "lightning"),
        ("serialized_restore", "pytorch_lightning", "pytorch-lightning"),
        ("serialized_restore.fabric", "lightning_fabric", "pytorch-lightning"),
    ],
)
def test_a_missing_lightning_package_is_named_with_its_extra(module: str, package: str, extra: str) -> None:
    """Importing the package's module for a Lightning package that is not installed says which extra installs it."""
    code = (  # the package hidden as a missing one is: its import raises ModuleNotFoundError naming it
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] == {package!r}:\n"
        f"            raise ModuleNotFoundError('No module named ' + {package!r}, name={package!r})\n"
        "sys.meta_path.insert(0, Hide())\n"
        f"import {module} as m\n"
        "getattr(m, 'Trainer', None) or getattr(m, 'Fabric')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert f"ModuleNotFoundError: `{package}` is not installed" in result.stderr, result.stderr
    assert f"pip install 'serialized_restore[{extra}]'" in result.stderr, result.stderr
