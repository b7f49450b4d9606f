"""The package as a user installs it: a wheel and an sdist built from this tree, installed into a fresh venv."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers.checks import once_per_session

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.tooling, pytest.mark.timeout(600)]

_NOT_SOURCES = (
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "bench_output", "demo_output", ".*_cache"
)  # fmt: skip


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel and an sdist of this tree (built without network, with this environment's setuptools), once per test
    session."""
    pytest.importorskip("build")

    def build(directory: Path) -> None:
        # build from a copy of the tree, so that no stale build directory leaks in and the build leaves nothing behind
        tree = directory / "tree"
        shutil.rmtree(tree, ignore_errors=True)  # what a failed build of an earlier worker left
        shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
        run = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(directory / "dist"), str(tree)]
        subprocess.run(run, check=True, capture_output=True, text=True)
        shutil.rmtree(tree)

    return once_per_session(tmp_path_factory, "dist", build) / "dist"


def test_wheel_metadata_is_complete(dist: Path) -> None:
    """License, typed marker, Python version, valid classifiers, and a description that renders on an index."""
    trove = pytest.importorskip("trove_classifiers")
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(next(n for n in names if n.endswith("/METADATA"))))
    assert "serialized_restore/py.typed" in names
    assert any(n.endswith("/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0" or metadata["License"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    classifiers = metadata.get_all("Classifier")
    assert classifiers and all(c in trove.classifiers for c in classifiers), classifiers
    assert "Framework :: Pytest" not in classifiers
    # Lightning by extra: users of one distribution do not get the other too
    requires = metadata.get_all("Requires-Dist")
    assert not [r for r in requires if "lightning" in r and "extra ==" not in r], requires
    assert any(r.startswith("lightning") and 'extra == "lightning"' in r for r in requires), requires
    assert any(r.startswith("pytorch-lightning") and 'extra == "pytorch-lightning"' in r for r in requires), requires
    description = metadata.get_payload()
    # no image or link that only resolves inside the repository
    assert "](docs/" not in description and "![" not in description
    assert "docs/benchmarks.md" in description


def test_wheel_ships_the_launcher(dist: Path) -> None:
    """The console script, the bootstrap `sitecustomize` and, at the top of site-packages, the `.pth` that lets
    `SERIALIZED_RESTORE` alone switch the option on (the same line as the source's)."""
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
        pth = archive.read("serialized_restore.pth").decode()
    assert "serialized_restore/_bootstrap/sitecustomize.py" in names
    assert "serialized-restore = serialized_restore._launcher.cli:main" in entry_points
    assert pth == (REPO / "serialized_restore" / "_bootstrap" / "serialized_restore.pth").read_text()


def test_sdist_can_run_its_tests(dist: Path, tmp_path: Path) -> None:
    """Unpacked, the sdist runs its own tests against its own copy of the package (two quick modules here; they need
    the test helpers, the fixtures and the harness), and ships what the README's commands need."""
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    (root,) = tmp_path.iterdir()
    for needed in ("LICENSE", "requirements/ci.txt", "requirements/plots.txt", "scripts/test.sh", "scripts/env.sh"):
        assert (root / needed).is_file(), needed
    committed = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert committed <= {p.name for p in (root / "tests").glob("test_*.py")}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_XDIST_WORKER")}
    where = subprocess.run(
        [sys.executable, "-c", "import serialized_restore; print(serialized_restore.__file__)"],
        cwd=root, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(root), where.stdout
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_files.py"]
    result = subprocess.run(
        [*command, "tests/test_settings.py"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# in a child Python with SERIALIZED_RESTORE=1: whether `lightning.pytorch.Trainer` is the package's
_SWITCHED = (
    "import lightning.pytorch as pl, serialized_restore.lightning as ours\n"
    "print('switched' if pl.Trainer is ours.Trainer else 'upstream')\n"
)


# the same, short of importing Lightning: whether the start-up hook that replaces those classes is in place
_HOOKED = (
    "import sys\n"
    "print('switched' if any(type(f).__name__ == '_LightningImportHook' for f in sys.meta_path) else 'upstream')\n"
)


def _venv(venv: Path) -> str:
    """A fresh venv that sees torch, Lightning and setuptools of this environment (a path line in a `.pth`) and has
    no packages of its own: the pip that installs into it is this environment's (`pip --python`), which saves each
    test a copy of pip and setuptools (and a venv's own older setuptools would shadow the one torch requires)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (_site(venv) / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(venv / "bin" / "python")


def _site(venv: Path) -> Path:
    return Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])


def _pip(python: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--python", python]


def _switch(python: str, cwd: Path, code: str = _SWITCHED) -> str:
    env = {**os.environ, "SERIALIZED_RESTORE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip()


def test_wheel_installs_into_a_fresh_venv(dist: Path, tmp_path: Path) -> None:
    """`pip install serialized_restore[lightning]` into a fresh venv that already has torch and Lightning (this
    environment's, through a path line): torch is kept, nothing else is installed, both flavours import, `pip check` is
    clean, the console script runs and `SERIALIZED_RESTORE` alone switches it on."""
    (wheel,) = dist.glob("*.whl")
    python = _venv(tmp_path / "venv")
    pins = re.sub(r"\[[^\]]*\]", "", (REPO / "requirements" / "ci.txt").read_text())
    (torch_pin,) = [line for line in pins.splitlines() if line.startswith("torch==")]
    install = [*_pip(python), "install", "--no-index", f"{wheel}[lightning]"]
    result = subprocess.run(install, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    # what pip installed into the venv: the package alone (a dependency pip wanted to replace would be listed too)
    assert re.findall(r"Successfully installed (.*)", result.stdout) == ["serialized-restore-0.1.0"], result.stdout
    code = (
        "import serialized_restore, serialized_restore.lightning as u, serialized_restore.pytorch_lightning as s\n"
        "import lightning.pytorch, pytorch_lightning, torch\n"
        "assert issubclass(u.Trainer, lightning.pytorch.Trainer) and issubclass(s.Trainer, pytorch_lightning.Trainer)\n"
        "assert serialized_restore.Trainer is s.Trainer\n"
        "print(serialized_restore.__file__)\n"
        "print(torch.__version__)\n"
    )
    imported = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr[-4000:]
    location, version = imported.stdout.splitlines()
    assert location.startswith(str(tmp_path / "venv"))  # the installed copy, not this tree
    assert version.split("+")[0] == torch_pin.split("==")[1]  # kept, not replaced by another build
    check = subprocess.run([*_pip(python), "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    script = subprocess.run([str(tmp_path / "venv" / "bin" / "serialized-restore"), "run", "--help"], text=True,
                            capture_output=True)  # fmt: skip
    assert script.returncode == 0 and "serialized-restore run" in script.stdout, script.stderr
    assert _switch(python, tmp_path) == "switched"


def test_the_variable_switches_it_on_in_an_editable_install(tmp_path: Path) -> None:
    """`pip install -e` places the start-up `.pth` too (`setup.py`'s `editable_wheel`): `SERIALIZED_RESTORE` alone
    switches the option on, with no other command; `serialized-restore hook remove` takes the line out, `hook install`
    puts it back."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    venv = tmp_path / "venv"
    python = _venv(venv)
    site = _site(venv)
    # the package editable from the copy, built with this environment's setuptools, without an isolated build
    install = [*_pip(python), "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(tree)]
    result = subprocess.run(install, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (site / "serialized_restore.pth").exists()
    assert _switch(python, tmp_path) == "switched"  # through Lightning itself
    command = str(venv / "bin" / "serialized-restore")

    def hook(action: str) -> None:
        result = subprocess.run([command, "hook", action], capture_output=True, text=True)
        assert result.returncode == 0 and str(venv) in result.stdout, result.stdout + result.stderr

    hook("remove")
    assert _switch(python, tmp_path, _HOOKED) == "upstream"
    hook("install")
    assert _switch(python, tmp_path) == "switched"  # through Lightning itself
    hook("install")  # again: nothing changes
    assert _switch(python, tmp_path, _HOOKED) == "switched"
    hook("remove")
    assert _switch(python, tmp_path, _HOOKED) == "upstream"
    assert not (site / "serialized_restore.pth").exists()
    # a file of that name that is not the package's is left alone
    (site / "serialized_restore.pth").write_text("# someone else's\n")
    result = subprocess.run([command, "hook", "install"], capture_output=True, text=True)
    assert result.returncode == 1 and "is not this package's" in result.stderr, result.stderr
    assert (site / "serialized_restore.pth").read_text() == "# someone else's\n"
