"""Triton kernels read no module global Triton would refuse, checked without Triton installed.

Triton compiles a ``@triton.jit`` function from its source; a module-level name the function
reads must be another jit function, an imported module, or a value bound with
``tl.constexpr(...)``: a plain ``X = 16`` fails at the kernel's first compile ("Cannot access
global variable X from within @jit'ed function"), which only a GPU host shows (under
``TRITON_INTERPRET=1`` any global is read). This reads the source: every module-level assignment
a jit function reads (a name it neither takes as a parameter nor binds itself) must be a call of
``tl.constexpr`` / ``triton.language.constexpr``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONSTEXPR = {"tl.constexpr", "triton.language.constexpr", "constexpr"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _is_jit(function: ast.FunctionDef) -> bool:
    return any(_dotted(d) in {"triton.jit", "jit"} for d in function.decorator_list)


def _module_values(tree: ast.Module) -> dict[str, ast.expr]:
    """Each module-level name bound by an assignment, with the value bound last."""
    values: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            values[node.target.id] = node.value
    return values


def _own_names(function: ast.FunctionDef) -> set[str]:
    args = function.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    names = {a.arg for a in every if a is not None}
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def offenders(source: str, shown: str) -> Iterator[str]:
    """``shown:line: ...`` for each global a jit function of ``source`` reads that Triton
    would refuse."""
    tree = ast.parse(source, filename=shown)
    values = _module_values(tree)
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef) or not _is_jit(function):
            continue
        own = _own_names(function)
        for node in ast.walk(function):
            if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load):
                continue
            value = values.get(node.id)
            if node.id in own or value is None:
                continue
            if not (isinstance(value, ast.Call) and _dotted(value) in CONSTEXPR):
                yield (
                    f"{shown}:{node.lineno}: jit function {function.name} reads the global "
                    f"{node.id}, which is not a tl.constexpr: bind it as "
                    f"`{node.id} = tl.constexpr(...)`"
                )


def check(repo: Path = REPO) -> list[str]:
    """The offenders of every module under ``repo`` that defines a Triton kernel."""
    found: list[str] = []
    for path in sorted(repo.glob("runtime/**/*.py")):
        source = path.read_text()
        if "@triton.jit" in source:
            found.extend(offenders(source, str(path.relative_to(repo))))
    return found
