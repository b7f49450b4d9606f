"""The models and data of the tests, the benchmarks and the demo, in either Lightning flavour."""

from __future__ import annotations

import functools
import importlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def lightning_module(flavour: str) -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``."""
    return importlib.import_module("lightning.pytorch" if flavour == "lightning" else "pytorch_lightning")


class RegressionSteps:
    """The steps of a model that regresses ``y`` on ``x`` with ``self.net``: mixed in before ``LightningModule``."""

    net: torch.nn.Module
    log: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)  # type: ignore[operator]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)  # type: ignore[operator]

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)  # type: ignore[operator]

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])  # type: ignore[operator]


class _SleepOnLoadStepLR(torch.optim.lr_scheduler.StepLR):
    """``StepLR`` whose ``load_state_dict`` first sleeps ``seconds``."""

    seconds = 0.0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        time.sleep(self.seconds)
        super().load_state_dict(state_dict)


@functools.cache
def make_model_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class RecordingModel(RegressionSteps, pl.LightningModule):
        """An MLP trained with Adam and a step lr scheduler that records what ``on_load_checkpoint`` receives."""

        def __init__(self, width: int = 32, depth: int = 2) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
            self.load_records: list[dict[str, Any]] = []

        optimizer_kind = "adam"
        """``"adam"``, or ``"zero"``: Adam sharded across the ranks by ``ZeroRedundancyOptimizer`` (under ``ddp``)."""

        def configure_optimizers(self) -> Any:
            if self.optimizer_kind == "zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                optimizer: Any = ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
            else:
                optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            scheduler_class: Any = torch.optim.lr_scheduler.StepLR
            if self.scheduler_load_sleep:
                # the seconds as a class attribute: the scheduler's state_dict() (its __dict__) stays StepLR's
                seconds = {"seconds": self.scheduler_load_sleep}
                scheduler_class = type("SleepOnLoadStepLR", (_SleepOnLoadStepLR,), seconds)
            scheduler = scheduler_class(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        scheduler_load_sleep = 0.0
        """Seconds the lr scheduler's ``load_state_dict`` sleeps (in Lightning's second restore stage), to make that
        stage long enough to observe whether the ranks run it at once."""

        hook_sleep = 0.0
        """Seconds ``on_load_checkpoint`` sleeps, to make turns long enough to observe their overlap."""

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.load_records.append(describe_checkpoint("module", checkpoint))
            time.sleep(self.hook_sleep)

    return _published(RecordingModel, flavour)


@functools.cache
def make_callback_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class RecordingCallback(pl.Callback):
        """Records what the callback hooks receive; its state is a counter restored from the checkpoint."""

        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []
            self.batches_seen = 0

        @property
        def state_key(self) -> str:
            return "RecordingCallback"  # the same in both flavours, whatever the class is called

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.batches_seen += 1

        def state_dict(self) -> dict[str, Any]:
            return {"batches_seen": self.batches_seen}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.records.append({"hook": "callback.load_state_dict", "state": dict(state_dict)})
            self.batches_seen = state_dict["batches_seen"]

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            self.records.append(describe_checkpoint("callback", checkpoint))

    return _published(RecordingCallback, flavour)


def describe_checkpoint(hook: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A comparable summary of a checkpoint dict as a hook sees it: keys, and a digest of every tensor."""
    digests: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digests[prefix] = (tuple(value.shape), str(value.dtype), value.double().sum().item())
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}/{i}", item)

    visit("", checkpoint)
    return {"hook": hook, "keys": sorted(checkpoint.keys()), "tensors": digests}


def make_data(n: int = 64, width: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))


def dataloader(batch_size: int = 8) -> DataLoader:
    return DataLoader(make_data(), batch_size=batch_size, shuffle=False)


