"""Where the Ray sweep's workers go: one placement group, placed within a short time or not at all.

By default (no ``--ray-workers``) the sweep asks for one worker per node that can hold one (its
CPUs), in a ``STRICT_SPREAD`` placement group: one model copy per node, never two on one node
while another is empty; a node without CPUs (the usual 0-CPU head of a large cluster) is not
counted. With ``--ray-workers N`` the group is ``SPREAD`` (several workers on a node when N
exceeds the nodes). Either way the group is reserved before any worker starts, and one that is
not placed within ``placement_timeout_s`` ends the sweep with one line naming what was asked and
what the cluster has free (:func:`unplaced`), instead of workers that wait for resources that
never come.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ggufswap.sweep.errors import SweepError

GIB = float(1 << 30)


def _amount(key: str, value: float) -> str:
    if key in ("memory", "object_store_memory"):
        return f"{key} {value / GIB:.1f} GiB"
    return f"{key} {value:g}"


def _resources(resources: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in resources]
    return ", ".join(_amount(k, resources[k]) for k in keys) or "nothing"


def unplaced(count: int, bundle: dict[str, float], strategy: str, why: str) -> str:
    """One line: the workers asked (and how), why they are not placed, and what the cluster
    has free and has per node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(
        f"{n.get('NodeManagerAddress', '?')} {n['NodeID'][:8]}: "
        f"{_resources(n.get('Resources', {}))}"
        for n in nodes
    )
    spread = "one per node" if strategy == "STRICT_SPREAD" else "spread over the nodes"
    return (
        f"cannot place {count} sweep worker(s) of {_resources(bundle)} each ({spread}): {why}; "
        f"the cluster has free {_resources(ray.available_resources())} on {len(nodes)} alive "
        f"node(s) (each node's total: {per_node}); give fewer --ray-workers, fewer --threads, "
        "or more nodes"
    )


def place_workers(workers: int | None, cpus: float, timeout_s: float) -> tuple[PlacementGroup, int]:
    """The placement group of the sweep's workers, placed, and how many bundles it has;
    SweepError (one line, :func:`unplaced`) when it is not placed within ``timeout_s``."""
    bundle = {"CPU": float(cpus)}
    if workers is None:
        fit = [n for n in ray.nodes()
               if n.get("Alive") and n.get("Resources", {}).get("CPU", 0.0) >= cpus]  # fmt: skip
        count, strategy = len(fit), "STRICT_SPREAD"
        if count == 0:
            raise SweepError(unplaced(1, bundle, strategy, "no node has that many CPUs"))
    else:
        count, strategy = workers, "SPREAD"
    group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise SweepError(
            unplaced(count, bundle, strategy, f"not placed within {timeout_s:g} s")
        ) from None
    return group, count


def in_group(group: PlacementGroup, index: int) -> Any:
    """The scheduling strategy that puts an actor in bundle ``index`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )
