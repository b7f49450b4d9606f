"""The launcher (``serialized-restore run``, ``SERIALIZED_RESTORE``): unmodified programs take turns on every rank and
resume bit for bit as upstream; nothing changes without it, nor in a process that never imports Lightning."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.processes import REPO, job_env, kill_job
from tests.helpers.checks import assert_same, once_per_session

HELPERS = Path(__file__).with_name("helpers")
PTH = REPO / "serialized_restore" / "_bootstrap" / "serialized_restore.pth"
LAUNCHER = [sys.executable, "-m", "serialized_restore", "run"]
JOB_TIMEOUT = 150.0
LAUNCHED = "switched on by `serialized-restore run`"

pytestmark = pytest.mark.timeout(600)


def _run(command: list[str], cwd: Path, *, expect_ok: bool = True, env: dict[str, str] | None = None) -> str:
    """Run ``command`` as the first process of its own session, without ``SERIALIZED_RESTORE`` unless ``env`` sets
    it; its output (stdout and stderr). Every process of the session is killed when it ends or times out."""
    cwd.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != "SERIALIZED_RESTORE"}
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=job_env(env, base=base),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        output, _ = proc.communicate()
        raise AssertionError(f"{command} did not finish within {JOB_TIMEOUT}s:\n{output[-6000:]}") from None
    finally:
        kill_job(proc)
    assert (proc.returncode == 0) == expect_ok, f"{command} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def _assert_launched_like_upstream(
    launched_dir: Path, launched: str, announced: str, plain_dir: Path, plain: str
) -> None:
    """Only the launched run switched the option on (one line, rank 0's) and took turns, on both ranks; both runs
    resumed every rank to the same bits (model, Adam state, step)."""
    assert "serialized restore" not in plain, plain[-6000:]
    assert launched.count("serialized restore:") > launched.count(announced) == 1, launched[-6000:]
    for rank in (0, 1):
        assert f"[rank {rank}] serialized restore: turn for " in launched, launched[-6000:]
        got = torch.load(launched_dir / f"resumed_rank{rank}.pt", weights_only=False)
        expected = torch.load(plain_dir / f"resumed_rank{rank}.pt", weights_only=False)
        assert expected["optimizer"]["state"], "the checkpoint holds Adam's state"
        assert_same(got, expected, f"rank {rank}")


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the Trainer programs' model after two steps (one CPU device, upstream's Trainer), one per test
    session."""

    def save(directory: Path) -> None:
        from lightning.pytorch import Trainer

        program = runpy.run_path(str(HELPERS / "launched_trainer.py"))
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=directory,
        )
        trainer.fit(program["Net"]())
        trainer.save_checkpoint(directory / "two_steps.ckpt")

    return once_per_session(tmp_path_factory, "launcher-checkpoint", save) / "two_steps.ckpt"


@pytest.fixture(scope="module")
def upstream_resumed(tmp_path_factory: pytest.TempPathFactory, trainer_checkpoint: Path) -> tuple[Path, str]:
    """The Trainer program run as it is (upstream, 2 ranks) from that checkpoint, once per test session: the
    directory holding each rank's state right after the restore, and the log. The CLI and `torchrun` programs build
    the same model and optimizer and resume from the same checkpoint, so this state is what upstream gives them too."""

    def resume(directory: Path) -> None:
        command = [sys.executable, str(HELPERS / "launched_trainer.py"), str(trainer_checkpoint)]
        (directory / "log.txt").write_text(_run(command, directory))

    plain_dir = once_per_session(tmp_path_factory, "launcher-upstream-resume", resume)
    return plain_dir, (plain_dir / "log.txt").read_text()


def test_fabric_program_resumes_in_turns(tmp_path: Path) -> None:
    """A script building `lightning.fabric.Fabric` in its `main`, 2 ranks through Fabric's launcher: `fabric.load`."""
    command = [sys.executable, str(HELPERS / "launched_fabric.py")]
    plain = _run(command, tmp_path / "plain")
    launched = _run([*LAUNCHER, "--", *command], tmp_path / "launched")
    announced = f"serialized restore: Fabric(serialized_checkpoint_loading=True) {LAUNCHED} (SERIALIZED_RESTORE=1)"
    _assert_launched_like_upstream(tmp_path / "launched", launched, announced, tmp_path / "plain", plain)