def fabric_training(fabric: Any, counter: Any, width: int = 32) -> tuple[Any, Any, Any, Any]:
    """The Fabric jobs' model, Adam and StepLR, set up by ``fabric`` (seeded alike on every rank), and
    ``train(steps, start)``, which steps through the rank's own data and counts each step in ``counter.seen``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(1234 + fabric.global_rank)
    data = [(torch.randn(8, width, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(8)]

    def train(steps: int, start: int) -> None:
        for step in range(start, start + steps):
            x, y = data[step % len(data)]
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            counter.seen = counter.seen + 1

    return model, optimizer, scheduler, train


class TurnLog(logging.Handler):
    """Keeps this rank's serialized-restore log lines with their timestamps (``lines``), and the record each turn's
    line carries (``turns``: its fields and ``created``), for checks that must not depend on the lines' wording."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[tuple[float, str]] = []
        self.turns: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.getMessage()))
        turn = getattr(record, "turn", None)
        if isinstance(turn, dict):
            self.turns.append({**turn, "created": record.created})


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer that holds this rank's state: a sharded optimizer's (ZeRO, fairscale ``OSS``) inner one."""
    inner = getattr(optimizer, "optim", None)
    return (
        inner
        if hasattr(optimizer, "consolidate_state_dict") and isinstance(inner, torch.optim.Optimizer)
        else optimizer
    )


def local_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The state this rank's optimizer holds: for a sharded optimizer, its own shard."""
    return local_optimizer(optimizer).state_dict()


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@functools.cache
def make_precision_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class RecordingPrecision(pl.plugins.precision.Precision):
        """Records the cached checkpoint as the second restore stage sees it."""

        stage2_view: dict[str, Any] = {}

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.stage2_view = {
                "keys": sorted(checkpoint),
                "tensor_bytes": {k: tensor_bytes(v) for k, v in checkpoint.items()},
            }

    return _published(RecordingPrecision, flavour)


@functools.cache
def make_writer_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class ResultWriter(pl.Callback):
        """Writes what this rank ends with to ``<out>/rank<global_rank>.pt``, in the process that ran the stage."""

        def __init__(self, config: dict[str, Any], recorder: Any) -> None:
            self.config = config
            self.recorder = recorder
            self.turn_log: Any = None
            self.history: list[dict[str, Any]] = []

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.turn_log = TurnLog()
            root = "lightning.pytorch" if self.config.get("flavour") == "lightning" else "pytorch_lightning"
            logger = logging.getLogger(f"{root}.serialized_restore")
            logger.addHandler(self.turn_log)
            logger.setLevel(logging.DEBUG)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            fitting = stage == "fit"
            result = {
                "global_rank": trainer.global_rank,
                "local_rank": trainer.local_rank,
                "node_rank": trainer.node_rank,
                "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "optimizers": [local_optimizer_state(opt) for opt in trainer.optimizers] if fitting else [],
                "optimizer_state_bytes": sum(tensor_bytes(local_optimizer_state(o)) for o in trainer.optimizers),
                "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs] if fitting else [],
                "global_step": trainer.global_step,
                "fit_loop": trainer.fit_loop.state_dict(),
                "module_records": pl_module.load_records,
                "callback_records": self.recorder.records,
                "callback_batches_seen": self.recorder.batches_seen,
                "turn_log": self.turn_log.lines if self.turn_log else [],
                "turns": self.turn_log.turns if self.turn_log else [],
                "stage2_view": getattr(trainer.precision_plugin, "stage2_view", {}),
                "ckpt_path": trainer.ckpt_path,
            }
            pl_module.load_records = []
            self.recorder.records = []
            if hasattr(trainer.precision_plugin, "stage2_view"):
                trainer.precision_plugin.stage2_view = {}
            if self.turn_log is not None:
                self.turn_log.lines, self.turn_log.turns = [], []
            self.history.append(result)
            torch.save({**result, "history": self.history}, Path(self.config["out"]) / f"rank{trainer.global_rank}.pt")

    return _published(ResultWriter, flavour)


