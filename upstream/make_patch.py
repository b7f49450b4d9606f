"""Generate the upstream pull request for Lightning from this package's own modules.

Writes two patches, both against the layout of the Lightning repository:

* ``serialized-checkpoint-loading.patch``: the change itself. The modules of ``serialized_restore`` that the connector
  needs are copied into ``src/lightning/pytorch/trainer/connectors/serialized_restore/`` with their package-internal
  imports rewritten, the package's lookups of Lightning classes (``_flavour.py``, which serves its two distributions)
  replaced by direct imports (and a module importing at its top what Lightning does not require is refused); a few
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
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGE = REPO / "serialized_restore"
TREE = HERE / "tree"
"""Hand-written upstream files, at their paths in the Lightning repository."""

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

FLAVOUR_MODULE = "_flavour"
"""The package module that looks Lightning classes up in the distribution (``lightning`` or ``pytorch_lightning``) of
the object at hand. Inside Lightning there is one distribution: the copies import the classes directly instead."""
FLAVOUR_ROOTS = {False: "lightning.pytorch", True: "lightning.fabric"}
"""``Flavour.import_(module, name, fabric=...)`` -> the package it imports from, inside Lightning."""

LIGHTNING_DEPENDENCIES = ("torch", "lightning_utilities", "fsspec", "typing_extensions", "packaging")
"""Third-party modules a copied module may import at its top: what Lightning itself requires. Anything else (psutil)
the package imports where it is used, guarded by ``RequirementCache``, as Lightning guards optional packages."""

# the argument's docstring in Trainer.__init__, as of each step: (sentence, the step that adds it, the step that
# replaces it or None)
TRAINER_DOC = (
    (
        "Whether the processes of each node restore a checkpoint in turns, to bound the host memory a restore needs.",
        "core",
        None,
    ),
    (
        "``False`` restores as before. ``True``: the local ranks of each node restore one at a time, nodes in"
        " parallel, each freeing what it no longer needs as soon as it is restored. A positive int ``k``: at most"
        " ``k`` local ranks of a node restore at once.",
        "core",
        None,
    ),
    ('``"auto"``: ``k`` is chosen per node from the memory available.', "auto", None),
    ("A ``SerializedLoading(...)`` sets every setting (the timeouts).", "core", "mmap"),
    ("A ``SerializedLoading(...)`` sets every setting (the reader, the timeouts).", "mmap", "auto"),
    (
        'A ``SerializedLoading(...)`` sets every setting (the reader, the timeouts, the memory ``"auto"`` assumes).',
        "auto",
        "remote",
    ),
    (
        'A ``SerializedLoading(...)`` sets every setting (the reader, the timeouts, the memory ``"auto"`` assumes, the'
        " directory of a remote checkpoint's local copy).",
        "remote",
        None,
    ),
    ("Applies to single-device and DDP strategies; others warn and restore as before.", "core", "fsdp"),
    ("Applies to single-device, DDP and FSDP strategies; others warn and restore as before.", "fsdp", None),
    ("Default: ``False``.", "core", None),
)


def _present(step: int, added: str, replaced: Optional[str]) -> bool:
    return STEP_NAMES.index(added) <= step and (replaced is None or step < STEP_NAMES.index(replaced))


def trainer_edits(step: int) -> list[tuple[str, str]]:
    """(anchor, replacement) pairs applied to ``trainer.py`` as of ``step``; every anchor must occur exactly once."""
    doc = " ".join(text for text, added, replaced in TRAINER_DOC if _present(step, added, replaced))
    doc = textwrap.fill(
        "serialized_checkpoint_loading: " + doc,
        width=LINE_LENGTH,
        initial_indent=" " * 12,
        subsequent_indent=" " * 16,
        break_on_hyphens=False,
    )
    kind = (
        "Union[bool, int, str, SerializedLoading]"
        if step >= STEP_NAMES.index("auto")
        else "Union[bool, int, SerializedLoading]"
    )
    return [
        (
            "from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector\n",
            "",
        ),
        (
            "from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector\n",
            "from lightning.pytorch.trainer.connectors.serialized_restore import (\n"
            "    RestoreOptions,\n"
            "    SerializedLoading,\n"
            "    _SerializedCheckpointConnector,\n"
            ")\n"
            "from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector\n",
        ),
        (
            "        model_registry: Optional[str] = None,\n    ) -> None:\n",
            "        model_registry: Optional[str] = None,\n"
            f"        serialized_checkpoint_loading: {kind} = False,\n"
            "    ) -> None:\n",
        ),
        (
            "            model_registry: The name of the model being uploaded to Model hub.\n\n",
            "            model_registry: The name of the model being uploaded to Model hub.\n\n" + doc + "\n\n",
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
            f"    def serialized_checkpoint_loading(self) -> {kind}:\n"
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
{title}

Serialized checkpoint loading (#9406), {place}.
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


# ------------------------------------------------------------------------------------------------ series


@dataclass(frozen=True)
class Step:
    """One pull request of the series: what it adds on top of the previous ones."""

    name: str
    """The name its ``# series: <name>`` blocks carry in the package and in ``upstream/tree``."""
    title: str
    changelog: str
    """Its line in Lightning's CHANGELOG (``### Added``)."""


