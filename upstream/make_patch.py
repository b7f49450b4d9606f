"""Generate the upstream pull request for Lightning from this package's own modules.

Writes two patches, both against the layout of the Lightning repository:

* ``serialized-checkpoint-loading.patch``: the change itself. The modules of ``serialized_restore`` that the connector
  needs are copied into ``src/lightning/pytorch/trainer/connectors/serialized_restore/`` with their package-internal
  imports rewritten (and ``psutil``, which Lightning does not require, imported where ``"auto"`` uses it); a few
  lines wire ``serialized_checkpoint_loading`` into ``Trainer``; the CHANGELOG gets one line; the upstream-style
  tests are added. It applies to the ``src/`` tree of the ``lightning`` source distribution and to a checkout.
* ``serialized-checkpoint-loading-docs.patch``: the docs paragraph, for a checkout (the source distribution ships no
  ``docs/``).

The base files come from the ``lightning`` sdist of the version pinned in ``requirements/ci.txt``, downloaded with
``pip download --no-binary :all: --no-deps`` unless ``--sdist`` names one. The output is deterministic: no dates, no
local paths, files in sorted order.

Usage::

    python upstream/make_patch.py             # (re)write both patches
    python upstream/make_patch.py --check     # exit 1 if they are not what the package produces now
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGE = REPO / "serialized_restore"
TREE = HERE / "tree"
"""Hand-written upstream files, at their paths in the Lightning repository."""

PATCH = HERE / "serialized-checkpoint-loading.patch"
DOCS_PATCH = HERE / "serialized-checkpoint-loading-docs.patch"

UPSTREAM_MODULE = "lightning.pytorch.trainer.connectors.serialized_restore"
UPSTREAM_DIR = "src/lightning/pytorch/trainer/connectors/serialized_restore"
TRAINER = "src/lightning/pytorch/trainer/trainer.py"
CHANGELOG = "src/lightning/pytorch/CHANGELOG.md"
ROOT_MODULE = "_connector"
"""The package module the upstream connector is built from; every module it imports, directly or not, is copied."""
LINE_LENGTH = 120

LICENSE_HEADER = """\
# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""

OPTIONAL_IMPORTS = {"psutil": 'Lightning does not require psutil: only "auto" without a memory override reads it'}
"""Third-party modules the package imports at the top that Lightning does not depend on: imported where used."""

# (anchor, replacement) pairs applied to upstream files; every anchor must occur exactly once
TRAINER_EDITS = [
    (
        "from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector\n",
        "",
    ),
    (
        "from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector\n",
        "from lightning.pytorch.trainer.connectors.serialized_restore import"
        " RestoreOptions, _SerializedCheckpointConnector\n"
        "from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector\n",
    ),
    (
        "        model_registry: Optional[str] = None,\n    ) -> None:\n",
        "        model_registry: Optional[str] = None,\n"
        "        serialized_checkpoint_loading: Union[bool, int, str] = False,\n"
        "    ) -> None:\n",
    ),
    (
        "            model_registry: The name of the model being uploaded to Model hub.\n\n",
        "            model_registry: The name of the model being uploaded to Model hub.\n\n"
        "            serialized_checkpoint_loading: Whether the processes of each node restore a checkpoint in turns,\n"
        "                to bound the host memory a restore needs. ``False`` restores as before. ``True``: the local\n"
        "                ranks of each node restore one at a time, nodes in parallel, each freeing what it no longer\n"
        "                needs as soon as it is restored. A positive int ``k``: at most ``k`` local ranks of a node\n"
        '                restore at once. ``"auto"``: ``k`` is chosen per node from the memory available. Applies to\n'
        "                single-device and DDP strategies; others warn and restore as before.\n"
        "                Default: ``False``.\n\n",
    ),
    (
        "        self._checkpoint_connector = _CheckpointConnector(self)\n",
        "        self._checkpoint_connector = _SerializedCheckpointConnector(\n"
        "            self, RestoreOptions.parse(serialized_checkpoint_loading)\n"
        "        )\n",
    ),
    (
        "        self._checkpoint_connector._user_managed = bool(ckpt_path)\n\n",
        "        self._checkpoint_connector._user_managed = bool(ckpt_path)\n\n"
        "    @property\n"
        "    def serialized_checkpoint_loading(self) -> Union[bool, int, str]:\n"
        '        """The ``serialized_checkpoint_loading`` value the Trainer was built with."""\n'
        "        return self._checkpoint_connector._options.value  # type: ignore[return-value]\n\n",
    ),
]

