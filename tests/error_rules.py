"""One error hierarchy per package, checked on the exception classes the packages really define.

Every module of every package of the map (pyproject's ``[tool.ggufswap.packages]``) is imported;
then every exception class alive in the interpreter (the subclass tree of ``BaseException``, so a
class bound to no module-level name counts too) whose ``__module__`` is one of those modules is
checked against the package that holds it (the most specific one of the map):

- it is defined in the package's ``errors`` module;
- it derives from the package's base: the one class of that ``errors`` module none of whose
  bases the package defines (``ShardError``, ``ModelError`` over the core's
  ``RuntimeLibraryError``...). An ``errors`` module with two such roots has no one base.

A package that defines no exception needs no ``errors`` module. Run as a script it prints every
offender and exits 1; arguments limit it to those packages, and ``PYTHONPATH`` chooses which
``ggufswap`` tree it reads (tests plant offenders in a copy).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
ERRORS = "errors"
# Import name -> repository folder: pyproject.toml's [tool.ggufswap.packages], the map's one place.
FOLDERS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ggufswap"][
    "packages"
]
# Modules that cannot be imported to be read: ``python -m ggufswap`` runs the command line.
NOT_IMPORTED = frozenset({"ggufswap.__main__"})
# Optional extras a module may need that a test environment may lack (``make test`` installs no
# ``gpu`` extra, triton being ~1 GB; a GPU host's ``make gpu-env`` installs no ``ray``): a module
# that cannot import for want of one of these is not read there; any other failed import fails
# the check.
OPTIONAL_EXTRAS = frozenset({"triton", "ray"})


def package_of(module: str) -> str | None:
    """The most specific package of the map that holds ``module`` (None: none does)."""
    holders = [p for p in FOLDERS if module == p or module.startswith(p + ".")]
    return max(holders, key=len) if holders else None


def package_modules(package: str) -> Iterator[str]:
    """The import name of every module file in ``package``'s folder, as installed."""
    spec = importlib.util.find_spec(package)
    assert spec is not None, f"{package} is not importable"
    assert spec.submodule_search_locations, f"{package} is not a package"
    folder = Path(next(iter(spec.submodule_search_locations)))
    for path in sorted(folder.glob("*.py")):
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        if name not in NOT_IMPORTED:
            yield name


def _subclasses(root: type[BaseException]) -> Iterator[type[BaseException]]:
    seen: set[type[BaseException]] = set()
    stack = [root]
    while stack:
        cls = stack.pop()
        for sub in type.__subclasses__(cls):
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                yield sub


def defined_exceptions(packages: Iterable[str]) -> dict[str, list[type[BaseException]]]:
    """Import every module of ``packages``; their exception classes by package."""
    wanted = set(packages)
    for package in sorted(wanted):
        for module in package_modules(package):
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] not in OPTIONAL_EXTRAS:
                    raise
    found: dict[str, list[type[BaseException]]] = {p: [] for p in wanted}
    for cls in _subclasses(BaseException):
        package = package_of(cls.__module__)
        if package in wanted:
            found[package].append(cls)
    for classes in found.values():
        classes.sort(key=lambda c: (c.__module__, c.__qualname__))
    return found


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def offenders(package: str, classes: list[type[BaseException]]) -> list[str]:
    """One line per class of ``package`` that breaks the rule, saying what is wrong and the fix."""
    if not classes:
        return []
    errors_module = f"{package}.{ERRORS}"
    roots = [
        cls
        for cls in classes
        if cls.__module__ == errors_module
        and not any(package_of(base.__module__) == package for base in cls.__bases__)
    ]
    found = []
    if len(roots) != 1:
        names = ", ".join(_name(r) for r in roots) or "none"
        found.append(
            f"{errors_module}: expected one base class that every other derives from, found "
            f"{len(roots)} roots ({names}); derive the others from the package's base"
        )
    base = roots[0] if len(roots) == 1 else None
    for cls in classes:
        problems = []
        if cls.__module__ != errors_module:
            problems.append(f"defined outside {errors_module} (move it there)")
        if base is not None and not issubclass(cls, base):
            problems.append(f"does not derive from {base.__qualname__}, the base of {package}")
        if problems:
            found.append(f"{_name(cls)}: {'; '.join(problems)}")
    return found


def check(packages: Iterable[str] = tuple(FOLDERS)) -> list[str]:
    """Every offender of ``packages`` (all of the map by default)."""
    found = defined_exceptions(packages)
    return [line for package in sorted(found) for line in offenders(package, found[package])]


def main(argv: list[str]) -> int:
    broken = check(argv or tuple(FOLDERS))
    for line in broken:
        sys.stdout.write(line + "\n")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