STEPS = (
    Step(
        "core",
        "Add `Trainer(serialized_checkpoint_loading=...)`: restore checkpoints in per-node turns",
        "Added `Trainer(serialized_checkpoint_loading=...)` to restore checkpoints in per-node turns, bounding the"
        " host memory of resuming with DDP ([#9406](https://github.com/Lightning-AI/pytorch-lightning/issues/9406))",
    ),
    Step(
        "mmap",
        "Serialized checkpoint loading: read local checkpoints memory-mapped",
        "Added memory-mapped reading of local checkpoints to `serialized_checkpoint_loading`: the processes of a"
        " machine share the file's pages, and each copies only the optimizer state it keeps",
    ),
    Step(
        "auto",
        'Serialized checkpoint loading: `"auto"` chooses how many processes restore at once',
        'Added `serialized_checkpoint_loading="auto"`: the processes of each machine that restore at once are chosen'
        " from the memory available",
    ),
    Step(
        "remote",
        "Serialized checkpoint loading: one download per machine for remote checkpoints",
        "Added remote checkpoints to `serialized_checkpoint_loading`: one download per machine into a private"
        " directory, removed once the restore ends",
    ),
    Step(
        "fsdp",
        "Serialized checkpoint loading: full checkpoints under `FSDPStrategy`",
        "Added `FSDPStrategy` to `serialized_checkpoint_loading`: a full checkpoint is memory-mapped and each process"
        " copies only its shard",
    ),
)
STEP_NAMES = tuple(step.name for step in STEPS)
SERIES_DIR = HERE / "series"

_MARKER = re.compile(r"^(?P<indent>[ \t]*)# series: (?P<what>before (?P<before>\w+)|end|(?P<name>\w+))[ \t]*$")
_GAP = object()
"""Where ``cut`` removed lines: the blank lines around it are set right afterwards."""


