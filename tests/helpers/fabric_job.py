"""A Lightning Fabric job: train and save, or load a checkpoint and train on, with upstream's Fabric or ours.

Usage: ``python tests/helpers/fabric_job.py '<json config>'``, directly (Fabric's own launcher starts the other local
ranks by re-running this command line) or under ``torchrun``. Every rank writes what it ends with to
``<out>/rank<global_rank>.pt``, or, when it raises, ``<out>/rank<global_rank>.error.json``.

Config keys: ``fabric`` (``"upstream"`` or ``"ours"``), ``flavour`` (``"lightning_fabric"`` or ``"lightning"``),
``serialized`` (the option's value), ``devices``, ``strategy`` (``"ddp"``; ``"ddp_overriding_load"``: a DDP
strategy that overrides ``load_checkpoint``; ``"fsdp"``: Fabric's FSDP on CPU, full checkpoints), ``out``,
``action``: ``"save"`` (train ``steps``, then ``fabric.save(save_path, state)``; with ``raw_module_path`` /
``raw_optimizer_path`` also ``torch.save`` the plain state dicts there), ``"load"`` (``fabric.load(ckpt_path, state,
strict)``, with ``state_keys`` choosing the state's entries, then ``steps`` more), ``"load_full"``
(``fabric.load(ckpt_path)``: the whole checkpoint) or ``"load_raw"`` (``fabric.load_raw`` of the module and the
optimizer files), or a list of these, run one after the other in the same processes (every rank's result is then
a dict of each action's result, with the turn log lines of that action). An entry of the list may be a dict: the
action's own config keys (``"action"`` among them) over the job's, and ``name``, the key of its result (by default
its action: a second entry of the same action needs a name of its own). With ``keep_going``, an action that raises
does not end the job at once: the next one runs, and after the last the job raises the last action's exception, its
error file listing every action's error (``cases``: an error's fields, or null where the action did not raise).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.models import TurnLog, fabric_training, make_fabric_cpu_fsdp_class  # noqa: E402
from harness.processes import end_finished_rank, file_mappings, in_mappings  # noqa: E402


def _fabric_class(config: dict[str, Any]) -> Any:
    unified = config.get("flavour") == "lightning"
    if config["fabric"] == "ours":
        if unified:
            from serialized_restore.lightning import Fabric
        else:
            from serialized_restore.fabric import Fabric
        return Fabric
    if unified:
        from lightning.fabric import Fabric
    else:
        from lightning_fabric import Fabric
    return Fabric


def _strategy(config: dict[str, Any]) -> Any:
    name = config.get("strategy", "ddp")
    if name == "fsdp":
        # Fabric's FSDP on CPU, one unit per Linear layer, full checkpoints
        cls = make_fabric_cpu_fsdp_class(config.get("flavour", "lightning_fabric"))
        return cls(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
    if name != "ddp_overriding_load":
        return name
    if config.get("flavour") == "lightning":
        from lightning.fabric.strategies import DDPStrategy
    else:
        from lightning_fabric.strategies import DDPStrategy

    class DDPOverridingLoad(DDPStrategy):
        """A user's DDP strategy with its own ``load_checkpoint`` (it may run collectives there)."""

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            return super().load_checkpoint(*args, **kwargs)

    return DDPOverridingLoad()


