"""The one-way import rules of the package map, checked on grimp's import graph.

grimp (the graph engine of import-linter) reads the package from where Python would import it and
records every import statement, those inside functions included, so a lazy ``import torch`` in an
agent module counts. Run as a script it prints every broken rule and exits 1; ``PYTHONPATH``
chooses which ``ggufswap`` tree it reads (tests plant violations in a copy).
"""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grimp
import tomllib

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "ggufswap"
CLI_MAIN = "ggufswap.main"  # loads the subcommand modules by name (COMMAND_MODULES)
CORE = "ggufswap.runtime"
KERNELS = "ggufswap.runtime.kernels"
MODELS = "ggufswap.runtime.models"
SERVING = "ggufswap.runtime.serving"
SWEEP = "ggufswap.sweep"
# the modules that import ray (an extra): the Ray sweep's driver, worker, placement and fleet
RAY_SWEEP = frozenset(f"ggufswap.sweep.ray_{m}" for m in ("driver", "worker", "placement", "fleet"))
# The modules that may import structlog: the loggers every module uses, and the command line's
# configuration of them. Anything else logs through ggufswap.logs.get_logger.
STRUCTLOG_USERS = frozenset({"ggufswap.logs", "ggufswap._logsetup"})
AGENT_SIDE = ("ggufswap.shards", "ggufswap.config", "ggufswap.ipc", "ggufswap.agent")
FOUNDATIONS = ("ggufswap.logs", "ggufswap.shards", "ggufswap.config", "ggufswap.ipc")
# Import name -> repository folder: pyproject.toml's [tool.ggufswap.packages], the map's one place
# (setup.py and the Makefile read it too).
FOLDERS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ggufswap"][
    "packages"
]


def modules_on_disk(repo: Path) -> Iterator[str]:
    """The import name of every module file in the package folders."""
    for package, folder in FOLDERS.items():
        for path in sorted((repo / folder).glob("*.py")):
            yield package if path.stem == "__init__" else f"{package}.{path.stem}"


def installed_path(repo_path: str) -> str:
    """Where a repository file lives in the installed ``ggufswap/`` tree."""
    folder, _, name = repo_path.rpartition("/")
    package = next(p for p, f in FOLDERS.items() if f == folder)
    return "/".join(package.split(".")) + "/" + name


def copy_installed_layout(repo: Path, dest: Path) -> None:
    """Copy the package folders into ``dest/ggufswap/...`` as an installation lays them out."""
    for package, folder in FOLDERS.items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in (repo / folder).glob("*.py"):
            shutil.copy2(path, target / path.name)


@dataclass(frozen=True)
class Rule:
    """Modules ``importers`` never reach ``forbidden``, directly or through other modules."""

    name: str
    importers: frozenset[str]
    forbidden: frozenset[str]
    direct_only: bool = False


def _tree(graph: grimp.ImportGraph, package: str) -> set[str]:
    return {package} | set(graph.find_descendants(package))


def core_modules(graph: grimp.ImportGraph) -> set[str]:
    """The hot-swap core: ``ggufswap.runtime`` and its modules, not its subpackages."""
    return _tree(graph, CORE) - _tree(graph, KERNELS) - _tree(graph, MODELS) - _tree(graph, SERVING)


def cli_modules(graph: grimp.ImportGraph) -> set[str]:
    """The command line: the top-level package's own modules (``cli/``), not its subpackages
    and not the root package itself (every subpackage's parent, holding ``__version__``)."""
    subpackages = {p for p in FOLDERS if p != PACKAGE}
    return {
        m
        for m in _tree(graph, PACKAGE)
        if m != PACKAGE and not any(m == p or m.startswith(p + ".") for p in subpackages)
    }


def rules(graph: grimp.ImportGraph) -> list[Rule]:
    agent_side = set().union(*(_tree(graph, p) for p in AGENT_SIDE))
    foundations = set().union(*(_tree(graph, p) for p in FOUNDATIONS))
    core = core_modules(graph)
    kernels, models, serving = _tree(graph, KERNELS), _tree(graph, MODELS), _tree(graph, SERVING)
    sweep = _tree(graph, SWEEP)
    library = _tree(graph, PACKAGE) - cli_modules(graph)
    return [
        Rule(
            "nothing but the command line imports the command line",
            frozenset(library - {PACKAGE}),
            frozenset(cli_modules(graph)),
        ),
        Rule(
            "the kernels never import the rest of the core",
            frozenset(kernels),
            frozenset(core - {f"{CORE}.errors"}),
        ),
        Rule("the agent side never imports torch", frozenset(agent_side), frozenset({"torch"})),
        Rule(
            "shards, config and ipc never import the agent or the runtime",
            frozenset(foundations),
            frozenset(_tree(graph, "ggufswap.agent") | _tree(graph, CORE)),
        ),
        Rule(
            "the agent never imports the runtime",
            frozenset(_tree(graph, "ggufswap.agent")),
            frozenset(_tree(graph, CORE)),
        ),
        Rule(
            "the core never imports the models or serving",
            frozenset(core),
            frozenset(models | serving),
        ),
        Rule("the models never import serving", frozenset(models), frozenset(serving)),
        Rule(
            "nothing but the command line imports the sweep",
            frozenset(library - sweep - {PACKAGE}),
            frozenset(sweep),
        ),
        Rule(
            "the kernels never import the models or serving",
            frozenset(kernels),
            frozenset(models | serving),
        ),
        Rule(
            "only the Ray sweep imports ray",
            frozenset(_tree(graph, PACKAGE) - RAY_SWEEP),
            frozenset({"ray"}),
            direct_only=True,
        ),
        Rule(
            "modules log through ggufswap.logs.get_logger, never structlog directly",
            frozenset(_tree(graph, PACKAGE) - STRUCTLOG_USERS),
            frozenset({"structlog"}),
            direct_only=True,
        ),
        Rule(
            "the single-host sweep never reaches ray but through the Ray sweep",
            frozenset((sweep | serving) - RAY_SWEEP),
            frozenset({"ray"}),
        ),
        Rule(
            "the models use only the core's public names (import ggufswap.runtime)",
            frozenset(models),
            frozenset(core - {CORE}),
            direct_only=True,
        ),
    ]


def violations(graph: grimp.ImportGraph, rule: Rule) -> list[str]:
    """One line per importer that breaks ``rule``, with the chain that breaks it."""
    found = []
    for importer in sorted(rule.importers):
        if rule.direct_only:
            reached = graph.find_modules_directly_imported_by(importer)
        else:
            reached = graph.find_upstream_modules(importer)
        for target in sorted(reached & rule.forbidden):
            chain = graph.find_shortest_chain(importer, target) or (importer, target)
            found.append(f"{rule.name}: {' -> '.join(chain)}")
    return found


def build_graph() -> grimp.ImportGraph:
    """The import graph, with the subcommand modules the command line loads by name (invisible
    to a reader of import statements) added as imports of ``ggufswap.main``."""
    graph = grimp.build_graph(PACKAGE, include_external_packages=True, cache_dir=None)
    for name in importlib.import_module(CLI_MAIN).COMMAND_MODULES:
        graph.add_import(importer=CLI_MAIN, imported=name)
    return graph


def check(graph: grimp.ImportGraph) -> list[str]:
    return [line for rule in rules(graph) for line in violations(graph, rule)]


def _print(lines: Iterable[str]) -> None:
    for line in lines:
        sys.stdout.write(line + "\n")


def main() -> int:
    broken = check(build_graph())
    _print(broken)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