def test_lightning_cli_resumes_in_turns(
    tmp_path: Path, trainer_checkpoint: Path, upstream_resumed: tuple[Path, str]
) -> None:
    """A `LightningCLI` script, `fit --ckpt_path` on 2 ranks, with `--k 2`: the parser's default is the launcher's."""
    pytest.importorskip("jsonargparse")
    command = [
        sys.executable,
        str(HELPERS / "launched_cli.py"),
        "fit",
        f"--ckpt_path={trainer_checkpoint}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        "--trainer.max_steps=3",
    ]
    launched = _run([*LAUNCHER, "--k", "2", "--", *command], tmp_path)
    announced = f"serialized restore: Trainer(serialized_checkpoint_loading=2) {LAUNCHED} (SERIALIZED_RESTORE=2)"
    _assert_launched_like_upstream(tmp_path, launched, announced, *upstream_resumed)


def test_trainer_subclass_defined_at_import_resumes_in_turns(
    tmp_path: Path, trainer_checkpoint: Path, upstream_resumed: tuple[Path, str]
) -> None:
    """A program whose own `Trainer` subclass is defined at import inherits the option: `fit(ckpt_path=...)`."""
    command = [sys.executable, str(HELPERS / "launched_trainer.py"), str(trainer_checkpoint)]
    launched = _run([*LAUNCHER, "--", *command], tmp_path)
    announced = (
        f"serialized restore: RecipeTrainer(serialized_checkpoint_loading=True) {LAUNCHED} (SERIALIZED_RESTORE=1)"
    )
    _assert_launched_like_upstream(tmp_path, launched, announced, *upstream_resumed)


def test_torchrun_ranks_resume_in_turns(
    tmp_path: Path, trainer_checkpoint: Path, upstream_resumed: tuple[Path, str]
) -> None:
    """`torchrun` with 2 ranks of a `pytorch_lightning` script: the ranks torchrun starts get the option (`--k 1`)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [*torchrun, str(HELPERS / "launched_torchrun.py"), str(trainer_checkpoint)]
    launched = _run([*LAUNCHER, "--k", "1", "--", *command], tmp_path)
    announced = f"serialized restore: Trainer(serialized_checkpoint_loading=True) {LAUNCHED} (SERIALIZED_RESTORE=1)"
    _assert_launched_like_upstream(tmp_path, launched, announced, *upstream_resumed)


def test_every_flavour_is_replaced_when_lightning_is_imported(tmp_path: Path) -> None:
    """Nothing is imported before the program imports Lightning; then every package-level name is the project's class,
    defaulting to `--k 3`, also for a subclass; the program's own `False` wins; one line says so, on rank 0."""
    launched = _run([*LAUNCHER, "--k", "3", "--", sys.executable, str(HELPERS / "launched_names.py")], tmp_path)
    for line in ("replaced: True", "default: 3", "subclass: 3", "explicit: False"):
        assert line in launched, launched[-6000:]
    assert launched.count("serialized restore:") == 1, launched[-6000:]
    assert (
        "serialized restore: Framework(serialized_checkpoint_loading=3) switched on by `serialized-restore run`"
        " (SERIALIZED_RESTORE=3)" in launched
    )
    plain = _run([sys.executable, str(HELPERS / "launched_names.py")], tmp_path)
    assert "replaced: False upstream: True" in plain and "serialized restore" not in plain, plain[-6000:]


def test_program_value_wins_and_is_logged(tmp_path: Path) -> None:
    """A program that passes its own value keeps it; rank 0 logs that the launcher's was not used."""
    code = (
        "import lightning.fabric as L\n"
        "fabric = L.Fabric(accelerator='cpu', serialized_checkpoint_loading=2)\n"
        "print('kept:', fabric._serialized_settings.max_concurrent)"
    )
    launched = _run([*LAUNCHER, "--k", "3", "--", sys.executable, "-c", code], tmp_path)
    assert "kept: 2" in launched
    assert (
        "serialized restore: the program builds Fabric(serialized_checkpoint_loading=2) itself, which wins over 3 set"
        " by `serialized-restore run` (SERIALIZED_RESTORE=3)" in launched
    ), launched[-6000:]


def test_unknown_value_is_a_clear_error_where_lightning_is_imported(tmp_path: Path) -> None:
    """`SERIALIZED_RESTORE=yes`: importing Lightning raises `ValueError` naming it and the accepted values; a process
    that never imports Lightning runs as usual."""
    bad = [*LAUNCHER, "--", "env", "SERIALIZED_RESTORE=yes", sys.executable, "-c"]
    failed = _run([*bad, "import lightning.pytorch"], tmp_path, expect_ok=False)
    assert "ValueError: `SERIALIZED_RESTORE='yes'` is not supported. Accepted values: `1`" in failed, failed[-6000:]
    assert "a positive int k" in failed and "Error in sitecustomize" not in failed
    assert _run([*bad, "print('ran')"], tmp_path) == "ran\n"


