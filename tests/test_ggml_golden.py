"""ggml's products against golden data recorded with ggml itself (tests/fixtures/ggml_golden).

``crosscheck/ggml_golden.py`` recorded, with mainline's libggml (llama-cpp-python) and with ik's
(the ik-llama-cpp-python wheel), per weight type: products of one row (decode), five and forty
(the batched paths) and a routed-experts product (``mul_mat_id``). Where a libggml of the same
family is loaded here, the project's ggml path (:class:`QuantizedMatrix`, :class:`QuantizedExperts`)
gives the recorded bits (the same package on a CPU of the same instruction sets; another build
within float noise). Everywhere, without any library, the fallbacks come close: ggml's rounding
emulated (numerics "ggml") for mainline's recording, float products of the decoded weights for
ik's own types.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crosscheck"))  # the recorder

import ggml_golden  # found on the path above

from ggufswap.runtime import QuantizedExperts, QuantizedMatrix, dequantize, float_products
from ggufswap.runtime.kernels import _ggml
from ggufswap.runtime.models.ggml_numerics import GgmlMatrix
from ggufswap.shards.ggml_types import GGMLType

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ggml_golden"
FAMILIES = ("mainline", "ik")
NAME = "blk.0.ffn_up.weight"


@cache
def golden(family: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    manifest = json.loads((FIXTURES / f"{family}.json").read_text())
    with np.load(FIXTURES / f"{family}.npz") as data:
        return manifest, {k: data[k] for k in data.files}


def recorded(family: str) -> list[str]:
    manifest, _ = golden(family)
    return [n for n, t in manifest["types"].items() if t["outcome"] == "recorded"]


CASES = [(family, name) for family in FAMILIES for name in recorded(family)]


def case(family: str, name: str) -> tuple[GGMLType, dict[str, Any], dict[str, np.ndarray]]:
    manifest, arrays = golden(family)
    return GGMLType(manifest["types"][name]["code"]), manifest, arrays


def matrix(family: str, name: str) -> QuantizedMatrix:
    t, manifest, arrays = case(family, name)
    rows, cols = manifest["rows"], manifest["cols"]
    stack = torch.from_numpy(arrays[f"{name}/stack"])
    first = stack[: stack.numel() // manifest["experts"]["n_expert"]]  # expert 0 is the matrix
    return QuantizedMatrix(first, t, (rows, cols), NAME)


def experts(family: str, name: str) -> QuantizedExperts:
    t, manifest, arrays = case(family, name)
    shape = (manifest["experts"]["n_expert"], manifest["rows"], manifest["cols"])
    return QuantizedExperts(torch.from_numpy(arrays[f"{name}/stack"]), t, shape, NAME)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """ggml's products on 1 and 2 threads (restored afterwards), small products included (they
    run on one thread otherwise: ``_ggml.SMALL_PRODUCT_BYTES``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    monkeypatch.setattr(_ggml, "SMALL_PRODUCT_BYTES", 0)
    yield request.param
    torch.set_num_threads(before)


def the_library(family: str) -> _ggml.Library:
    library = _ggml.library()
    if library is None or library.ik != (family == "ik"):
        pytest.skip(f"no {family} libggml here ({_ggml.describe()})")
    return library


def same_build(library: _ggml.Library, manifest: dict[str, Any]) -> bool:
    """The recording's package, on a CPU with the recording's instruction sets."""
    same_cpu = ggml_golden.cpu_flags() == manifest["cpu_flags"]
    return library.package == manifest["package"] and same_cpu


def assert_recorded(got: torch.Tensor, want: np.ndarray, *, exact: bool) -> None:
    expected = torch.from_numpy(want)
    if exact:
        assert torch.equal(got, expected), float((got - expected).abs().max())
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("family", "name"), CASES)
def test_ggml_products_give_the_recorded_bits(family: str, name: str, threads: int) -> None:
    """A matrix in its blocks, multiplied through the loaded libggml, gives ggml's recorded
    products for one, five and forty activation rows on 1 and 2 threads."""
    library = the_library(family)
    t, manifest, arrays = case(family, name)
    exact = same_build(library, manifest)
    blocks = matrix(family, name)
    assert blocks.ggml, f"{t.name} does not go through {library.name}"
    for n in manifest["n_rows"]:
        got = blocks.linear(torch.from_numpy(arrays[f"x{n}"]), dtype=torch.float32)
        assert_recorded(got, arrays[f"{name}/y{n}"], exact=exact)


