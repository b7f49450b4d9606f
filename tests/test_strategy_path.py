"""The one rule for the Trainer and Fabric: which strategies restore in turns, together (FSDP), or as upstream."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from serialized_restore._lightning.names import Owner
from serialized_restore._lightning.strategies import StrategyPath
from serialized_restore._restore.plan import Notices, decide_strategy_path

# (owner, the package its strategies come from, the restore method a subclass overrides)
OWNERS = [
    ("Trainer", "pytorch_lightning.strategies", "load_model_state_dict"),
    ("Trainer", "lightning.pytorch.strategies", "load_optimizer_state_dict"),
    ("Fabric", "lightning_fabric.strategies", "load_module_state_dict"),
    ("Fabric", "lightning.fabric.strategies", "load_checkpoint"),
]


def _paths(owner: str, strategies: list[object]) -> tuple[list[StrategyPath], list[str]]:
    notices = Notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = [decide_strategy_path(Owner(owner), s, 2, notices) for s in strategies]
    return paths, [str(w.message) for w in caught if "serialized_checkpoint_loading" in str(w.message)]


@pytest.mark.parametrize(("owner", "package", "method"), OWNERS)
def test_ddp_family_and_single_device_take_turns_and_fsdp_restores_together(
    owner: str, package: str, method: str
) -> None:
    """DDP (and a subclass that overrides no restore method) and single device: turns; FSDP: together; no warning."""
    strategies = importlib.import_module(package)
    subclass = type("MyDDP", (strategies.DDPStrategy,), {})
    paths, messages = _paths(
        owner,
        [
            strategies.DDPStrategy(),
            subclass(),
            strategies.SingleDeviceStrategy(device=torch.device("cpu")),
            strategies.FSDPStrategy(),
        ],
    )
    assert paths == [StrategyPath.TURNS, StrategyPath.TURNS, StrategyPath.TURNS, StrategyPath.FSDP]
    assert messages == []


@pytest.mark.parametrize(("owner", "package", "method"), OWNERS)
def test_an_override_of_a_restore_method_restores_as_upstream_with_one_warning(
    owner: str, package: str, method: str
) -> None:
    """A DDP or FSDP subclass that overrides a method through which its base restores (it may run collectives there)
    restores as upstream, with one warning per class naming the method and the owner's value."""
    strategies = importlib.import_module(package)
    ddp = type("OverridingDDP", (strategies.DDPStrategy,), {method: lambda self, *a, **k: None})
    fsdp = type("OverridingFSDP", (strategies.FSDPStrategy,), {method: lambda self, *a, **k: None})
    paths, messages = _paths(owner, [ddp(), ddp(), fsdp()])
    assert paths == [StrategyPath.UPSTREAM] * 3
    done = "loaded" if owner == "Fabric" else "restored"
    assert messages == [
        f"`{owner}(serialized_checkpoint_loading=2)` has no effect with {name}: it overrides {method}. The checkpoint"
        f" is {done} as upstream Lightning does."
        for name in ("OverridingDDP", "OverridingFSDP")
    ]


def test_a_trainer_strategy_that_restores_after_setup_restores_as_upstream() -> None:
    """A DDP subclass that restores after `strategy.setup` (with the model wrapped, where collectives may run) and a
    strategy of no known family restore as upstream, each with its warning."""
    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy

    late = type("LateDDP", (DDPStrategy,), {"restore_checkpoint_after_setup": True})
    paths, messages = _paths("Trainer", [late(), ModelParallelStrategy.__new__(ModelParallelStrategy)])
    assert paths == [StrategyPath.UPSTREAM] * 2
    assert [m.split(":")[0] for m in messages] == [
        "`Trainer(serialized_checkpoint_loading=2)` has no effect with LateDDP",
        "`Trainer(serialized_checkpoint_loading=2)` has no effect with ModelParallelStrategy",
    ]
    assert all("its restore may run collectives, which cannot run while ranks take turns" in m for m in messages)


@pytest.mark.parametrize(("owner", "package", "method"), OWNERS)
def test_a_restore_method_set_on_the_instance_restores_as_upstream_and_says_so(
    owner: str, package: str, method: str
) -> None:
    """A restore method set on the strategy instance (a framework's patch, a test's ``Mock``) restores as upstream,
    with that method, and the warning says it is set on the instance (the class overrides nothing)."""
    strategies = importlib.import_module(package)
    strategy = strategies.DDPStrategy()
    setattr(strategy, method, lambda *args, **kwargs: None)
    paths, messages = _paths(owner, [strategy])
    assert paths == [StrategyPath.UPSTREAM]
    assert messages == [
        f"`{owner}(serialized_checkpoint_loading=2)` has no effect with DDPStrategy: its {method} is set on the"
        f" instance. The checkpoint is {'loaded' if owner == 'Fabric' else 'restored'} as upstream Lightning does."
    ]