def cut(text: str, step: int, where: str) -> str:
    """``text`` as of the series' step ``step`` (an index into ``STEPS``).

    A block ``# series: <name>`` ... ``# series: end`` is code that step ``<name>`` adds: kept from that step on,
    removed before it. It may hold a ``# series: before <name>`` part, the code it replaces, written commented out
    (``# `` after the ``before`` marker's indentation, which may be deeper than the block's where the formatter puts
    comments: the code is indented from the block's first marker): uncommented before the step, removed from it on.
    Blocks nest (a later step's block inside an earlier one's), not inside a ``before`` part. The marker lines never
    reach the copy. Top-level imports left unused by a cut are dropped, and the blank lines where lines were removed
    are made what Lightning's formatter wants."""
    out: list[object] = []
    stack: list[tuple[str, bool, str, str]] = []  # (step name, in its "before" part, indentations: block, part)
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = _MARKER.match(line.rstrip("\n"))
        if marker is None:
            present = all((STEP_NAMES.index(name) <= step) != before for name, before, _, _ in stack)
            if not stack or not stack[-1][1]:
                out.append(line if present else _GAP)
                continue
            _, _, indent, part = stack[-1]
            if not present:
                out.append(_GAP)
            elif line.strip() == "#":
                out.append("\n")
            elif line.startswith(part + "# "):
                out.append(indent + line[len(part) + 2 :])
            else:
                raise GenerationError(f"{where}: line {number}: a `# series: before` line must be commented out")
            continue
        named = marker["name"] or marker["before"]
        if named is not None and named not in STEP_NAMES:
            raise GenerationError(f"{where}: line {number}: no step {named!r} in the series ({', '.join(STEP_NAMES)})")
        if marker["name"] is not None:
            if named == STEP_NAMES[0] or (stack and stack[-1][1]):
                raise GenerationError(
                    f"{where}: line {number}: a series block for the first step or in a `before` part"
                )
            if stack and STEP_NAMES.index(named) < STEP_NAMES.index(stack[-1][0]):
                raise GenerationError(f"{where}: line {number}: a block of `{named}` inside one of a later step")
            stack.append((named, False, marker["indent"], marker["indent"]))
        elif marker["before"] is not None:
            if not stack or stack[-1][0] != named or stack[-1][1]:
                raise GenerationError(f"{where}: line {number}: `# series: before {named}` outside its block")
            stack[-1] = (named, True, stack[-1][2], marker["indent"])
        else:
            if not stack:
                raise GenerationError(f"{where}: line {number}: `# series: end` closes no block")
            stack.pop()
        out.append(_GAP)
    if stack:
        raise GenerationError(f"{where}: the series block `{stack[-1][0]}` is not closed")
    lines = _prune_imports(_set_gaps(out), where)
    return "".join(lines)


