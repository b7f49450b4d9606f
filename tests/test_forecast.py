"""`serialized-restore forecast`: the tensor table of a real Lightning checkpoint, read without its tensor data, and
the per-node forecast built on it (`serialized_restore/forecast/`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import zipfile
from dataclasses import asdict
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fsspec
import pytest
import pytorch_lightning as pl
import torch
from fsspec.implementations.memory import MemoryFileSystem

from harness.models import dataloader, make_model_class, tensor_bytes
from harness.trainers import quiet_cpu_trainer_kwargs
from serialized_restore import forecast
from serialized_restore._launcher.cli import main
from serialized_restore.forecast.model import SERIALIZED_FIXED_PER_RANK


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint written by a real Trainer after 2 steps of single-device fit, with the model's and Adam's bytes."""
    root = tmp_path_factory.mktemp("preflight")
    model = make_model_class("pytorch_lightning")()
    trainer = pl.Trainer(**quiet_cpu_trainer_kwargs(str(root), 1, "auto", max_steps=2, enable_checkpointing=False))
    trainer.fit(model, dataloader())
    path = root / "last.ckpt"
    trainer.save_checkpoint(path)
    params = list(model.parameters())
    state = trainer.optimizers[0].state_dict()
    return {
        "path": str(path),
        "param_bytes": sum(p.nbytes for p in params),
        "params": len(params),
        "adam_bytes": tensor_bytes(state),
        "step_bytes": sum(entry["step"].nbytes for entry in state["state"].values()),
    }


def _comparable(table: forecast.TensorTable) -> dict[str, Any]:
    """The table's fields that do not depend on where the file was read from."""
    fields = asdict(table)
    for key in ("path", "filesystem", "bytes_read", "seekable", "records", "notes"):
        fields.pop(key)
    return fields


