"""Shared helpers for the runtime acceptance tests: real GGUF models in ``tmp_path``, runtimes on
small CPU pools, plans built from the files as they are on disk, and fresh-load references."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from ggufswap.config import Numerics
from ggufswap.ipc.plan import Job, Plan
from ggufswap.runtime import (
    HotSwapRuntime,
    PlanState,
    Pool,
    SlotState,
    Storage,
    float_products,
)
from ggufswap.runtime.control import ControlServer
from ggufswap.runtime.models import Decoder, Transformer, build_model
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.serving.daemon import model_in, served_model
from ggufswap.runtime.serving.serve import logits_digest, probe_tokens
from ggufswap.shards import (
    Layout,
    ModelSpec,
    TensorRecord,
    open_shard_set,
    read_header,
    requantize,
    tiny_moe,
    write_model,
)

Q = GGMLQuantizationType
WAIT_S = 30.0  # upper bound of every wait in these tests; a broken runtime fails, never hangs
TOKENS = torch.tensor(
    [[1, 17, 33, 250, 4, 99, 7, 128], [200, 3, 45, 45, 12, 0, 255, 64]], dtype=torch.int64
)  # [B=2, T=8]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread: the tiny models' matmuls are faster and steadier that way on a
    busy 2-core machine (restored afterwards; results are compared within one setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def float_kernels() -> Iterator[None]:
    """Native storage's float kernels, even where a libggml is installed (ggml's products have
    tests of their own: test_ggml_golden.py)."""
    with float_products():
        yield


def mixed_moe(**overrides: object) -> ModelSpec:
    """The tiny MoE model with its weights in a mix of types (not all Q8_0)."""
    return tiny_moe(**overrides).with_types(
        ffn_gate_exps="q4_0",
        ffn_up_exps="q5_1",
        ffn_down_exps="q8_0",
        attn_q="f16",
        attn_k="q4_1",
        attn_v="q5_0",
        attn_o="bf16",
        token_embd="q8_0",
        output="f16",
    )


@dataclass
class ModelDir:
    """A model written into a directory, one shard per tensor unless told otherwise."""

    root: Path
    first: Path
    _paths: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def write(
        cls, root: Path, spec: ModelSpec | None = None, *, layout: Layout = Layout.PER_TENSOR
    ) -> ModelDir:
        root.mkdir(parents=True, exist_ok=True)
        paths = write_model(spec or mixed_moe(), root, layout=layout)
        return cls(root=root, first=Path(paths[0]))

    def records(self) -> dict[str, TensorRecord]:
        """Every tensor record as the files on disk are now."""
        return dict(open_shard_set(self.first).tensors)

    def shard_of(self, name: str) -> Path:
        if not self._paths:
            self._paths = {n: Path(r.path) for n, r in self.records().items()}
        return self._paths[name]

    def record(self, name: str) -> TensorRecord:
        """The record of ``name`` as its shard is now (reads only that shard's header)."""
        return read_header(self.shard_of(name)).tensor_map()[name]

    def plan(self, plan_id: str, names: Iterable[str], *, model: str = "") -> Plan:
        """A plan that loads ``names`` from the files as they are now (no fingerprints)."""
        return Plan(plan_id, model, tuple(Job(self.record(n)) for n in names))

    def variant(self, name: str, ggml_type: GGMLQuantizationType, store: Path) -> Path:
        """Write the shard of ``name`` with that tensor re-encoded as ``ggml_type`` into ``store``
        (outside the model directory); returns the variant file."""
        store.mkdir(parents=True, exist_ok=True)
        out = store / f"{name}.{ggml_type.name}.gguf"
        if not out.exists():
            requantize(self.shard_of(name), name, ggml_type, out=out)
        return out

    def save(self, name: str, store: Path) -> Path:
        """Keep a copy of the current shard of ``name`` in ``store``."""
        store.mkdir(parents=True, exist_ok=True)
        out = store / f"{name}.saved.gguf"
        shutil.copy2(self.shard_of(name), out)
        return out

    def put(self, name: str, source: Path) -> None:
        """Replace the shard of ``name`` with a copy of ``source`` by atomic rename (new inode;
        no fsync: durability is not what these tests are about)."""
        dest = self.shard_of(name)
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, dest)

    def clone(self, dest: Path, replacements: Mapping[str, Path] | None = None) -> ModelDir:
        """A copy of this model's files (as they are now) with some shards replaced."""
        dest.mkdir(parents=True, exist_ok=False)
        for path in open_shard_set(self.first).paths:
            shutil.copy2(path, dest / os.path.basename(path))
        copy = ModelDir(root=dest, first=dest / self.first.name)
        for name, source in (replacements or {}).items():
            shutil.copy2(source, dest / os.path.basename(self.shard_of(name)))
        return copy


def open_runtime(
    first: Path,
    *,
    storage: Storage = Storage.DEQUANTIZED,
    stable_pointers: bool | None = None,
    pools: list[Pool] | None = None,
    **options: object,
) -> tuple[HotSwapRuntime, Transformer]:
    """A runtime over ``first``'s shard set and a reference model reading its store."""
    runtime = HotSwapRuntime.open(
        first,
        storage=storage,
        stable_pointers=stable_pointers,
        pools=pools,
        **options,  # type: ignore[arg-type]
    )
    assert runtime.shards is not None, "open() keeps the shard set"
    model = Transformer(HParams.from_metadata(runtime.shards.metadata), runtime.store)
    return runtime, model


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens)


def fresh_logits(first: Path, *, storage: Storage, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Logits of a fresh load of the files as they are now (same storage mode)."""
    runtime, model = open_runtime(first, storage=storage)
    try:
        return logits(model, tokens)
    finally:
        runtime.close()


def open_model(first: Path, **options: object) -> tuple[HotSwapRuntime, Decoder]:
    """A runtime over ``first``'s shard set and the decoder of its architecture (``build_model``)
    reading its store."""
    runtime = HotSwapRuntime.open(first, **options)  # type: ignore[arg-type]
    assert runtime.shards is not None, "open() keeps the shard set"
    config = HParams.from_metadata(runtime.shards.metadata)
    return runtime, build_model(config, runtime.store, store=runtime.store)


def fresh_model_logits(first: Path, *, storage: Storage) -> torch.Tensor:
    """``fresh_logits`` for any architecture: a fresh load's logits through ``build_model``."""
    runtime, model = open_model(first, storage=storage)
    try:
        return logits(model)
    finally:
        runtime.close()


def assert_swap_equals_fresh_load(
    runtime: HotSwapRuntime,
    model: torch.nn.Module,
    model_dir: ModelDir,
    name: str,
    replacement: Path,
    *,
    storage: Storage,
    saved: Path | None = None,
) -> None:
    """Put ``replacement`` as the shard of ``name`` and commit its plan: ``model``'s logits change,
    to a fresh load's bit for bit; with ``saved`` (the original shard) put back and committed,
    they are the first logits again."""
    before = logits(model)
    assert torch.isfinite(before).all()
    model_dir.put(name, replacement)
    ticket = runtime.apply(model_dir.plan("swap", [name]))
    assert ticket.state is PlanState.COMMITTED, ticket.summary()
    swapped = logits(model)
    assert not torch.equal(swapped, before), f"the swap of {name} changed nothing"
    assert torch.equal(swapped, fresh_model_logits(model_dir.first, storage=storage))
    if saved is not None:
        model_dir.put(name, saved)
        ticket = runtime.apply(model_dir.plan("back", [name]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert torch.equal(logits(model), before)


def fresh_digest(
    first: Path, *, storage: Storage = Storage.AUTO, served: Numerics | None = None
) -> str:
    """The digest of the probe batch's logits (what a runtime in probe mode records) on a fresh
    load of the files as they are now (``storage``: the configuration's default, auto), with
    the decoder a runtime serves: in the numerics ``auto`` chooses for these files, or in
    ``served`` (a runtime's status's ``numerics``: chosen at its load, never changed by a
    swap)."""
    if served is Numerics.GGML and storage is Storage.AUTO:
        storage = Storage.NATIVE  # as the runtime loads for them (served_storage)
    with HotSwapRuntime.open(first, storage=storage) as runtime:
        model = served_model(runtime) if served is None else model_in(runtime, served)
        with torch.inference_mode():
            return logits_digest(model(probe_tokens(model.config.n_vocab, batch=2, tokens=16)))


def slot_states(runtime: HotSwapRuntime, names: Iterable[str]) -> set[SlotState]:
    """The states the slots of ``names`` are in (one element when they all agree)."""
    return {runtime.store.slots[n].state for n in names}


def cpu_pools(dev_budget: int | None, host_budget: int | None = None) -> list[Pool]:
    """A budgeted "dev" pool and a "host" pool that takes fallbacks (both on the CPU)."""
    cpu = torch.device("cpu")
    return [Pool("dev", cpu, budget=dev_budget), Pool("host", cpu, budget=host_budget)]


def loaded_bytes(first: Path, storage: Storage) -> int:
    """How many bytes a load of ``first`` takes in ``storage`` mode (one unbounded pool)."""
    runtime, _ = open_runtime(first, storage=storage)
    try:
        return sum(runtime.store.pools.usage().values())
    finally:
        runtime.close()


def control_server(runtime: HotSwapRuntime, sockdir: Path) -> ControlServer:
    """A control server over ``runtime``, its control and events sockets in ``sockdir`` (short:
    a socket path holds at most 107 bytes); not started."""
    return ControlServer(
        runtime,
        control_endpoint=f"ipc://{sockdir}/control.sock",
        events_endpoint=f"ipc://{sockdir}/events.sock",
    )