def _set_gaps(lines: list[object]) -> list[str]:
    """Drop the gaps ``cut`` left, with the blank lines around each as Lightning's formatter wants them: none at the
    start of a block or of the file, at most two before a top-level line, at most one inside an indented block."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i] is not _GAP and not (lines[i] == "\n" and _gap_ahead(lines, i)):
            out.append(lines[i])  # type: ignore[arg-type]
            i += 1
            continue
        # a run of blank lines and gaps holding at least one gap: as many blank lines as the widest stretch of blank
        # lines between its gaps (the removed code's neighbours were that far apart from it)
        j = i
        blanks = stretch = 0
        while out and out[-1] == "\n":  # blank lines before the run count with it
            out.pop()
            stretch += 1
        while j < len(lines) and (lines[j] is _GAP or lines[j] == "\n"):
            stretch = stretch + 1 if lines[j] == "\n" else 0
            blanks = max(blanks, stretch)
            j += 1
        following = next((row for row in lines[j:] if row is not _GAP and row != "\n"), None)
        previous = out[-1] if out else None
        if previous is None or following is None:
            keep = 0
        elif previous.rstrip().endswith(":") and not previous.lstrip().startswith("#"):
            keep = 0  # the start of a block
        else:
            top = not str(following)[:1].isspace()
            keep = min(blanks, 2 if top else 1)
        out += ["\n"] * keep
        i = j
    return out


def _gap_ahead(lines: list[object], i: int) -> bool:
    """Whether the run of blank lines at ``i`` ends in a gap."""
    while i < len(lines) and lines[i] == "\n":
        i += 1
    return i < len(lines) and lines[i] is _GAP


def _prune_imports(lines: list[str], where: str) -> list[str]:
    """Drop the names of top-level imports that nothing in the module uses any more (a cut removed their users)."""
    text = "".join(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        raise GenerationError(f"{where}: the cut leaves invalid Python: {err}") from None
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            used |= {elt.value for elt in getattr(node.value, "elts", []) if isinstance(elt, ast.Constant)}
    replace: dict[int, tuple[int, list[str]]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.ImportFrom) and node.module == "__future__"
        ):
            continue
        bound = [(alias, (alias.asname or alias.name).split(".")[0]) for alias in node.names]
        kept = [alias for alias, name in bound if name in used]
        if len(kept) == len(bound):
            continue
        if not kept:
            new: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            new = [_format_import("", "." * node.level + (node.module or ""), [_alias(a) for a in kept])]
        else:
            new = [f"import {', '.join(_alias(a) for a in kept)}\n"]
        replace[node.lineno - 1] = (node.end_lineno - node.lineno + 1, new)  # type: ignore[operator]
    if not replace:
        return lines
    rows = text.splitlines(keepends=True)
    out: list[object] = []
    i = 0
    while i < len(rows):
        if i in replace:
            count, new = replace[i]
            out += new or [_GAP]
            i += count
            continue
        out.append(rows[i])
        i += 1
    return _set_gaps(out)


# ------------------------------------------------------------------------------------- module rewriting


def package_modules(step: int) -> list[str]:
    """The package's modules the connector needs as of ``step``: ``_connector`` and what it imports from the package,
    recursively, in the modules as ``cut`` leaves them."""
    seen: list[str] = []
    todo = [ROOT_MODULE]
    while todo:
        name = todo.pop()
        if name in seen or name == FLAVOUR_MODULE:
            continue
        path = PACKAGE / f"{name}.py"
        if not path.is_file():
            raise GenerationError(f"serialized_restore/{name}.py is imported but does not exist")
        seen.append(name)
        for node in ast.walk(ast.parse(cut(path.read_text(), step, f"serialized_restore/{name}.py"))):
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
    """The upstream copy of one module: imports and references mapped, lookups made imports; logic untouched."""
    source = _direct_imports(name, source)
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    replace: dict[int, tuple[int, str]] = {}  # first line (0-based) -> (lines replaced, new text)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serialized_restore."):
            indent = re.match(r"\s*", lines[node.lineno - 1])[0]  # type: ignore[index]
            text = _format_import(indent, _map_module(node.module), [_alias(a) for a in node.names])
            replace[node.lineno - 1] = (node.end_lineno - node.lineno + 1, text)  # type: ignore[operator]

    for node in tree.body:
        top = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = [node.module]
        for module in top:
            root = module.split(".")[0]
            if root not in sys.stdlib_module_names and root not in LIGHTNING_DEPENDENCIES + ("serialized_restore",):
                raise GenerationError(
                    f"{name}.py imports {module} at its top, which Lightning does not require: import it where it is"
                    " used, guarded by `RequirementCache`"
                )

    out: list[str] = []
    i = 0
    while i < len(lines):
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


def _flavour_lookup(node: ast.AST, flavour_names: set[str]) -> Optional[tuple[str, str]]:
    """``(module, name)`` for ``flavour_of(x).import_("mod", "Name"[, fabric=True])`` or ``flavour.import_(...)``
    (``flavour`` one of ``flavour_names``): the Lightning module and name it looks up; else ``None``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_"):
        return None
    if not _is_flavour(node.func.value, flavour_names):
        return None
    args = node.args
    fabric = [k for k in node.keywords if k.arg == "fabric"]
    literal = all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args) and len(args) == 2
    if not literal or len(node.keywords) != len(fabric) or (fabric and not isinstance(fabric[0].value, ast.Constant)):
        raise GenerationError(
            f'line {node.lineno}: a flavour lookup must read `import_("module", "Name"[, fabric=True])` with'
            " literal arguments, so that the copy can import the class directly"
        )
    root = FLAVOUR_ROOTS[bool(fabric[0].value.value) if fabric else False]  # type: ignore[attr-defined]
    return f"{root}.{args[0].value}", str(args[1].value)  # type: ignore[attr-defined]


def _is_flavour(node: ast.AST, flavour_names: set[str]) -> bool:
    """``flavour_of(...)``, or a name bound to it."""
    if isinstance(node, ast.Name):
        return node.id in flavour_names
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "flavour_of"