CALL = "src/lightning/pytorch/trainer/call.py"
# the package's Trainer._run does this before Lightning's handler runs the on_exception hooks; upstream, the handler
# itself does it
CALL_EDITS = [
    (
        "    trainer.state.status = TrainerStatus.INTERRUPTED\n"
        '    _call_callback_hooks(trainer, "on_exception", exception)\n',
        "    trainer.state.status = TrainerStatus.INTERRUPTED\n"
        "    if trainer._checkpoint_connector.restore_incomplete:\n"
        "        # a serialized restore failed half-way: no checkpoint callback may save the partly restored model\n"
        "        from lightning.pytorch.trainer.connectors.serialized_restore import disable_checkpoint_callbacks\n\n"
        "        disable_checkpoint_callbacks(trainer)\n"
        '    _call_callback_hooks(trainer, "on_exception", exception)\n',
    ),
]

CHANGELOG_ENTRY = (
    "- Added `Trainer(serialized_checkpoint_loading=...)` to restore checkpoints in per-node turns, bounding the host"
    " memory of resuming with DDP ([#9406](https://github.com/Lightning-AI/pytorch-lightning/issues/9406))\n"
)

DOCS_FILE = "docs/source-pytorch/common/checkpointing_basic.rst"
# where the tip goes: after the example of the "Resume training state" section, before its warning (upstream text)
DOCS_CONTEXT_BEFORE = (
    "   # automatically restores model, epoch, step, LR schedulers, etc...\n",
    '   trainer.fit(model, ckpt_path="path/to/your/checkpoint.ckpt")\n',
    "\n",
)
DOCS_CONTEXT_AFTER = (
    ".. warning::\n",
    "\n",
    "   The argument `resume_from_checkpoint` has been deprecated in versions of PyTorch Lightning >= 1.0.0.\n",
)
DOCS_LINE = 254
"""Line of the first context line in the file on the master branch at the time of writing (git finds it anyway)."""
DOCS_TIP = """\
.. tip::

   With several processes per machine (for example ``strategy="ddp"``), each process loads the whole checkpoint into
   host memory when it resumes, so a machine briefly holds one copy of the checkpoint per process. If resuming runs
   out of host memory, let the processes of each machine restore in turns:

   .. code-block:: python

      # the processes of each machine restore one at a time, machines in parallel
      trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp", serialized_checkpoint_loading=True)
      trainer.fit(model, ckpt_path="path/to/your/checkpoint.ckpt")

   Each process frees the checkpoint's weights as soon as they are in the model, and reads a local checkpoint
   memory-mapped where it can, so the processes of a machine share its pages. Pass an integer ``k`` to let at most
   ``k`` processes of a machine restore at once, or ``"auto"`` to choose ``k`` from the memory available. It applies
   to single-device and DDP strategies; other strategies warn and restore as before.

"""

PATCH_PREAMBLE = """\
Support serialized checkpoint loading (#9406): Trainer(serialized_checkpoint_loading=...)

Generated by upstream/make_patch.py from serialized_restore {version} against lightning {lightning}; do not edit.
{how}

"""
HOW_MAIN = "Apply with `git apply` (or `patch -p1`) in a Lightning checkout or an unpacked lightning sdist."
HOW_DOCS = "The docs part, for a Lightning checkout (the sdist has no docs/): `git apply` it with the main patch."


class GenerationError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------- inputs


def lightning_version() -> str:
    """The ``lightning`` version pinned in ``requirements/ci.txt``."""
    for line in (REPO / "requirements" / "ci.txt").read_text().splitlines():
        match = re.fullmatch(r"lightning==(\S+)", line.split("#")[0].strip())
        if match:
            return match[1]
    raise GenerationError("requirements/ci.txt pins no `lightning==<version>`")


def package_version() -> str:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise GenerationError("serialized_restore/__init__.py defines no __version__")


