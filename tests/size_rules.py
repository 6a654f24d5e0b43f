"""No module over ~500 lines and no function over ~60 without a stated reason.

A module's size is its number of lines; a function's (a method, a nested function) its lines
from ``def`` to its last line, less its docstring (documentation is never what makes a function
too long). The reason is a line of the module's (or the function's) docstring that starts with
``Size:`` and says why it stays whole: a table, a port of a ggml function that must match it
line for line, a module another issue is reworking.

Run as a script it prints every offender (``path:line: what, size``) of the package folders of
the map (pyproject's ``[tool.ggufswap.packages]``) under the repository given (default: this
checkout) and exits 1 when there is one; tests run it on a copy with a planted offender.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
REASON = "Size:"


def _folders(repo: Path) -> list[str]:
    packages = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["ggufswap"]["packages"]
    return sorted(packages.values())


def _has_reason(docstring: str | None) -> bool:
    return docstring is not None and any(
        line.strip().startswith(REASON) for line in docstring.splitlines()
    )


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from ``def`` to its last line, less its docstring."""
    assert node.end_lineno is not None, "ast.parse records end positions"
    size = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if ast.get_docstring(node, clean=False) is not None and first.end_lineno is not None:
        size -= first.end_lineno - first.lineno + 1
    return size


def module_offenders(path: Path, shown: str) -> Iterator[str]:
    """The offenders of one module file, ``shown`` as its path."""
    text = path.read_text()
    tree = ast.parse(text, filename=shown)
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES and not _has_reason(ast.get_docstring(tree)):
        yield (
            f"{shown}:1: module of {lines} lines (over {MAX_MODULE_LINES}): split it, or state "
            f"why it stays whole on a '{REASON}' line of its docstring"
        )
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        size = function_lines(node)
        if size > MAX_FUNCTION_LINES and not _has_reason(ast.get_docstring(node)):
            yield (
                f"{shown}:{node.lineno}: function {node.name} of {size} lines (over "
                f"{MAX_FUNCTION_LINES}, docstring not counted): split it, or state why it "
                f"stays whole on a '{REASON}' line of its docstring"
            )


def offenders(repo: Path = REPO) -> list[str]:
    """Every offender in the package folders of ``repo``, in path order."""
    found: list[str] = []
    for folder in _folders(repo):
        for path in sorted((repo / folder).glob("*.py")):
            found.extend(module_offenders(path, str(path.relative_to(repo))))
    return found


def main(argv: list[str]) -> int:
    found = offenders(Path(argv[0]) if argv else REPO)
    for line in found:
        sys.stdout.write(line + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