def _forecast_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["forecast", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _without_machine(predicted: dict[str, Any]) -> dict[str, Any]:
    """A JSON forecast without what depends on this machine's free memory or on where the file was read from."""
    predicted = json.loads(json.dumps(predicted))
    predicted.pop("memory")
    for part in predicted["parts"].values():
        if part:
            part.pop("fits")
    for key in ("path", "filesystem", "bytes_read"):
        predicted["table"].pop(key)
    predicted.pop("checkpoint")
    predicted.pop("notes")
    return predicted


def test_table_parts_are_the_models_and_adams_bytes(trained: dict[str, Any]) -> None:
    """Weights: the model's parameter bytes; optimizer state: Adam's; S: the file's size; no other tensors."""
    table = forecast.read_table(trained["path"])
    assert table.checkpoint_bytes == os.path.getsize(trained["path"])
    assert table.weights_bytes == trained["param_bytes"]
    assert table.optimizer_bytes == trained["adam_bytes"]
    assert table.optimizer_by_key == {
        "exp_avg": trained["param_bytes"],
        "exp_avg_sq": trained["param_bytes"],
        "step": trained["step_bytes"],
    }
    assert table.optimizer_step_bytes == 4 * trained["params"] and len(table.optimizers) == 1
    assert table.rest_bytes == 0 and {"loops", "callbacks", "lr_schedulers"} <= set(table.rest_by_key)
    assert table.storages == table.tensors == 4 * trained["params"]
    assert table.locations == {"cpu": table.tensor_bytes} and not table.opaque_globals and not table.missing_records
    loaded = torch.load(trained["path"], weights_only=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(loaded)}
    assert table.tensor_bytes == sum(storages.values())


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


def test_fit_nets_out_the_kept_optimizer_state_and_validate_holds_none(trained: dict[str, Any]) -> None:
    """Fit: net of the kept state beyond DDP's setup copy, raw beside it; validate: raw, nothing kept."""
    table = forecast.read_table(trained["path"])
    w, o, d, c = table.weights_bytes, table.optimizer_bytes, table.tensor_bytes, table.containers_per_rank
    f = SERIALIZED_FIXED_PER_RANK
    fit = forecast.predict(table, 4, 1, "fit", "ddp", 1)
    assert fit.measure == "net" and fit.kept_per_rank == o and fit.setup_transient_per_rank == w
    assert (fit.upstream.weights, fit.upstream.optimizer, fit.upstream.raw) == (4 * w, 4 * o, 4 * (d + c))
    assert fit.upstream.net == 4 * (d + c) - 4 * (o - w) and fit.upstream.kept == 4 * o
    assert (fit.serialized.weights, fit.serialized.optimizer) == (0, 4 * o)
    assert fit.serialized.raw == 4 * (o + c + f) - 4 * w and fit.serialized.net == 4 * (c + f)
    validate = forecast.predict(table, 4, 1, "validate", "ddp", 1)
    assert validate.measure == "raw" and validate.kept_per_rank == 0
    assert validate.upstream.raw == fit.upstream.raw and validate.upstream.net is None
    assert validate.added(validate.upstream) == 4 * (d + c) > fit.added(fit.upstream)
    assert validate.serialized.optimizer == 0 and validate.added(validate.serialized) == 4 * (c + f)


def test_upstream_scales_with_the_local_ranks_and_serialized_stays_at_containers(trained: dict[str, Any]) -> None:
    """Upstream is N x one rank; mapped serialized N x (c + F) whatever k; the eager read grows with k."""
    table = forecast.read_table(trained["path"])
    one = forecast.predict(table, 1)
    per_rank = table.containers_per_rank + SERIALIZED_FIXED_PER_RANK
    for n in (1, 2, 4, 8):
        predicted = forecast.predict(table, n)
        assert (predicted.upstream.raw, predicted.upstream.net) == (n * one.upstream.raw, n * one.upstream.net)
        assert predicted.added(predicted.serialized) == n * per_rank == forecast.predict(table, n, k=n).serialized.net
    eager = [forecast.predict(table, 8, entry="validate", k=k, setup_transient_per_rank=0) for k in (1, 2, 8)]
    assert [p.serialized_eager.raw for p in eager] == [k * table.tensor_bytes + 8 * per_rank for k in (1, 2, 8)]


def test_fsdp_keeps_a_shard_per_rank_of_the_whole_job(trained: dict[str, Any]) -> None:
    """Under FSDP each rank keeps O / (N x M); upstream materializes the whole optimizer state on every rank."""
    table = forecast.read_table(trained["path"])
    predicted = forecast.predict(table, 4, 2, "fit", "fsdp", 1)
    o, c = table.optimizer_bytes, table.containers_per_rank
    assert (
        predicted.kept_per_rank == -(-o // 8)
        and predicted.setup_transient_per_rank == 0
        and predicted.serialized_eager is None
    )
    assert predicted.upstream.net == 4 * (o + table.rest_bytes + c)
    assert predicted.serialized.net == 4 * (
        c + SERIALIZED_FIXED_PER_RANK + max(table.largest_weight_bytes - -(-o // 8), 0)
    )
    remote = dataclasses.replace(table, filesystem="memory")  # FSDP's own restore: the package maps local files only
    assert forecast.predict(remote, 4, 2, "fit", "fsdp", 1).serialized.net == predicted.upstream.net


def test_a_legacy_checkpoint_is_refused_with_exit_code_2(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pre-1.6 (non-zip) checkpoint: a message saying it cannot be forecast, exit code 2, no figures."""
    legacy = tmp_path / "legacy.ckpt"
    torch.save(torch.load(trained["path"], weights_only=True), legacy, _use_new_zipfile_serialization=False)
    assert main(["forecast", str(legacy), "--devices", "4"]) == 2
    out, err = capsys.readouterr()
    assert "legacy (pre-1.6, non-zip)" in err and "cannot be forecast" in err and out == ""
    assert main(["forecast", str(legacy), "--devices", "4", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["plannable"] is False
    # `plan`, the command's former name, is the same command
    assert main(["plan", str(tmp_path / "missing.ckpt"), "--devices", "1"]) == 2


def test_a_memory_url_is_forecast_as_the_local_file(
    trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A `memory://` copy, read through fsspec's file object, gives the local file's table and forecast."""
    url = "memory://preflight/last.ckpt"
    with fsspec.open(url, "wb") as f:
        f.write(Path(trained["path"]).read_bytes())
    try:
        remote, local = forecast.read_table(url), forecast.read_table(trained["path"])
        assert _comparable(remote) == _comparable(local) and remote.filesystem == "memory" and remote.seekable
        assert remote.bytes_read < remote.data_pkl_bytes + 64 * 1024
        args = ["--devices", "4", "--entry", "validate"]
        remote_forecast, local_forecast = (
            _forecast_json(capsys, url, *args),
            _forecast_json(capsys, trained["path"], *args),
        )
        assert _without_machine(remote_forecast) == _without_machine(local_forecast)
        assert local_forecast["notes"] == [] and "copied to local disk once per node" in remote_forecast["notes"][0]
    finally:
        fsspec.filesystem("memory").rm(url)


class _NoSeekFileSystem(MemoryFileSystem):
    """fsspec's memory file system, with files that cannot seek (as a plain HTTP stream)."""

    protocol = "noseek"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "r" in mode:
            f.seekable = lambda: False  # type: ignore[method-assign]
        return f


def test_a_file_system_that_cannot_seek_says_so_and_reads_data_pkl_from_the_stream(trained: dict[str, Any]) -> None:
    """Without seeks, data.pkl is unpickled from the stream's start: the same parts, and a note saying so."""
    fsspec.register_implementation("noseek", _NoSeekFileSystem, clobber=True)
    url = "noseek://preflight/last.ckpt"
    with fsspec.open(url, "wb") as f:
        f.write(Path(trained["path"]).read_bytes())
    table = forecast.read_table(url)
    assert not table.seekable and table.records is None and any("cannot seek" in note for note in table.notes)
    expected = _comparable(forecast.read_table(trained["path"]))
    assert _comparable(table) == expected
    assert "cannot seek" in forecast.render(forecast.predict(table, 2), forecast.Available(None, "unknown"))


def test_an_http_server_without_ranges_is_read_as_a_stream(trained: dict[str, Any], tmp_path: Path) -> None:
    """From an HTTP server that ignores Range, the file is read as a stream: the same parts, a few KiB read."""
    pytest.importorskip("aiohttp")
    # larger than one block of fsspec's reads (64 KiB), which would hold the whole file
    checkpoint = {**torch.load(trained["path"], weights_only=True), "extra": torch.zeros(2**15)}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None  # type: ignore[method-assign,assignment]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        table = forecast.read_table(f"http://127.0.0.1:{server.server_address[1]}/last.ckpt")
    finally:
        server.shutdown()
        server.server_close()
    assert _comparable(table) == _comparable(forecast.read_table(str(tmp_path / "last.ckpt")))
    assert (
        table.rest_by_key["extra"] == 2**17
        and not table.seekable
        and table.filesystem == "http"
        and "Range" in table.notes[0]
    )
    assert table.bytes_read < table.data_pkl_bytes + 1024


def test_json_schema(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """`--json`: checkpoint_bytes, added_bytes_per_node (upstream, serialized: the entry's measure) and the parts."""
    predicted = _forecast_json(capsys, trained["path"], "--devices", "2", "--k", "2")
    assert predicted["checkpoint_bytes"] == os.path.getsize(trained["path"]) and predicted["measure"] == "net"
    assert predicted["job"] == {
        "devices": 2,
        "nodes": 1,
        "entry": "fit",
        "strategy": "ddp",
        "k": 2,
        "accelerator": "cpu",
    }
    added = predicted["added_bytes_per_node"]
    assert set(added) == {"upstream", "serialized"} and all(isinstance(v, int) for v in added.values())
    part_keys = {"label", "weights_bytes", "optimizer_bytes", "rest_bytes", "held_bytes", "raw_bytes", "net_bytes"}
    for name in ("upstream", "serialized", "serialized_eager"):
        part = predicted["parts"][name]
        assert part_keys | {"kept_bytes", "added_bytes", "fits"} == set(part)
        assert part["held_bytes"] == part["weights_bytes"] + part["optimizer_bytes"] + part["rest_bytes"]
    assert added["upstream"] == predicted["parts"]["upstream"]["net_bytes"]
    assert added["serialized"] == predicted["parts"]["serialized"]["net_bytes"]
    assert (
        predicted["table"]["weights_bytes"] + predicted["table"]["optimizer_bytes"]
        == predicted["table"]["tensor_bytes"]
    )
    assert set(predicted["memory"]) == {"available_bytes", "source"} and predicted["page_cache_bytes_per_node"] > 0
    validate = _forecast_json(capsys, trained["path"], "--devices", "2", "--entry", "validate")
    assert validate["measure"] == "raw"
    assert validate["added_bytes_per_node"]["upstream"] == validate["parts"]["upstream"]["raw_bytes"]


def test_the_table_reads_no_tensor_data(trained: dict[str, Any], tmp_path: Path) -> None:
    """A copy whose every data record is overwritten is forecast identically, reading only a few KiB."""
    damaged = tmp_path / "damaged.ckpt"
    shutil.copy(trained["path"], damaged)
    with zipfile.ZipFile(damaged) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
    assert records
    with open(damaged, "r+b") as f:
        for info in records:
            f.seek(info.header_offset)
            name_length, extra_length = struct.unpack("<26xHH", f.read(30))
            f.seek(info.header_offset + 30 + name_length + extra_length)
            f.write(b"\xa5" * info.file_size)
    assert Path(damaged).read_bytes() != Path(trained["path"]).read_bytes()
    table, original = forecast.read_table(str(damaged)), forecast.read_table(trained["path"])
    assert asdict(table) == {**asdict(original), "path": str(damaged)}
    assert table.bytes_read < table.data_pkl_bytes + 8 * 1024 < table.tensor_bytes


def test_unknown_globals_are_recorded_not_imported(tmp_path: Path) -> None:
    """A global outside the allowed ones is never imported or called; storages passed to it still count."""
    module = tmp_path / "pf_untrusted_payload.py"
    marker = tmp_path / "called"
    module.write_text(
        "import torch\n"
        f"def explode(t):\n    open({str(marker)!r}, 'w').close()\n    return t\n"
        "class Payload:\n    def __reduce__(self):\n        return (explode, (torch.ones(10),))\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import pf_untrusted_payload

        path = tmp_path / "odd.ckpt"
        plain = {"set": {1, 2}, "bytes": b"ab", "device": torch.device("cuda", 1), "dtype": torch.bfloat16}
        odd = {"odd": pf_untrusted_payload.Payload(), "plain": plain, "size": torch.Size([3])}
        torch.save({"state_dict": {"w": torch.ones(3)}, "callbacks": odd}, path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pf_untrusted_payload")
    table = forecast.read_table(str(path))
    assert "pf_untrusted_payload" not in sys.modules and not marker.exists()
    assert table.opaque_globals == ["pf_untrusted_payload.explode"]
    assert (table.weights_bytes, table.rest_by_key["callbacks"], table.optimizer_bytes) == (12, 40, 0)


def test_a_gpu_jobs_checkpoint_records_its_devices_and_is_forecast_with_the_same_parts(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """A GPU job's file (storages on cuda:0): same parts, its locations; on a GPU the host keeps the steps."""
    tagged = tmp_path / "cuda.ckpt"
    helper = Path(__file__).with_name("helpers") / "cuda_tagged.py"
    subprocess.run([sys.executable, str(helper), trained["path"], str(tagged)], check=True, timeout=120)
    table, local = forecast.read_table(str(tagged)), forecast.read_table(trained["path"])
    parts = ("weights_bytes", "optimizer_by_key", "optimizers", "rest_by_key", "storages", "tensors")
    assert [getattr(table, name) for name in parts] == [getattr(local, name) for name in parts]
    assert table.locations == {"cuda:0": table.tensor_bytes - trained["step_bytes"], "cpu": trained["step_bytes"]}
    predicted = forecast.predict(table, 4, accelerator="gpu")
    assert predicted.kept_per_rank == trained["step_bytes"] and predicted.setup_transient_per_rank == 0
    assert predicted.upstream.raw == 4 * (table.tensor_bytes + table.containers_per_rank)


def test_memory_available_from_cgroup_v2_v1_or_meminfo(tmp_path: Path) -> None:
    """The smallest v2 memory.max over the process's cgroup and its ancestors, else v1's limit, else MemAvailable."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       1000 kB\nMemAvailable:    600 kB\n")
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text("8192\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (proc / "self" / "cgroup").write_text("0::/job/step\n")
    got = forecast.memory_available(str(proc), str(v2))
    assert got.bytes == 8192 and "cgroup v2 memory.max" in got.source and "job" in got.source
    v1 = tmp_path / "v1"
    (v1 / "memory" / "slurm").mkdir(parents=True)
    (v1 / "memory" / "slurm" / "memory.limit_in_bytes").write_text("4096\n")
    (proc / "self" / "cgroup").write_text("5:cpu,cpuacct:/slurm\n4:memory:/slurm\n")
    got = forecast.memory_available(str(proc), str(v1))
    assert got.bytes == 4096 and "cgroup v1 memory.limit_in_bytes" in got.source
    (v1 / "memory" / "slurm" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    got = forecast.memory_available(str(proc), str(v1))
    assert got.bytes == 600 * 1024 and "MemAvailable" in got.source


def test_the_table_reads_at_a_glance(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The printed table: a row per way to resume, the parts, net and raw for fit, and whether it fits."""
    assert main(["forecast", trained["path"], "--devices", "4"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "weights" in line and "fits?" in line)
    assert all(word in header for word in ("optimizer state", "the rest", "added (net)", "raw peak"))
    assert all(label in out for label in ("upstream Lightning", "serialized, memory-mapped", "read eagerly, k=1"))
    assert "available to the job:" in out and "page cache" in out