class _Counter:
    """A stateful object that is neither a module nor an optimizer: it keeps the tensor it is given."""

    def __init__(self) -> None:
        self.seen = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def _file_backed(values: list[torch.Tensor], path: str) -> list[int]:
    """Indexes of the tensors whose data lies in a mapping of the file at ``path``."""
    ranges = file_mappings(path)
    return [i for i, t in enumerate(values) if in_mappings(t.data_ptr(), ranges)]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def main(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    fabric_class = _fabric_class(config)
    kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": config.get("devices", 2), "strategy": _strategy(config)}
    if config["fabric"] == "ours":
        kwargs["serialized_checkpoint_loading"] = config.get("serialized", True)
    fabric = fabric_class(**kwargs)
    fabric.launch()
    log = TurnLog()
    root = "lightning.fabric" if config.get("flavour") == "lightning" else "lightning_fabric"
    logger = logging.getLogger(f"{root}.serialized_restore")
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    started = time.time()
    cases: list[dict[str, Any] | None] = []
    try:
        if isinstance(config["action"], list):  # one after the other, each on a model and optimizer of its own
            result = {}
            last: BaseException | None = None
            for entry in config["action"]:
                own = entry if isinstance(entry, dict) else {"action": entry}
                name = own.get("name", own["action"])
                start, first_turn = len(log.lines), len(log.turns)
                try:
                    result[name] = _run(fabric, {**config, **own})
                    result[name]["turn_log"] = log.lines[start:]
                    result[name]["turns"] = log.turns[first_turn:]
                    cases.append(None)
                except Exception as err:
                    if not config.get("keep_going"):
                        raise
                    cases.append(_error(err, started))
                    last = err
            if last is not None:
                raise last
        else:
            result = _run(fabric, config)
    except BaseException as err:
        rank = int(os.environ.get("RANK", fabric.global_rank))
        (out / f"rank{rank}.error.json").write_text(json.dumps({**_error(err, started), "cases": cases}))
        raise
    result.update(global_rank=fabric.global_rank, local_rank=fabric.local_rank, turn_log=log.lines, turns=log.turns)
    torch.save(result, out / f"rank{fabric.global_rank}.pt")


def _error(err: BaseException, started: float) -> dict[str, Any]:
    return {
        "type": type(err).__name__,
        "mro": [c.__name__ for c in type(err).__mro__],
        "message": str(err),
        "cause": repr(err.__cause__),
        "traceback": "".join(traceback.format_exception(err)),
        "elapsed": time.time() - started,
    }


def _run(fabric: Any, config: dict[str, Any]) -> dict[str, Any]:
    counter = _Counter()
    model, optimizer, scheduler, train = fabric_training(fabric, counter)

    action = config["action"]
    result: dict[str, Any] = {}
    ckpt = config.get("ckpt_path")
    if action == "save":
        train(config.get("steps", 3), 0)
        state = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "counter": counter,
            "step": config.get("steps", 3),
            "extra": torch.arange(6.0).reshape(2, 3),
            "note": {"text": "saved", "values": [torch.ones(2), 3]},
        }
        fabric.save(config["save_path"], state)
        if config.get("raw_module_path") and fabric.global_rank == 0:
            torch.save(model.module.state_dict(), config["raw_module_path"])
            torch.save(optimizer.optimizer.state_dict(), config["raw_optimizer_path"])
        fabric.barrier()
    elif action == "load":
        full: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "counter": counter,
            "step": 0,
            "extra": None,
        }
        state = {k: full[k] for k in config.get("state_keys", list(full))}
        for name in config.get("missing_keys", []):
            state[name] = 0
        remainder = fabric.load(ckpt, state, strict=config.get("strict", True))
        kept = _tensors(remainder) + _tensors({k: v for k, v in state.items() if not hasattr(v, "state_dict")})
        kept += _tensors(optimizer.optimizer.state) + [counter.seen]
        result["file_backed"] = _file_backed(kept, ckpt)
        result["remainder"] = remainder
        result["plain_state"] = {k: v for k, v in state.items() if not hasattr(v, "state_dict")}
        result["counter"] = counter.seen.clone()
        train(config.get("steps", 2), int(state.get("step", 0) or 0))
    elif action == "load_full":
        checkpoint = fabric.load(ckpt)
        result["file_backed"] = _file_backed(_tensors(checkpoint), ckpt)
        result["remainder"] = checkpoint
    elif action == "load_raw":
        fabric.load_raw(config["raw_module_path"], model)
        fabric.load_raw(config["raw_optimizer_path"], optimizer)
        kept = _tensors(optimizer.optimizer.state) + _tensors(model.state_dict())
        result["file_backed"] = _file_backed(kept, config["raw_optimizer_path"]) + _file_backed(
            kept, config["raw_module_path"]
        )
    else:
        raise ValueError(f"unknown action {action!r}")
    if config.get("strategy") == "fsdp":
        # the rank's shards (a full state dict would gather them, and torch's full-state gather crashes on CPU)
        result["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    else:
        result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["optimizer"] = optimizer.optimizer.state_dict()
    result["scheduler"] = scheduler.state_dict()
    return result


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    end_finished_rank()