def download_sdist(version: str, dest: Path) -> Path:
    """``pip download`` the ``lightning`` sdist into ``dest``; fail loudly when the index cannot be reached."""
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", f"lightning=={version}"]
    command += ["-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(dest.glob(f"lightning-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        raise GenerationError(
            f"could not download the lightning=={version} sdist (`{' '.join(command[2:])}` exited with"
            f" {result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
        )
    return found[0]


def read_sdist(sdist: Path, version: str, paths: list[str]) -> dict[str, str]:
    """The text of ``paths`` (relative to the repository root) in the sdist."""
    root = f"lightning-{version}/"
    out = {}
    with tarfile.open(sdist) as archive:
        for path in paths:
            try:
                member = archive.extractfile(root + path)
            except KeyError:
                member = None
            if member is None:
                raise GenerationError(f"{sdist.name} has no file {root + path}")
            out[path] = member.read().decode("utf-8")
    return out


# ------------------------------------------------------------------------------------- module rewriting


def package_modules() -> list[str]:
    """The package's modules the connector needs: ``_connector`` and what it imports from the package, recursively."""
    seen: list[str] = []
    todo = [ROOT_MODULE]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = PACKAGE / f"{name}.py"
        if not path.is_file():
            raise GenerationError(f"serialized_restore/{name}.py is imported but does not exist")
        seen.append(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "serialized_restore":
                parts = node.module.split(".")
                if len(parts) != 2 or not parts[1].startswith("_"):
                    raise GenerationError(
                        f"serialized_restore/{name}.py imports from {node.module!r}: only imports from private modules"
                        " (`serialized_restore._x`) can be mapped into Lightning"
                    )
                todo.append(parts[1])
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "serialized_restore" for a in node.names):
                raise GenerationError(f"serialized_restore/{name}.py: use `from serialized_restore._x import ...`")
    return sorted(seen)


def upstream_name(module: str) -> str:
    """``_turns`` -> ``turns``: private inside the package already, as Lightning's ``logger_connector`` modules."""
    return module[1:]


def _format_import(indent: str, module: str, names: list[str]) -> str:
    line = f"{indent}from {module} import {', '.join(names)}\n"
    if len(line) - 1 <= LINE_LENGTH:
        return line
    body = "".join(f"{indent}    {name},\n" for name in names)
    return f"{indent}from {module} import (\n{body}{indent})\n"


def _alias(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def _map_module(module: str) -> str:
    return f"{UPSTREAM_MODULE}.{upstream_name(module.split('.')[1])}"


def rewrite_module(name: str, source: str, modules: list[str]) -> str:
    """The upstream copy of one module: imports and references mapped, optional imports made lazy; logic untouched."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    replace: dict[int, tuple[int, str]] = {}  # first line (0-based) -> (lines replaced, new text)
    insert: dict[int, str] = {}  # line (0-based) -> text inserted before it

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serialized_restore."):
            indent = re.match(r"\s*", lines[node.lineno - 1])[0]  # type: ignore[index]
            text = _format_import(indent, _map_module(node.module), [_alias(a) for a in node.names])
            replace[node.lineno - 1] = (node.end_lineno - node.lineno + 1, text)  # type: ignore[operator]

    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name in OPTIONAL_IMPORTS for a in node.names):
            if len(node.names) != 1 or node.names[0].asname:
                raise GenerationError(f"{name}.py: import {node.names[0].name} on a line of its own, without `as`")
            first = node.lineno - 1
            count = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            # an import section of its own: take one of the blank lines around it too, as isort would leave it
            blank_before = first > 0 and not lines[first - 1].strip()
            if blank_before and first + count < len(lines) and not lines[first + count].strip():
                count += 1
            replace[first] = (count, "")
            module = node.names[0].name
            attribute_values = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == module]
            if any(id(n) not in attribute_values for n in names):
                raise GenerationError(f"{name}.py: {module} is used other than as `{module}.<attribute>`")
            for line in _statements_using(tree, module):
                indent = re.match(r"\s*", lines[line])[0]  # type: ignore[index]
                # the blank line after it is what ruff's formatter wants after an import
                insert[line] = f"{indent}import {module}  # {OPTIONAL_IMPORTS[module]}\n\n"

    out: list[str] = []
    i = 0
    while i < len(lines):
        if i in insert:
            out.append(insert[i])
        if i in replace:
            count, text = replace[i]
            out.append(text)
            i += count
            continue
        out.append(lines[i])
        i += 1
    text = "".join(out)

    # references in docstrings and comments
    text = re.sub(r"~serialized_restore\.(_[a-z]\w*)\.", lambda m: f"~.{upstream_name(m[1])}.", text)
    text = re.sub(r"~serialized_restore\.([A-Z]\w*)", r"~.\1", text)
    for module in modules:
        text = text.replace(f"``{module}.py``", f"``{upstream_name(module)}.py``")
    leftover = re.search(r"(?<![\w./{}-])serialized_restore\.\w+|serialized_restore/_\w+\.py", text)
    if leftover:
        raise GenerationError(f"{name}.py: no upstream name for the reference {leftover[0]!r}; extend make_patch.py")
    unchanged = set(source.splitlines())
    for number, row in enumerate(text.splitlines(), 1):
        if len(row) > LINE_LENGTH and row not in unchanged:
            raise GenerationError(f"{name}.py: line {number} of the upstream copy is longer than {LINE_LENGTH}")
    _check_same_logic(name, source, text)
    return LICENSE_HEADER + text


def _statements_using(tree: ast.Module, module: str) -> list[int]:
    """0-based first lines of the innermost statements that use ``module.<attr>``, each block's first use only."""
    found: dict[int, int] = {}

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            fields = [getattr(stmt, f, None) for f in ("body", "orelse", "finalbody")]
            nested = [f for f in fields if isinstance(f, list)]
            nested += [h.body for h in getattr(stmt, "handlers", [])]
            uses_here = any(
                isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == module
                for n in ast.walk(stmt)
            )
            if not uses_here:
                continue
            if nested and not _uses_outside_blocks(stmt, module):
                for block in nested:
                    visit(block)
            else:
                found.setdefault(id(body), stmt.lineno - 1)

    visit(tree.body)
    return sorted(found.values())


def _uses_outside_blocks(stmt: ast.stmt, module: str) -> bool:
    blocks = {id(s) for f in ("body", "orelse", "finalbody") for s in getattr(stmt, f, []) or []}
    blocks |= {id(s) for h in getattr(stmt, "handlers", []) for s in h.body}
    for child in ast.iter_child_nodes(stmt):
        if id(child) in blocks:
            continue
        for n in ast.walk(child):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == module:
                return True
    return False


class _Normalize(ast.NodeTransformer):
    """Maps package imports to their upstream names, drops docstrings and the optional imports, wherever they are."""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.module and node.module.startswith("serialized_restore."):
            node.module = _map_module(node.module)
        return node

    def visit_Import(self, node: ast.Import) -> Optional[ast.AST]:
        return None if all(a.name in OPTIONAL_IMPORTS for a in node.names) else node

    def visit_Expr(self, node: ast.Expr) -> Optional[ast.AST]:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        return node


def _check_same_logic(name: str, original: str, rewritten: str) -> None:
    """The upstream copy must differ from the package's module only in imports and docstrings."""
    before = ast.dump(_Normalize().visit(ast.parse(original)))
    after = ast.dump(_Normalize().visit(ast.parse(rewritten)))
    if before != after:
        raise GenerationError(f"{name}.py: the upstream copy's code differs from the package's; check the rewrite")


# ----------------------------------------------------------------------------------------------- edits


def apply_edits(path: str, text: str, edits: list[tuple[str, str]]) -> str:
    for anchor, replacement in edits:
        count = text.count(anchor)
        if count != 1:
            raise GenerationError(f"{path}: expected the anchor once, found it {count} times:\n{anchor}")
        text = text.replace(anchor, replacement)
    return text


def edit_changelog(text: str) -> str:
    """Fill the ``### Added`` placeholder of the unreleased section (Lightning's CHANGELOG keeps a ``-`` there)."""
    match = re.search(r"^## \[unreleased\][^\n]*\n(.*?)^---$", text, flags=re.MULTILINE | re.DOTALL | re.IGNORECASE)
    if not match:
        raise GenerationError(f"{CHANGELOG}: no `## [unreleased]` section")
    section = match[1]
    added = re.search(r"^### Added\n\n", section, flags=re.MULTILINE)
    if not added:
        raise GenerationError(f"{CHANGELOG}: the unreleased section has no `### Added`")
    at = match.start(1) + added.end()
    if text.startswith("-\n", at):
        return text[:at] + CHANGELOG_ENTRY + text[at + 2 :]
    return text[:at] + CHANGELOG_ENTRY + "\n" + text[at:]


# ------------------------------------------------------------------------------------------------ diffs


def unified_diff(path: str, old: Optional[str], new: str) -> str:
    """A ``git diff``-style diff of one file (``old`` is ``None`` for a new file), 3 lines of context."""
    a = [] if old is None else old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    for lines, what in ((a, "base"), (b, "new")):
        if lines and not lines[-1].endswith("\n"):
            raise GenerationError(f"{path}: the {what} text does not end with a newline")
    out = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        out += ["new file mode 100644\n", "--- /dev/null\n", f"+++ b/{path}\n"]
    else:
        out += [f"--- a/{path}\n", f"+++ b/{path}\n"]
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2)} +{_range(j1, j2)} @@\n")
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                out += [" " + line for line in a[x1:x2]]
                continue
            out += ["-" + line for line in a[x1:x2]]
            out += ["+" + line for line in b[y1:y2]]
    return "".join(out)