def _direct_imports(name: str, source: str) -> str:
    """``source`` with every flavour lookup replaced by the class it looks up, imported at the top of the function
    that uses it (``from lightning.pytorch.<module> import <Name>``); ``flavour_of(x).pytorch`` / ``.fabric`` by the
    package's name; the assignments ``flavour = flavour_of(x)`` and the import of ``flavour_of`` dropped."""
    tree = ast.parse(source)
    flavour_names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_flavour(node.value, set())
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    spans: list[tuple[tuple[int, int], tuple[int, int], str]] = []  # ((line, col) start, end, text), 1-based lines
    imports: dict[int, dict[str, set[str]]] = {}  # line (1-based) of a function's first statement -> module -> names
    drop_lines: set[int] = set()

    def visit(node: ast.AST, body_start: Optional[int]) -> None:
        # body_start: where the function's new imports go (> 0: before that line; < 0: after line -body_start)
        for child in ast.iter_child_nodes(node):
            start = body_start
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = _import_position(name, child)
            try:
                lookup = _flavour_lookup(child, flavour_names) if isinstance(child, ast.Call) else None
            except GenerationError as err:
                raise GenerationError(f"{name}.py: {err}") from None
            if lookup is not None:
                if start is None:
                    raise GenerationError(f"{name}.py: line {child.lineno}: a flavour lookup outside a function")
                module, imported = lookup
                imports.setdefault(start, {}).setdefault(module, set()).add(imported)
                spans.append(((child.lineno, child.col_offset), (child.end_lineno, child.end_col_offset), imported))  # type: ignore[arg-type]
                continue
            if isinstance(child, ast.JoinedStr) and any(_flavour_root(v, flavour_names) for v in child.values):
                # f"{flavour.pytorch}.x" -> "lightning.pytorch.x"
                text = _joined_text(child, flavour_names)
                spans.append(((child.lineno, child.col_offset), (child.end_lineno, child.end_col_offset), text))  # type: ignore[arg-type]
                continue
            if isinstance(child, ast.Attribute) and child.attr in ("pytorch", "fabric"):
                if _is_flavour(child.value, flavour_names):
                    text = repr(FLAVOUR_ROOTS[child.attr == "fabric"]).replace("'", '"')
                    spans.append(((child.lineno, child.col_offset), (child.end_lineno, child.end_col_offset), text))  # type: ignore[arg-type]
                    continue
            if isinstance(child, ast.Assign) and _is_flavour(child.value, set()):
                if child.lineno != child.end_lineno:
                    raise GenerationError(f"{name}.py: line {child.lineno}: `flavour = flavour_of(...)` on one line")
                drop_lines.add(child.lineno)
                continue
            if isinstance(child, ast.ImportFrom) and child.module == f"serialized_restore.{FLAVOUR_MODULE}":
                drop_lines.update(range(child.lineno, child.end_lineno + 1))  # type: ignore[operator]
                source_lines = source.splitlines()
                before, after = child.lineno - 2, child.end_lineno  # 0-based neighbours
                if 0 <= before and after < len(source_lines) and not source_lines[before] and not source_lines[after]:
                    drop_lines.add(after + 1)  # an import section of its own: one blank line stays, as isort wants
                continue
            visit(child, start)

    visit(tree, None)
    lines = source.splitlines(keepends=True)
    indents = {line: re.match(r"\s*", lines[abs(line) - 1])[0] for line in imports}  # type: ignore[index]
    # replace spans from the last to the first, so that earlier positions stay valid
    for (line, col), (end_line, end_col), text in sorted(spans, reverse=True):
        if line != end_line:
            first, last = lines[line - 1], lines[end_line - 1]
            lines[line - 1] = first[:col] + text + last[end_col:]
            for i in range(line, end_line):
                lines[i] = ""
        else:
            row = lines[line - 1]
            lines[line - 1] = row[:col] + text + row[end_col:]
    for line in drop_lines:
        lines[line - 1] = ""
    for line, modules in imports.items():
        indent = indents[line]
        block = "".join(
            _format_import(indent, module, _isort_names(names)) for module, names in sorted(modules.items())
        )
        if line > 0:
            lines[line - 1] = block + "\n" + lines[line - 1]
        else:
            # after the function's own imports of other packages: Lightning's come last, as a section of their own
            lines[-line - 1] = lines[-line - 1] + "\n" + block
    text = "".join(lines)
    if re.search(r"\bflavour(_of)?\b", _code_only(text)):
        raise GenerationError(f"{name}.py: a flavour lookup the generator could not replace is left in the copy")
    return text