def test_child_without_the_package_warns_once_and_runs_upstream(tmp_path: Path) -> None:
    """A process where `serialized_restore` cannot be imported (another environment) warns once, however many Lightning
    packages it imports, and keeps upstream's classes."""
    code = (
        "import sys\n"
        "class Uninstalled:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'serialized_restore':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(1, Uninstalled())\n"
        "import pytorch_lightning, lightning\n"
        "print(pytorch_lightning.Trainer.__module__, lightning.Fabric.__module__)\n"
    )
    output = _run([*LAUNCHER, "--", sys.executable, "-c", code], tmp_path)
    assert output.count("SERIALIZED_RESTORE is set but `serialized_restore` is not installed for") == 1, output
    assert "pytorch_lightning.trainer.trainer lightning.fabric.fabric" in output, output


def test_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    """A `sitecustomize` of the user's on `PYTHONPATH` is imported after the bootstrap, which leaves `sys.path` as it
    was."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(
        "import sys\nprint('own sitecustomize; hook first:', type(sys.meta_path[0]).__name__)\n"
    )
    code = "import sys, sitecustomize; print(sitecustomize.__file__); print(any('_bootstrap' in p for p in sys.path))"
    path = os.pathsep.join([str(REPO), str(own)])
    output = _run([*LAUNCHER, "--", sys.executable, "-c", code], tmp_path, env={"PYTHONPATH": path})
    # (the launcher's own process imports it first, as any Python process)
    assert output.splitlines()[-3:] == [
        "own sitecustomize; hook first: _LightningImportHook",
        str(own / "sitecustomize.py"),
        "False",
    ], output


def test_variable_alone_through_the_installed_pth(tmp_path: Path) -> None:
    """Where the wheel's `.pth` is in a site directory, `SERIALIZED_RESTORE=2` alone switches the option on (and
    the log says it was the variable); unset, nothing changes."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / PTH.name).write_text(PTH.read_text())
    # Python's own start-up, with this site directory processed before the others (as site-packages' .pth files are)
    code = (
        f"import site; site.addsitedir({str(site_dir)!r}); site.main()\n"
        "import lightning.fabric as L; print('module:', L.Fabric.__module__); L.Fabric(accelerator='cpu')\n"
    )
    on = _run([sys.executable, "-S", "-c", code], tmp_path, env={"SERIALIZED_RESTORE": "2"})
    assert "module: serialized_restore.lightning" in on, on[-6000:]
    assert "serialized restore: Fabric(serialized_checkpoint_loading=2) switched on by SERIALIZED_RESTORE=2" in on
    off = _run([sys.executable, "-S", "-c", code], tmp_path)
    assert "module: lightning.fabric.fabric" in off and "serialized restore" not in off, off[-6000:]


def test_help_explains_itself(tmp_path: Path) -> None:
    """`serialized-restore run --help` says what it does, names the variable and shows an example."""
    output = _run([*LAUNCHER, "--help"], tmp_path)
    for needed in ("usage: serialized-restore run", "SERIALIZED_RESTORE", "sitecustomize", "examples:", "torchrun"):
        assert needed in output, output


def test_the_launcher_starts_the_program_without_importing_torch(tmp_path: Path) -> None:
    """The launcher's own process imports neither torch nor Lightning before it becomes the program (the program
    imports them itself): starting under the launcher costs no import twice."""
    output = _run([sys.executable, "-X", "importtime", *LAUNCHER[1:], "--", sys.executable, "-c", "pass"], tmp_path)
    imported = {line.split("|")[-1].strip() for line in output.splitlines() if line.startswith("import time:")}
    assert "serialized_restore._launcher.cli" in imported, output[-3000:]
    assert not {name for name in imported if name.split(".")[0] in ("torch", "lightning", "pytorch_lightning")}


def test_the_bootstrap_names_what_the_package_names() -> None:
    """The start-up hook imports nothing of the package before Lightning runs, so it spells the variable, its own
    directory and the modules it watches itself: each as the package spells it."""
    from serialized_restore._launcher import hook

    bootstrap = runpy.run_path(str(Path(hook.BOOTSTRAP) / "sitecustomize.py"), run_name="not_sitecustomize")
    assert bootstrap["_VARIABLE"] == hook.VARIABLE
    assert bootstrap["_WATCHED"] == set(hook.OURS) | set(hook.OURS.values())
    assert os.path.realpath(bootstrap["_HERE"]) == os.path.realpath(hook.BOOTSTRAP) == str(PTH.parent)
    assert f'"{hook.VARIABLE}"' in PTH.read_text() and PTH.name == hook.PTH