@functools.cache
def make_cpu_fsdp_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class CPUFSDPStrategy(pl.strategies.FSDPStrategy):
        """Lightning's ``FSDPStrategy`` on CPU: torch's FSDP runs there with gloo when given ``device_id=cpu``.

        Only ``_setup_model`` differs (Lightning's passes the CUDA device index); the restore path is upstream's.
        """

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                model = FullyShardedDataParallel(
                    module=model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs
                )
            return model

    return _published(CPUFSDPStrategy, flavour)


@functools.cache
def make_fabric_cpu_fsdp_class(flavour: str) -> type:
    """Fabric's ``FSDPStrategy`` on CPU (``flavour``: ``"lightning_fabric"`` or ``"lightning"``)."""
    fabric = importlib.import_module("lightning.fabric" if flavour == "lightning" else "lightning_fabric")

    class FabricCPUFSDPStrategy(fabric.strategies.FSDPStrategy):
        """Fabric's ``FSDPStrategy`` on CPU: only ``setup_module`` differs (Fabric's passes the CUDA device index,
        ``None`` on CPU, and its connector accepts a subclass on CPU); the load path is upstream's."""

        def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
                module = FullyShardedDataParallel(
                    module=module,
                    device_id=torch.device("cpu"),
                    sharding_strategy=self.sharding_strategy,
                    **self._fsdp_kwargs,
                )
            return module

    return _published(FabricCPUFSDPStrategy, flavour)


@functools.cache
def make_fairscale_sharded_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class FairscaleShardedStrategy(pl.strategies.DDPStrategy):
        """Lightning 1.x's ``ddp_sharded`` strategy, for Lightning 2.6: fairscale's ``OSS`` optimizers (each rank
        keeps the state of its own shard of the parameters) and ``ShardedDataParallel``.

        As there, the optimizers are re-created as ``OSS`` before the model is wrapped; the checkpoint holds the
        state consolidated on rank 0 (Lightning's ``Strategy.optimizer_state`` calls ``consolidate_state_dict``), and on
        restore every rank hands the full state to ``OSS.load_state_dict``, which keeps the rank's shard. The restore
        methods are Lightning's own.
        """

        def configure_ddp(self) -> None:
            from fairscale.nn.data_parallel import ShardedDataParallel
            from fairscale.optim import OSS

            trainer = self.lightning_module.trainer
            super().setup_optimizers(trainer)
            sharded = []
            for optimizer in self.optimizers:
                if not isinstance(optimizer, OSS):
                    replaced = optimizer
                    optimizer = OSS(params=optimizer.param_groups, optim=type(optimizer), **optimizer.defaults)
                    for config in trainer.lr_scheduler_configs:
                        if config.scheduler.optimizer is replaced:
                            config.scheduler.optimizer = optimizer
                sharded.append(optimizer)
            self.optimizers = sharded
            self.model = ShardedDataParallel(self.model, sharded_optimizer=sharded)

        def setup_optimizers(self, trainer: Any) -> None:
            # DDPStrategy.setup calls this after configure_ddp, which has set the OSS optimizers up already
            if not self.optimizers:
                super().setup_optimizers(trainer)

    return _published(FairscaleShardedStrategy, flavour)


_FACTORIES = {
    "RecordingModel": make_model_class,
    "RecordingCallback": make_callback_class,
    "RecordingPrecision": make_precision_class,
    "ResultWriter": make_writer_class,
    "CPUFSDPStrategy": make_cpu_fsdp_class,
    "FabricCPUFSDPStrategy": make_fabric_cpu_fsdp_class,
    "FairscaleShardedStrategy": make_fairscale_sharded_class,
}


def _published(cls: type, flavour: str) -> type:
    """Give a class built per flavour a module-level name, so ``ddp_spawn`` can pickle its instances."""
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__ = f"{cls.__name__}__{flavour}"
    return cls


def __getattr__(name: str) -> Any:
    base, sep, flavour = name.partition("__")
    if sep and base in _FACTORIES:
        return _FACTORIES[base](flavour)
    raise AttributeError(name)