def _range(start: int, stop: int) -> str:
    length = stop - start
    first = start + 1 if length else start
    return f"{first}" if length == 1 else f"{first},{length}"


def docs_diff() -> str:
    before, after = DOCS_CONTEXT_BEFORE, DOCS_CONTEXT_AFTER
    added = DOCS_TIP.splitlines(keepends=True)
    old_len = len(before) + len(after)
    header = f"@@ -{DOCS_LINE},{old_len} +{DOCS_LINE},{old_len + len(added)} @@\n"
    body = [" " + line for line in before] + ["+" + line for line in added] + [" " + line for line in after]
    head = f"diff --git a/{DOCS_FILE} b/{DOCS_FILE}\n--- a/{DOCS_FILE}\n+++ b/{DOCS_FILE}\n"
    return head + header + "".join(body)


# ---------------------------------------------------------------------------------------------- assembly


def hand_written_files() -> dict[str, str]:
    """``upstream/tree/src`` and ``upstream/tree/tests``, at their paths in the Lightning repository."""
    out = {}
    for top in ("src", "tests"):
        for path in sorted((TREE / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                out[path.relative_to(TREE).as_posix()] = path.read_text(encoding="utf-8")
    return out


def build(sdist: Path, version: str) -> tuple[str, str]:
    """The text of both patches."""
    base = read_sdist(sdist, version, [TRAINER, CALL, CHANGELOG])
    new: dict[str, str] = {}
    modules = package_modules()
    for module in modules:
        source = (PACKAGE / f"{module}.py").read_text(encoding="utf-8")
        new[f"{UPSTREAM_DIR}/{upstream_name(module)}.py"] = rewrite_module(module, source, modules)
    for path, text in hand_written_files().items():
        if path in new:
            raise GenerationError(f"upstream/tree/{path} would replace a module generated from the package")
        new[path] = text
    new[TRAINER] = apply_edits(TRAINER, base[TRAINER], TRAINER_EDITS)
    new[CALL] = apply_edits(CALL, base[CALL], CALL_EDITS)
    new[CHANGELOG] = edit_changelog(base[CHANGELOG])
    for path in new:
        if path.startswith("docs/"):
            raise GenerationError(f"{path}: docs go into the docs patch (the sdist has no docs/)")

    patch = PATCH_PREAMBLE.format(version=package_version(), lightning=version, how=HOW_MAIN)
    for path in sorted(new):
        patch += unified_diff(path, base.get(path), new[path])
    docs = PATCH_PREAMBLE.format(version=package_version(), lightning=version, how=HOW_DOCS) + docs_diff()
    return patch, docs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="a lightning-<version>.tar.gz to use instead of downloading one")
    parser.add_argument("--check", action="store_true", help="compare with the committed patches, write nothing")
    parser.add_argument("--output-dir", type=Path, help="write the patches here instead of upstream/")
    args = parser.parse_args(argv)

    version = lightning_version()
    try:
        with tempfile.TemporaryDirectory(prefix="make-patch-") as tmp:
            sdist = args.sdist if args.sdist is not None else download_sdist(version, Path(tmp))
            patch, docs = build(sdist, version)
    except GenerationError as err:
        print(f"make_patch.py: {err}", file=sys.stderr)
        return 2

    if args.check:
        stale = [p.name for p, text in ((PATCH, patch), (DOCS_PATCH, docs)) if _read(p) != text]
        if stale:
            print(
                f"make_patch.py: {', '.join(stale)} is not what the package produces now: run"
                " `python upstream/make_patch.py` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"make_patch.py: {PATCH.name} and {DOCS_PATCH.name} are up to date (lightning {version}).")
        return 0
    out = args.output_dir or HERE
    out.mkdir(parents=True, exist_ok=True)
    for target, text in ((out / PATCH.name, patch), (out / DOCS_PATCH.name, docs)):
        target.write_bytes(text.encode("utf-8"))
        print(f"wrote {target.name}: {text.count(chr(10))} lines")
    return 0


def _read(path: Path) -> Optional[str]:
    return path.read_bytes().decode("utf-8") if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