def _import_position(name: str, function: ast.AST) -> int:
    """Where the direct imports of ``function`` go: before its first statement after the docstring (a positive line),
    or, when it opens with imports (of other packages), after the last of them (the line, negated)."""
    body = function.body  # type: ignore[attr-defined]
    i = 1 if len(body) > 1 and _is_docstring(body[0]) else 0
    leading = []
    while i < len(body) and isinstance(body[i], (ast.Import, ast.ImportFrom)):
        leading.append(body[i])
        i += 1
    if not leading:
        return body[min(i, len(body) - 1)].lineno
    for stmt in leading:
        modules = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module or ""]
        if any(m.split(".")[0] in ("serialized_restore", "lightning") for m in modules):
            raise GenerationError(
                f"{name}.py: line {stmt.lineno}: a function that looks Lightning classes up imports from the package"
                " or Lightning itself: the generator would have to merge the imports; import at the top instead"
            )
    return -int(leading[-1].end_lineno)  # type: ignore[arg-type]


def _flavour_root(node: ast.AST, flavour_names: set[str]) -> Optional[str]:
    """``"lightning.pytorch"`` for ``{flavour.pytorch}`` in an f-string (``.fabric``: ``"lightning.fabric"``)."""
    if not isinstance(node, ast.FormattedValue) or node.conversion != -1 or node.format_spec is not None:
        return None
    value = node.value
    if (
        isinstance(value, ast.Attribute)
        and value.attr in ("pytorch", "fabric")
        and _is_flavour(value.value, flavour_names)
    ):
        return FLAVOUR_ROOTS[value.attr == "fabric"]
    return None


def _joined_text(node: ast.JoinedStr, flavour_names: set[str]) -> str:
    """The string literal an f-string of constants and flavour roots stands for."""
    parts = []
    for value in node.values:
        root = _flavour_root(value, flavour_names)
        if root is not None:
            parts.append(root)
        elif isinstance(value, ast.Constant) and isinstance(value.value, str):
            parts.append(value.value)
        else:
            raise GenerationError(f"line {node.lineno}: an f-string mixes a flavour root with other values")
    text = "".join(parts)
    if '"' in text or "\\" in text:
        raise GenerationError(f"line {node.lineno}: {text!r} cannot be written as a plain double-quoted literal")
    return f'"{text}"'


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _isort_names(names: set[str]) -> list[str]:
    """Names in the order isort (and ruff's ``I`` rules) sort them: constants, then classes, then the rest."""

    def key(name: str) -> tuple[int, str]:
        bare = name.lstrip("_")
        kind = 0 if bare.isupper() and len(bare) > 1 else 1 if bare[:1].isupper() else 2
        return kind, name

    return sorted(names, key=key)


def _code_only(text: str) -> str:
    """The source without comments and string constants (docstrings included), for leftover checks."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.unparse(tree)


class _Normalize(ast.NodeTransformer):
    """Maps package imports to their upstream names and drops docstrings, wherever they are;
    a flavour lookup becomes the name it looks up (and the direct imports of Lightning names go), so that a package
    module and its copy compare equal exactly when the copy imports what the module looked up."""

    def __init__(self) -> None:
        self.flavour_names: set[str] = set()

    def visit_Module(self, node: ast.Module) -> ast.AST:
        self.flavour_names = {
            target.id
            for stmt in ast.walk(node)
            if isinstance(stmt, ast.Assign) and _is_flavour(stmt.value, set())
            for target in stmt.targets
            if isinstance(target, ast.Name)
        }
        self.generic_visit(node)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> Optional[ast.AST]:
        if node.module == f"serialized_restore.{FLAVOUR_MODULE}":
            return None
        if node.module and node.module.startswith("serialized_restore."):
            node.module = _map_module(node.module)
        elif node.module and node.module.split(".")[0] == "lightning" and not node.module.startswith(UPSTREAM_MODULE):
            return None
        return node

    def visit_Assign(self, node: ast.Assign) -> Optional[ast.AST]:
        if _is_flavour(node.value, set()):
            return None
        self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        lookup = _flavour_lookup(node, self.flavour_names)
        if lookup is not None:
            return ast.Name(id=lookup[1], ctx=ast.Load())
        self.generic_visit(node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if node.attr in ("pytorch", "fabric") and _is_flavour(node.value, self.flavour_names):
            return ast.Constant(value=FLAVOUR_ROOTS[node.attr == "fabric"])
        self.generic_visit(node)
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        if any(_flavour_root(v, self.flavour_names) for v in node.values):
            return ast.Constant(value=_joined_text(node, self.flavour_names)[1:-1])
        self.generic_visit(node)
        return node

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


def edit_changelog(text: str, entries: list[str]) -> str:
    """Fill the ``### Added`` placeholder of the unreleased section (Lightning's CHANGELOG keeps a ``-`` there)."""
    match = re.search(r"^## \[unreleased\][^\n]*\n(.*?)^---$", text, flags=re.MULTILINE | re.DOTALL | re.IGNORECASE)
    if not match:
        raise GenerationError(f"{CHANGELOG}: no `## [unreleased]` section")
    section = match[1]
    added = re.search(r"^### Added\n\n", section, flags=re.MULTILINE)
    if not added:
        raise GenerationError(f"{CHANGELOG}: the unreleased section has no `### Added`")
    at = match.start(1) + added.end()
    lines = "".join(f"- {entry}\n" for entry in entries)
    if text.startswith("-\n", at):
        return text[:at] + lines + text[at + 2 :]
    return text[:at] + lines + "\n" + text[at:]


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


def hand_written_files(step: int) -> dict[str, str]:
    """``upstream/tree/src`` and ``upstream/tree/tests`` as of ``step``, at their paths in the Lightning repository;
    a file that is all a later step's block is not there yet."""
    out = {}
    for top in ("src", "tests"):
        for path in sorted((TREE / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                name = path.relative_to(TREE).as_posix()
                text = cut(path.read_text(encoding="utf-8"), step, f"upstream/tree/{name}")
                if text.strip():
                    out[name] = text
    return out


def tree_at(step: int, base: dict[str, str]) -> dict[str, str]:
    """Every file the series has added or changed by ``step``, with its text then."""
    new: dict[str, str] = {}
    modules = package_modules(step)
    for module in modules:
        source = cut((PACKAGE / f"{module}.py").read_text(encoding="utf-8"), step, f"serialized_restore/{module}.py")
        new[f"{UPSTREAM_DIR}/{upstream_name(module)}.py"] = rewrite_module(module, source, modules)
    for path, text in hand_written_files(step).items():
        if path in new:
            raise GenerationError(f"upstream/tree/{path} would replace a module generated from the package")
        new[path] = text
    new[TRAINER] = apply_edits(TRAINER, base[TRAINER], trainer_edits(step))
    new[CALL] = apply_edits(CALL, base[CALL], CALL_EDITS)
    new[CHANGELOG] = edit_changelog(base[CHANGELOG], [s.changelog for s in STEPS[: step + 1]])
    for path in new:
        if path.startswith("docs/"):
            raise GenerationError(f"{path}: docs go into the docs patch (the sdist has no docs/)")
    return new


def series_file(step: int, suffix: str) -> str:
    return f"{step + 1}-{STEPS[step].name}{suffix}"


def build(sdist: Path, version: str) -> dict[str, str]:
    """Every file ``make_patch.py`` writes into ``upstream/``, by its path there: the series' patches and PR texts,
    and the docs patch."""
    base = read_sdist(sdist, version, [TRAINER, CALL, CHANGELOG])
    out: dict[str, str] = {}
    before: dict[str, str] = dict(base)
    for step in range(len(STEPS)):
        after = tree_at(step, base)
        gone = sorted(set(before) - set(after) - set(base))
        if gone:
            raise GenerationError(f"step {STEPS[step].name} removes {', '.join(gone)}: a step only adds and changes")
        changed = [path for path in sorted(after) if before.get(path) != after[path]]
        if not changed:
            raise GenerationError(f"step {STEPS[step].name} changes nothing")
        patch = PATCH_PREAMBLE.format(
            title=STEPS[step].title,
            place=_place(step),
            version=package_version(),
            lightning=version,
            how=HOW_MAIN,
        )
        diffs = {path: unified_diff(path, before.get(path), after[path]) for path in changed}
        patch += "".join(diffs.values())
        out[f"series/{series_file(step, '.patch')}"] = patch
        out[f"series/{series_file(step, '.md')}"] = pr_text(step, diffs, before, after)
        before = {**before, **after}
    out[DOCS_PATCH.name] = (
        PATCH_PREAMBLE.format(
            title="Docs",
            place="the docs of the whole series",
            version=package_version(),
            lightning=version,
            how=HOW_DOCS,
        )
        + docs_diff()
    )
    return out


def _place(step: int) -> str:
    if step == 0:
        return f"pull request 1 of {len(STEPS)}"
    return f"pull request {step + 1} of {len(STEPS)}, on top of {series_file(step - 1, '.patch')}"


def pr_text(step: int, diffs: dict[str, str], before: dict[str, str], after: dict[str, str]) -> str:
    """The pull request's description: ``upstream/pr/<step>.md`` (what it does, its figures) and what is generated
    from the patch (the files it touches, the tests it adds)."""
    template = HERE / "pr" / f"{STEPS[step].name}.md"
    if not template.is_file():
        raise GenerationError(f"upstream/pr/{template.name} is missing: the description of step {STEPS[step].name}")
    rows = []
    for path, diff in diffs.items():
        added = sum(1 for row in diff.splitlines() if row.startswith("+") and not row.startswith("+++"))
        removed = sum(1 for row in diff.splitlines() if row.startswith("-") and not row.startswith("---"))
        rows.append(f"| `{path}` | {'new' if path not in before else 'changed'} | +{added} / -{removed} |")
    tests = []
    for path in diffs:
        if path.startswith("tests/"):
            old = set(_test_names(before.get(path, "")))
            tests += [f"- `{path.rsplit('/', 1)[1]}::{t}`" for t in _test_names(after[path]) if t not in old]
    header = f"# {STEPS[step].title}\n\n"
    header += f"Pull request {step + 1} of {len(STEPS)}"
    header += "." if step == 0 else f", on top of {', '.join(f'#{i + 1}' for i in range(step))}."
    header += f" Patch: `{series_file(step, '.patch')}`.\n\n"
    body = template.read_text(encoding="utf-8").strip() + "\n\n"
    files = "## Files\n\n| file | | lines |\n|---|---|---|\n" + "\n".join(rows) + "\n\n"
    added_tests = "## Tests added\n\n" + ("\n".join(tests) if tests else "none") + "\n"
    return header + body + files + added_tests


def _test_names(text: str) -> list[str]:
    return [
        node.name
        for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="a lightning-<version>.tar.gz to use instead of downloading one")
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    parser.add_argument("--output-dir", type=Path, help="write into this directory instead of upstream/")
    args = parser.parse_args(argv)

    version = lightning_version()
    try:
        with tempfile.TemporaryDirectory(prefix="make-patch-") as tmp:
            sdist = args.sdist if args.sdist is not None else download_sdist(version, Path(tmp))
            files = build(sdist, version)
    except GenerationError as err:
        print(f"make_patch.py: {err}", file=sys.stderr)
        return 2

    written = {name for name in files}
    if args.check:
        stale = [name for name, text in files.items() if _read(HERE / name) != text]
        extra = sorted(
            p.relative_to(HERE).as_posix()
            for p in SERIES_DIR.glob("*")
            if p.relative_to(HERE).as_posix() not in written
        )
        if stale or extra:
            print(
                f"make_patch.py: {', '.join(stale + extra)} is not what the package produces now: run"
                " `python upstream/make_patch.py` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(
            f"make_patch.py: the series ({len(STEPS)} patches) and the docs patch are up to date (lightning {version})."
        )
        return 0
    out = args.output_dir or HERE
    (out / "series").mkdir(parents=True, exist_ok=True)
    for old in (out / "series").glob("*"):
        if old.relative_to(out).as_posix() not in written:
            old.unlink()
    for name, text in sorted(files.items()):
        (out / name).write_bytes(text.encode("utf-8"))
        print(f"wrote {name}: {text.count(chr(10))} lines")
    return 0


def _read(path: Path) -> Optional[str]:
    return path.read_bytes().decode("utf-8") if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