@pytest.mark.parametrize(("family", "name"), CASES)
def test_ggml_routed_experts_give_the_recorded_bits(family: str, name: str) -> None:
    """A stack of experts multiplied for routed tokens (one mul_mat_id) gives ggml's record."""
    library = the_library(family)
    _, manifest, arrays = case(family, name)
    stack = experts(family, name)
    assert stack.ggml
    got = stack.routed(
        torch.from_numpy(arrays["ex"]), torch.from_numpy(arrays["ids"]), dtype=torch.float32
    )
    assert_recorded(got, arrays[f"{name}/ey"], exact=same_build(library, manifest))


def relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    expected = torch.from_numpy(want).double()
    return float((got.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("name", recorded("mainline"))
def test_without_ggml_the_emulation_comes_within_float_noise(name: str) -> None:
    """Without a libggml, numerics "ggml" emulates mainline's rounding: the recorded products
    to float-summation noise (a rounding tie may flip one 8-bit activation)."""
    _, manifest, arrays = case("mainline", name)
    weights = GgmlMatrix(matrix("mainline", name))
    with float_products():
        assert not weights.blocks.ggml
        for n in manifest["n_rows"]:
            got = weights.linear(torch.from_numpy(arrays[f"x{n}"]))
            assert relative_error(got, arrays[f"{name}/y{n}"]) < 1e-5, n


# How far float products of the decoded weights are from ggml's (relative, over a product):
# ggml's 8-bit activation rounding. Mainline: 0.45-0.95% measured. ik's fork rounds coarser for
# a few activation rows of some types (IQ4_XS 5.4%, IQ5_KS 5.7%, IQ2_KT 4.8%, IQ4_KSS 2.8% at one
# row; 1% at forty); a wrong decoder is off by 100%.
FLOAT_BOUND = {"mainline": 1.5e-2, "ik": 6.5e-2}


@pytest.mark.parametrize(("family", "name"), CASES)
def test_float_products_come_within_activation_rounding(family: str, name: str) -> None:
    """The exact path (decoded weights by float activations: the project's decoders of every
    type) is ggml's product up to ggml's activation rounding."""
    t, manifest, arrays = case(family, name)
    blocks = matrix(family, name)
    w = dequantize(blocks.raw, t, (manifest["cols"], manifest["rows"]), dtype=torch.float32)
    routed_w = dequantize(
        experts(family, name).raw,
        t,
        (manifest["cols"], manifest["rows"], manifest["experts"]["n_expert"]),
        dtype=torch.float32,
    )
    for n in manifest["n_rows"]:
        got = F.linear(torch.from_numpy(arrays[f"x{n}"]), w)
        assert relative_error(got, arrays[f"{name}/y{n}"]) < FLOAT_BOUND[family], n
    ids = torch.from_numpy(arrays["ids"]).long()
    x = torch.from_numpy(arrays["ex"])
    got = torch.einsum("tkrc,tc->tkr", routed_w[ids], x)
    assert relative_error(got, arrays[f"{name}/ey"]) < FLOAT_BOUND[family]


def test_every_type_ggml_multiplies_has_golden_data() -> None:
    """A type goes through ggml only where its products were recorded for that library family."""
    mainline, ik = set(recorded("mainline")), set(recorded("ik"))
    assert {t.name for t in _ggml.MAINLINE_TYPES} <= mainline & ik
    assert {t.name for t in _ggml.IK_TYPES} <= ik


def test_small_products_run_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product under SMALL_PRODUCT_BYTES (weight bytes times rows) takes one thread, a larger
    one torch's count: waking idle workers for a decode step's small matrices costs more."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert _ggml.threads(_ggml.SMALL_PRODUCT_BYTES - 1) == 1
    assert _ggml.threads(_ggml.SMALL_PRODUCT_BYTES) == 2
    assert _ggml.threads() == 2


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_routing_ids_written_in_place_are_checked_again(inference: bool) -> None:
    """The routing's int32 copy, kept for a layer's three products, is made again when the same
    ids tensor was written in place since (inference tensors included, which keep no version
    counter): a reused buffer never serves stale or unchecked ids."""
    with torch.inference_mode(inference):
        _routing_ids_written_in_place_are_checked_again()


def _routing_ids_written_in_place_are_checked_again() -> None:
    ids = torch.tensor([[0, 1]])
    assert _ggml._expert_ids(ids, 4).tolist() == [[0, 1]]
    assert _ggml._expert_ids(ids, 4) is _ggml._expert_ids(ids, 4)  # the same step: kept
    ids[0, 1] = 3
    assert _ggml._expert_ids(ids, 4).tolist() == [[0, 3]]
    ids[0, 0] = 7
    with pytest.raises(ValueError, match="outside"):
        _ggml._expert_ids(ids, 4)
