"""What a batch boundary of a runtime serving mapped shards may trust, shown in one process
(no writer needed): a watcher pass vouches for the leases from its start, not its end, and a
file reported compromised while the boundary checked the files makes the next batch's result
be dropped."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import ModelDir, open_runtime

from ggufswap.config import MapShards
from ggufswap.runtime import HotSwapRuntime, Storage
from ggufswap.runtime import engine as engine_module


@contextlib.contextmanager
def mapped_runtime(tmp_path: Path) -> Iterator[HotSwapRuntime]:
    """A runtime serving the tiny model's shards from mappings (a context, not a fixture: the
    leak checks run while pytest still holds a fixture's value, and its tensors hold the files)."""
    model_dir = ModelDir.write(tmp_path / "model")
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    del model  # its tensors view the mappings: the files close once the runtime's are gone too
    try:
        assert runtime.store.maps.open_files
        yield runtime
    finally:
        runtime.close()


def test_a_pass_vouches_for_the_leases_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass whose file checks ran at some time leaves ``last_pass`` before them: a pass
    stopped (SIGSTOP) after it checked a file, and resumed after the kernel broke that file's
    lease, must not make the stop look like a recent check."""
    checked: list[float] = []
    with mapped_runtime(tmp_path) as runtime:
        maps = runtime.store.maps
        real_check = maps._check

        def check(mapped: Any) -> None:
            checked.append(time.monotonic())
            real_check(mapped)

        monkeypatch.setattr(maps, "_check", check)
        maps.check_all()
        assert checked
        assert maps.last_pass < min(checked)


def test_a_report_made_while_the_boundary_checks_drops_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the watcher reports compromised while ``at_batch_boundary`` runs its check (after
    the check took the reports) is not in what was taken out of service: ``batch_intact`` is
    False after the batch, so its result is dropped; without the report it is True."""
    real_check = engine_module.check_mapped
    with mapped_runtime(tmp_path) as runtime:
        maps = runtime.store.maps
        runtime.at_batch_boundary()
        assert runtime.batch_intact()

        def check_then_report(store: Any) -> dict[str, str]:
            lost = real_check(store)
            maps.reported += 1  # what the watcher's _report does, from its own thread
            return lost

        monkeypatch.setattr(engine_module, "check_mapped", check_then_report)
        runtime.at_batch_boundary()
        assert not runtime.batch_intact()
