"""Opening a model: its shard set read into a new :class:`TensorStore`, placed on the pools.

:meth:`HotSwapRuntime.open` starts here: the shard set containing the path is opened (its
siblings found by their metadata), ``storage: auto`` is resolved against the pools
(:func:`~ggufswap.runtime.placement.choose_storage`), every tensor is read once into its home
(:meth:`TensorStore.load`), and the load is logged in one ``model.loaded`` line.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ggufswap.config import DEFAULT_DECODED_CACHE, MapShards, Storage
from ggufswap.logs import get_logger
from ggufswap.runtime.placement import Placement, choose_storage
from ggufswap.runtime.pools import Pool, PoolSet
from ggufswap.runtime.store import TensorStore
from ggufswap.shards import HeaderCache, Keys, ShardSet, open_shard_set

log = get_logger(__name__)


def load_model(
    model: str | os.PathLike[str],
    *,
    pools: list[Pool] | None = None,
    fallback_pool: str | None = None,
    storage: Storage = Storage.DEQUANTIZED,
    compute_dtype: torch.dtype = torch.float32,
    strict: bool = False,
    decoded_cache: int = DEFAULT_DECODED_CACHE,
    map_shards: MapShards = MapShards.OFF,
    placement: Placement | None = None,
    model_name: str | None = None,
    progress: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    headers: HeaderCache | None = None,
) -> tuple[ShardSet, TensorStore, str]:
    """The shard set containing ``model``, a store holding its tensors, and the model's name
    (``model_name``, else ``general.name``, else the first shard's file name).

    ``storage=AUTO`` is resolved here; ``decoded_cache`` bounds the decoded dense tensors native
    storage keeps (bytes); ``map_shards`` serves native CPU tensors from their files' pages
    (:mod:`.mapping`); ``placement`` puts blocks and experts on pools (:mod:`.placement`);
    ``on_progress(done, total)`` is told the bytes of the load read so far. ``headers``: headers
    already parsed (a file whose identity changed since is parsed again).
    """
    shards = open_shard_set(model, cache=headers or HeaderCache())
    pool_set = PoolSet(pools or [], fallback=fallback_pool)
    if storage is Storage.AUTO:
        storage, why = choose_storage(shards.tensors.values(), pool_set, compute_dtype)
        log.info("storage.chosen", storage=storage.value, why=why)
    store = TensorStore(
        pools=pool_set,
        storage=storage,
        compute_dtype=compute_dtype,
        strict=strict,
        decoded_cache=decoded_cache,
        map_shards=map_shards,
    )
    report = store.load(
        shards,
        placement=placement or Placement(),
        n_blocks=_block_count(shards),
        progress=progress,
        on_progress=on_progress,
    )
    name = model_name or str(
        shards.metadata.get(Keys.General.NAME) or os.path.basename(shards.first.path)
    )
    log.info(
        "model.loaded",
        model=name,
        tensors=report.tensors,
        bytes=report.bytes_read,
        placed=report.placed,
        seconds=round(report.seconds, 3),
        gb_per_s=round(report.bytes_read / report.seconds / 1e9, 3) if report.seconds else None,
    )
    return shards, store, name


def _block_count(shards: ShardSet) -> int:
    arch = shards.metadata.get(Keys.General.ARCHITECTURE)
    key = Keys.LLM.BLOCK_COUNT.format(arch) if isinstance(arch, str) else None
    value = shards.metadata.get(key) if key is not None else None
    return value if isinstance(value, int) else 0
