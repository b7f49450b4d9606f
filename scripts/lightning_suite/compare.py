"""Compare the passing sets of two runs of Lightning's tests (``scripts/lightning_suite.sh``).

``python compare.py passed JUNIT`` prints the ids of the tests a junit XML report (``junit_family=xunit1``) says
passed, one a line, sorted; it exits 1, saying why on stderr, if a test file could not be collected.
``python compare.py compare UPSTREAM OURS OURS_JUNIT`` reads two such lists (lines that start with ``#`` are
comments), prints the counts, every test that passed upstream but not ours with the essentials of its outcome on our
side, and the tests that passed ours only; it exits 1 if any passed upstream only.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("failure", "error", "skipped")
LINES = 25  # of a failure's text without frames (a timeout's, say): the last ones
EXCEPTION_LINES = 12  # of a failure's `E` lines: the exception and the start of its message
# pytest's location line of each frame of a long traceback: "path:line: in function", the test's "path:line: ", the
# innermost "path:line: ExceptionType"
LOCATION = re.compile(r"^\S+:\d+:( in \S+| \w+)?\s*$")


def _is_collection_error(case: ET.Element) -> bool:
    return any(c.tag == "error" and c.attrib.get("message") == "collection failure" for c in case)


def _node_id(case: ET.Element) -> str:
    """pytest's id of a junit test case, relative to the folder the tests run from (``tests/``)."""
    file = case.attrib["file"]  # "tests/tests_pytorch/x/test_y.py" (relative to the rootdir, above tests/)
    module = file.removesuffix(".py").replace("/", ".")
    classes = case.attrib["classname"].removeprefix(module).strip(".")
    parts = [file.removeprefix("tests/"), *filter(None, classes.split(".")), case.attrib["name"]]
    return "::".join(parts)


def outcomes(junit: Path) -> dict[str, list[ET.Element]]:
    """Each test's id and the outcome elements (failure, error, skipped) of its junit case: none when it passed."""
    result: dict[str, list[ET.Element]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if _is_collection_error(case):
            continue
        result.setdefault(_node_id(case), []).extend(c for c in case if c.tag in OUTCOMES)
    return result


def passed(junit: Path) -> list[str]:
    """The sorted ids of the tests that passed."""
    return sorted(test for test, found in outcomes(junit).items() if not found)


def collection_errors(junit: Path) -> list[str]:
    """Each test file that could not be collected, with the end of its error."""
    cases = [c for c in ET.parse(junit).getroot().iter("testcase") if _is_collection_error(c)]
    return [f"  NOT COLLECTED {case.attrib['file']}\n{_essentials(list(case))}" for case in cases]


def _read(listing: Path) -> set[str]:
    return {line.strip() for line in listing.read_text().splitlines() if line.strip() and not line.startswith("#")}


def _traceback(text: str) -> list[str]:
    """The essentials of a pytest long traceback: each frame's location and the line it ran (the test's ``>`` line,
    a callee's first source line), then the exception (``E`` lines); its last lines if it has no frames."""
    lines = text.rstrip().splitlines()
    chain = []
    for i, line in enumerate(lines):
        if not LOCATION.match(line):
            continue
        if " in " in line:
            chain += [line, lines[i + 1]] if i + 1 < len(lines) else [line]
        else:  # the test's frame (its `>` line is above) or the innermost one (its `>` line is above its `E` lines)
            chain += [line] + [above for above in lines[max(0, i - 30) : i] if above.startswith(">")][-1:]
    raised = [line for line in lines if line.startswith("E ")][:EXCEPTION_LINES]
    return chain + raised if chain else lines[-LINES:]


def _essentials(found: list[ET.Element] | None) -> str:
    """What happened to a test on our side, from its junit case: outcome, message, call chain and exception."""
    if found is None:
        return "    not run (not collected, or the run stopped before it)"
    lines = []
    for element in found:
        message = (element.attrib.get("message") or "").splitlines()
        lines.append(f"    {element.tag}: {message[0] if message else ''}")
        lines.extend(f"      | {line}" for line in _traceback(element.text or ""))
    return "\n".join(lines)


def compare(upstream: Path, ours: Path, ours_junit: Path) -> int:
    """Print the comparison; 1 if a test passed upstream but not ours."""
    theirs, mine = _read(upstream), _read(ours)
    missing, extra = sorted(theirs - mine), sorted(mine - theirs)
    print(f"passed upstream: {len(theirs)}, passed ours: {len(mine)}, passed upstream but not ours: {len(missing)}")
    details = outcomes(ours_junit)
    for test in missing:
        print(f"  MISSING {test}\n{_essentials(details.get(test))}")
    if extra:
        print(f"passed ours but not upstream: {len(extra)}")
        for test in extra:
            print(f"  EXTRA {test}")
    return 1 if missing else 0


def main(argv: list[str]) -> int:
    """The command line (see the module's docstring)."""
    if len(argv) == 2 and argv[0] == "passed":
        print("\n".join(passed(Path(argv[1]))))
        errors = collection_errors(Path(argv[1]))
        if errors:
            print("\n".join(errors), file=sys.stderr)
        return 1 if errors else 0
    if len(argv) == 4 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
