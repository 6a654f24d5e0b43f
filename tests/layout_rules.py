"""The one-way import rules of the package map, checked on grimp's import graph.

grimp (the graph engine of import-linter) reads the package from where Python would import it and
records every import statement, those inside functions included, so a lazy ``import torch`` in an
agent module counts. Run as a script it prints every broken rule and exits 1; ``PYTHONPATH``
chooses which ``ggufswap`` tree it reads (tests plant violations in a copy).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grimp

PACKAGE = "ggufswap"
CORE = "ggufswap.runtime"
MODELS = "ggufswap.runtime.models"
SERVING = "ggufswap.runtime.serving"
RAY_SWEEP = "ggufswap.runtime.serving.sweep_ray"  # the one module that imports ray (an extra)
# The modules that may import structlog: the loggers every module uses, and the command line's
# configuration of them. Anything else logs through ggufswap.logs.get_logger.
STRUCTLOG_USERS = frozenset({"ggufswap.logs", "ggufswap._logsetup"})
AGENT_SIDE = ("ggufswap.shards", "ggufswap.config", "ggufswap.ipc", "ggufswap.agent")
FOUNDATIONS = ("ggufswap.shards", "ggufswap.config", "ggufswap.ipc")
# Import name -> repository folder (pyproject's package-dir; subpackages follow their folders).
FOLDERS = {
    "ggufswap": "cli",
    "ggufswap.shards": "shards",
    "ggufswap.config": "config",
    "ggufswap.ipc": "ipc",
    "ggufswap.agent": "agent",
    "ggufswap.runtime": "runtime",
    "ggufswap.runtime.models": "runtime/models",
    "ggufswap.runtime.serving": "runtime/serving",
}


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
    return _tree(graph, CORE) - _tree(graph, MODELS) - _tree(graph, SERVING)


def rules(graph: grimp.ImportGraph) -> list[Rule]:
    agent_side = set().union(*(_tree(graph, p) for p in AGENT_SIDE))
    foundations = set().union(*(_tree(graph, p) for p in FOUNDATIONS))
    core = core_modules(graph)
    models, serving = _tree(graph, MODELS), _tree(graph, SERVING)
    return [
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
            "only the Ray sweep imports ray",
            frozenset(_tree(graph, PACKAGE) - {RAY_SWEEP}),
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
            "serving (the single-host sweep) never reaches ray but through the Ray sweep",
            frozenset(serving - {RAY_SWEEP}),
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
    return grimp.build_graph(PACKAGE, include_external_packages=True, cache_dir=None)


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
