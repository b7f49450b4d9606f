import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

here = Path(__file__).parent
PTH = "serialized_restore.pth"
LIGHTNING = ">=2.4,<2.7"  # as serialized_restore/_lightning/versions.py's SUPPORTED_RANGE
version = {}
for line in (here / "serialized_restore" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)


def long_description() -> str:
    """The README as a package index shows it: its images and links into the repository only resolve next to the
    files, so images are left out and such links become text naming the file (shipped in the sdist)."""
    text = (here / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"^!\[[^\]]*\]\((?!https?://)[^)]*\)\n\n?", "", text, flags=re.MULTILINE)
    return re.sub(r"\[([^\]]+)\]\((?!https?://|#)([^)]+)\)", r"\1 (`\2` in the source distribution)", text)


class build_py_with_pth(build_py):
    """Also puts ``serialized_restore.pth`` at the top of the wheel, where site-packages' ``.pth`` files go: Python
    runs its one line at every start, which, only when ``SERIALIZED_RESTORE`` is set, puts the launcher's bootstrap
    first on the path, so that the variable alone switches the option on (``serialized_restore/_launcher/hook.py``)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(here / "serialized_restore" / "_bootstrap" / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class editable_wheel_with_pth(editable_wheel):
    """The same ``.pth`` line in an editable install (``pip install -e``), which otherwise holds only setuptools' own
    finder: ``SERIALIZED_RESTORE`` alone then switches the option on there too. Python reads the ``.pth`` files of
    site-packages in name order, setuptools' ``__editable__`` one first, so the package is found when this line runs."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # noqa: ANN001, ANN202
        outputs = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(here / "serialized_restore" / "_bootstrap" / PTH, Path(unpacked_wheel) / PTH)
        return outputs


setup(
    name="serialized_restore",
    version=version["__version__"],
    description="Resume PyTorch Lightning jobs from large checkpoints without running the host out of memory.",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["serialized_restore", "serialized_restore.*"]),
    package_data={"serialized_restore": ["py.typed", "_bootstrap/sitecustomize.py"]},
    entry_points={"console_scripts": ["serialized-restore = serialized_restore._launcher.cli:main"]},
    cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth},
    # Lightning 2.6 needs Python >= 3.10; CI tests Python 3.11 (requirements/ci.txt)
    python_requires=">=3.10",
    # Supported: Lightning 2.4, 2.5 and 2.6 (serialized_restore/_lightning/versions.py's SUPPORTED, which Trainer(...)
    # and Fabric(...) check), both the `pytorch-lightning` and the unified `lightning` distribution. CI runs the suite
    # on 2.6.6 and a core subset on 2.4.0, 2.5.6 and Lightning's master (scripts/lightning_matrix.sh).
    # Lightning comes with an extra, so that users of one distribution do not get the other too: `[lightning]` for
    # `import lightning`, `[pytorch-lightning]` for `import pytorch_lightning` / `lightning_fabric`; a module of the
    # package whose Lightning is missing says which to install (serialized_restore/_lightning/versions.py)
    install_requires=["torch>=2.1", "packaging", "fsspec"],
    extras_require={
        "lightning": [f"lightning{LIGHTNING}"],
        "pytorch-lightning": [f"pytorch-lightning{LIGHTNING}"],
        "test": [
            f"lightning{LIGHTNING}",
            "pytest",
            "pytest-xdist",
            "pytest-timeout",
            "jsonargparse[signatures]",
            "psutil>=5.9",
        ],
        "benchmark": [f"lightning{LIGHTNING}", "matplotlib", "psutil>=5.9"],
    },
    license="Apache-2.0",
    license_files=["LICENSE"],
    project_urls={
        "Problem report (Lightning #8043)": "https://github.com/Lightning-AI/pytorch-lightning/issues/8043",
        "Upstream proposal (Lightning #9406)": "https://github.com/Lightning-AI/pytorch-lightning/issues/9406",
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
