from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = {}
for line in (here / "serialized_restore" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

setup(
    name="serialized_restore",
    version=version["__version__"],
    description="Resume PyTorch Lightning jobs from large checkpoints without running the host out of memory.",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["serialized_restore", "serialized_restore.*"]),
    python_requires=">=3.9",
    # Supported: Lightning 2.6.x (both the `pytorch-lightning` and the unified `lightning` distribution).
    install_requires=[
        "torch>=2.1",
        "pytorch-lightning>=2.6.0,<2.7",
        "psutil>=5.9",
    ],
    extras_require={
        "lightning": ["lightning>=2.6.0,<2.7"],
        "test": ["lightning>=2.6.0,<2.7", "pytest", "pytest-xdist", "pytest-timeout"],
        "benchmark": ["lightning>=2.6.0,<2.7", "matplotlib"],
    },
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Pytest",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
