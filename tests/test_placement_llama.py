"""llama.cpp's placement vocabulary places tensors as llama.cpp does for the same flags, with CPU
pools standing in for GPUs (the pools before the fallback are CUDA0, CUDA1, ...; the fallback
pool is llama.cpp's CPU).

The reference below is llama.cpp's own rule, written out from its sources (ggml-org/llama.cpp):

- ``src/llama-model.cpp``, ``load_tensors``: ``i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)``,
  ``act_gpu_layers = min(n_gpu_layers, n_layer + 1)``; layer ``il`` is on the CPU when
  ``il < i_gpu_start || il - i_gpu_start >= act_gpu_layers``, else on device
  ``upper_bound(splits, (il - i_gpu_start) / act_gpu_layers)``; ``dev_input`` is the CPU and
  ``dev_output = get_layer_buft_list(n_layer)``;
- the split points: ``tensor_split`` summed then divided by its sum (``splits[i] /= split_sum``);
- ``create_tensor``: the first ``tensor_buft_overrides`` pattern that ``std::regex_search`` finds
  in the name chooses the buffer;
- ``common/common.h``: ``LLM_FFN_EXPS_REGEX = "\\.ffn_(up|down|gate|gate_up)_(ch|)exps"``
  (``--cpu-moe``) and ``llm_ffn_block_regex(i, ...) = "blk\\.%d" + it`` (``--n-cpu-moe``).
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path

import pytest
import torch
from processes import PROBE_YAML
from runtime_helpers import ModelDir, Q, logits, one_thread, open_runtime, slot_states

from ggufswap.config import ConfigError, PlacementConfig, load_config_text
from ggufswap.config.llama_args import translate
from ggufswap.config.schema import OverrideRule
from ggufswap.runtime import Placement, PlanState, Pool, PoolSet, SlotState, Storage, TensorStore
from ggufswap.runtime.errors import PlacementError
from ggufswap.shards import open_shard_set, tiny_dense, tiny_moe

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CPU = torch.device("cpu")
N_LAYER = 4  # tiny_moe's blocks; llama.cpp's layer 4 is the output layer
EXPS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def llama_cpp_layer(name: str, *, tied: bool) -> int | None:
    """llama.cpp's layer of a tensor: its block, n_layer for the output layer, None for the input
    layer (token_embd, unless the output head is tied to it: the duplicate lives on dev_output)."""
    match = re.match(r"blk\.(\d+)\.", name)
    if match:
        return int(match[1])
    if name == "token_embd.weight" and not tied:
        return None
    return N_LAYER


def llama_cpp_device(
    name: str,
    *,
    n_gpu_layers: int,
    split: list[float],
    rules: list[tuple[str, str]] = (),  # type: ignore[assignment]  # (regex, device)
    tied: bool = False,
) -> str:
    """The device llama.cpp gives ``name``: "CPU" or "CUDA<i>"."""
    for pattern, device in rules:
        if re.search(pattern, name):
            return device
    il = llama_cpp_layer(name, tied=tied)
    if il is None:
        return "CPU"
    i_gpu_start = max(N_LAYER + 1 - n_gpu_layers, 0)
    act_gpu_layers = min(n_gpu_layers, N_LAYER + 1)
    if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
        return "CPU"
    total, running, splits = sum(split), 0.0, []
    for share in split:
        running += share
        splits.append(running / total)
    return f"CUDA{bisect.bisect_right(splits, (il - i_gpu_start) / act_gpu_layers)}"


POOL_OF = {"CUDA0": "gpu0", "CUDA1": "gpu1", "CPU": "host"}


def homes(model: Path, placement: Placement, *, devices: int = 1) -> dict[str, str]:
    """Tensor -> pool the store's placement chooses (unbounded pools: no budget moves one)."""
    pools = [Pool(f"gpu{i}", CPU, budget=1 << 40) for i in range(devices)]
    store = TensorStore(
        pools=PoolSet([*pools, Pool("host", CPU)]),
        storage=Storage.NATIVE,
        compute_dtype=torch.float32,
        strict=False,
    )
    records = list(open_shard_set(model).tensors.values())
    chosen = store.plan_placement(records, placement, N_LAYER)
    out = {}
    for name, home in chosen.items():
        assert isinstance(home, Pool), name
        out[name] = home.name
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir.write(tmp_path_factory.mktemp("moe"), tiny_moe())


@pytest.mark.parametrize("ngl", [0, 1, 2, 3, 5, 99])
def test_gpu_layers_offload_the_output_first_then_the_last_blocks(moe: ModelDir, ngl: int) -> None:
    """gpu_layers N places every tensor where llama.cpp's -ngl N does: -ngl 1 the output layer
    alone, -ngl 2 the output and the last block, ...; token_embd always on the CPU."""
    got = homes(moe.first, Placement(gpu_layers=ngl))
    for name, pool in got.items():
        assert pool == POOL_OF[llama_cpp_device(name, n_gpu_layers=ngl, split=[1])], name
    if ngl == 1:
        on_gpu = {n for n, p in got.items() if p == "gpu0"}
        assert on_gpu == {"output.weight", "output_norm.weight"}
    assert got["token_embd.weight"] == "host"


def test_all_and_auto_on_room_offload_everything_but_the_input(moe: ModelDir) -> None:
    """gpu_layers: all is -ngl all; auto with room to spare is the same (--fit changes
    nothing that fits)."""
    every = homes(moe.first, Placement(gpu_layers="all"))
    assert homes(moe.first, Placement(gpu_layers="auto")) == every
    assert {n for n, p in every.items() if p == "host"} == {"token_embd.weight"}


@pytest.mark.parametrize("split", [[3, 1], [1, 1], [1, 3], [0, 1]], ids=str)
@pytest.mark.parametrize("ngl", [3, 99])
def test_tensor_split_divides_the_offloaded_layers_as_llama_cpp(
    moe: ModelDir, split: list[float], ngl: int
) -> None:
    """tensor_split over two GPU pools gives each offloaded layer the device llama.cpp's
    upper_bound over the normalized cumulative split gives it."""
    got = homes(moe.first, Placement(gpu_layers=ngl, tensor_split=tuple(split)), devices=2)
    for name, pool in got.items():
        assert pool == POOL_OF[llama_cpp_device(name, n_gpu_layers=ngl, split=split)], name
    if split == [3, 1] and ngl == 99:  # layers 0-3 (3/4 of 5 layers) on CUDA0, output on CUDA1
        assert got["blk.3.attn_q.weight"] == "gpu0"
        assert got["output.weight"] == "gpu1"


RULES = {
    "exps=CPU": [(r"exps", "CPU")],
    "first match wins": [(r"blk\.0\.", "CUDA1"), (r"blk\.[0-9]\.ffn", "CPU")],
    "attention to CUDA1": [(r"attn_(q|k|v)\.", "CUDA1")],
}


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES.keys())
def test_override_tensor_rules_match_in_order_first_wins(
    moe: ModelDir, rules: list[tuple[str, str]]
) -> None:
    """override_tensor rules (-ot REGEX=BUFFER) send each tensor where the first rule whose
    regex is found in its name says, else where its layer is."""
    placement = Placement(
        gpu_layers=99, override_tensor=tuple(OverrideRule(p, t) for p, t in rules)
    )
    got = homes(moe.first, placement, devices=2)
    for name, pool in got.items():
        device = llama_cpp_device(name, n_gpu_layers=99, split=[1, 1], rules=rules)
        assert pool == POOL_OF[device], name


@pytest.mark.parametrize("n", [0, 1, 2, 4, 9])
def test_n_cpu_moe_and_cpu_moe_keep_experts_of_the_first_blocks_on_the_cpu(
    moe: ModelDir, n: int
) -> None:
    """n_cpu_moe N keeps the experts of blocks 0..N-1 on the CPU and cpu_moe every expert,
    as their llama.cpp regexes do; the rest follows -ngl."""
    got = homes(moe.first, Placement(gpu_layers=99, n_cpu_moe=n))
    rules = [(rf"blk\.{i}{EXPS.pattern}", "CPU") for i in range(n)]
    for name, pool in got.items():
        assert pool == POOL_OF[llama_cpp_device(name, n_gpu_layers=99, split=[1], rules=rules)]
    every = homes(moe.first, Placement(gpu_layers=99, cpu_moe=True))
    assert {n for n, p in every.items() if p == "host"} == {
        name for name in every if EXPS.search(name)
    } | {"token_embd.weight"}


def test_a_tied_output_head_places_token_embd_with_the_output_layer(tmp_path: Path) -> None:
    """Without output.weight, token_embd is llama.cpp's output head too (its duplicate lives on
    dev_output): -ngl 1 puts it on the GPU, -ngl 0 on the CPU."""
    model = ModelDir.write(tmp_path / "tied", tiny_dense(n_layers=N_LAYER, tied_output=True))
    assert "output.weight" not in model.records()
    assert homes(model.first, Placement(gpu_layers=1))["token_embd.weight"] == "gpu0"
    assert homes(model.first, Placement(gpu_layers=0))["token_embd.weight"] == "host"


def test_an_override_naming_no_pool_is_refused(moe: ModelDir) -> None:
    """A rule whose target is neither a pool, CPU nor CUDA<i> of a pool is refused at load,
    naming the targets there are."""
    bad = Placement(override_tensor=(OverrideRule("exps", "CUDA7"),))
    with pytest.raises(PlacementError, match="'CUDA7' names no pool; targets: gpu0, host, CP"):
        homes(moe.first, bad)


def test_fit_moves_the_first_blocks_experts_then_the_layers(tmp_path: Path) -> None:
    """gpu_layers: auto fits the GPU pools' room: an MoE model keeps every layer on the GPU and
    sends the experts of as few leading blocks as needed to the CPU; a dense model offloads as
    many layers (the output first) as fit."""
    model = ModelDir.write(tmp_path / "moe", tiny_moe())
    sizes = {n: r.nbytes for n, r in model.records().items()}
    dense = sum(s for n, s in sizes.items() if not EXPS.search(n) and n != "token_embd.weight")
    per_block_experts = sum(
        s for n, s in sizes.items() if n.startswith("blk.0.") and EXPS.search(n)
    )
    for keep in (3, 1, 0):  # blocks whose experts fit beside every dense tensor
        budget = dense + keep * per_block_experts
        runtime, _ = open_runtime(
            model.first,
            storage=Storage.NATIVE,
            pools=[Pool("gpu0", CPU, budget=budget), Pool("host", CPU)],
            placement=Placement(gpu_layers="auto"),
        )
        try:
            got = {n: s.home.name for n, s in runtime.store.slots.items()}
            on_cpu = {n for n, p in got.items() if p == "host"}
            moved = {n for n in sizes if EXPS.search(n) and int(n.split(".")[1]) < N_LAYER - keep}
            assert on_cpu == moved | {"token_embd.weight"}, keep
            assert runtime.store.pools["gpu0"].used <= budget
        finally:
            runtime.close()
    dense_model = ModelDir.write(tmp_path / "dense", tiny_dense(n_layers=N_LAYER))
    dsizes = {n: r.nbytes for n, r in dense_model.records().items()}
    output = dsizes["output.weight"] + dsizes["output_norm.weight"]
    block = sum(s for n, s in dsizes.items() if n.startswith("blk.3."))
    runtime, _ = open_runtime(
        dense_model.first,
        storage=Storage.NATIVE,
        pools=[Pool("gpu0", CPU, budget=output + block + 16), Pool("host", CPU)],
        placement=Placement(gpu_layers="auto"),
    )
    try:
        on_gpu = {n for n, s in runtime.store.slots.items() if s.home.name == "gpu0"}
        assert on_gpu == {"output.weight", "output_norm.weight"} | {
            n for n in dsizes if n.startswith("blk.3.")
        }  # -ngl 2: the output layer and the last block
    finally:
        runtime.close()


def test_swaps_keep_each_tensors_rule(tmp_path: Path) -> None:
    """Under -ot exps=CPU with room left on the GPU pool, an expert that grows stays in the CPU
    pool (its rule's), a dense tensor that grows stays on the GPU pool, and the logits equal a
    fresh load placed the same way."""
    model = ModelDir.write(tmp_path / "model")
    placement = Placement(gpu_layers="all", override_tensor=(OverrideRule("exps", "CPU"),))
    pools = [Pool("gpu0", CPU), Pool("host", CPU)]
    runtime, net = open_runtime(
        model.first, storage=Storage.NATIVE, pools=pools, placement=placement
    )
    try:
        down, attn = "blk.1.ffn_down_exps.weight", "blk.2.attn_k.weight"
        for name in (down, attn):
            model.put(name, model.variant(name, Q.F16, tmp_path / "variants"))
        ticket = runtime.apply(model.plan("grow", [down, attn]))
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        slots = runtime.store.slots
        assert slot_states(runtime, (down, attn)) == {SlotState.DETACHED}
        assert (slots[down].active.pool.name, slots[attn].active.pool.name) == ("host", "gpu0")
        fresh, fresh_net = open_runtime(
            model.first,
            storage=Storage.NATIVE,
            pools=[Pool("gpu0", CPU), Pool("host", CPU)],
            placement=placement,
        )
        try:
            assert torch.equal(logits(net), logits(fresh_net))
            assert {n: s.home.name for n, s in fresh.store.slots.items()} == {
                n: s.home.name for n, s in slots.items()
            }
        finally:
            fresh.close()
    finally:
        runtime.close()


def test_llama_args_translate_into_the_same_placement_as_the_yaml_keys(moe: ModelDir) -> None:
    """A llama.cpp command line gives the placement the YAML keys give, its rules in
    command-line order (-ot, --cpu-moe, --n-cpu-moe append to one list), -t the threads and
    -c/-b llama-perplexity's window and sequences per forward."""
    args = translate(
        "llama-perplexity -ngl 3 -ot 'blk\\.0\\.=CUDA1' --n-cpu-moe 2 -ts 3/1 -t 4 -c 512 -b 2048"
    )
    placement = args.placement(PlacementConfig())
    assert placement == PlacementConfig(
        gpu_layers=3,
        override_tensor=(
            OverrideRule(r"blk\.0\.", "CUDA1"),
            OverrideRule(r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),
            OverrideRule(r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),
        ),
        tensor_split=(3.0, 1.0),
    )
    assert (args.threads, args.windows(64)) == (4, (512, 4))
    yaml = load_config_text(
        "runtime:\n  model: m.gguf\n  pools: [{name: gpu0, device: cpu}, {name: gpu1, device: cpu},"
        " {name: host, device: cpu}]\n  placement:\n    gpu_layers: 3\n"
        "    override_tensor: ['blk\\.0\\.=CUDA1']\n    n_cpu_moe: 2\n    tensor_split: [3, 1]\n",
        source="/tmp/x.yaml",
    ).require_runtime()
    from_yaml = homes(moe.first, yaml.placement, devices=2)
    assert from_yaml == homes(moe.first, placement, devices=2)
    assert from_yaml["blk.0.ffn_up_exps.weight"] == "gpu1"  # -ot came first: it wins
    assert from_yaml["blk.1.ffn_up_exps.weight"] == "host"
    assert translate("-fit off").placement(PlacementConfig()).gpu_layers == "all"
    assert translate("").placement(PlacementConfig()).gpu_layers == "auto"


def test_llama_args_refuse_every_flag_not_honoured_by_name() -> None:
    """Flags the runtime does not honour are refused together, each named with why."""
    with pytest.raises(ConfigError) as caught:
        translate("-m model.gguf -ngl 99 --mlock -f wiki.txt -sm row -ngl -1 --cpu-moe")
    text = str(caught.value)
    for flag in ("-m", "--mlock", "-f", "-sm", "-ngl"):
        assert f"--llama-args: {flag}:" in text, flag
    assert "runtime.model" in text
    assert "llama.cpp's -1 is 'auto'" in text


def test_yaml_keys_are_checked_with_their_lines() -> None:
    """Bad placement keys are reported with their line: a negative gpu_layers (the meaning of -1
    changed), a bad regex, a rule naming no pool, more split proportions than GPU pools."""
    text = (
        "runtime:\n  model: m.gguf\n"
        "  pools: [{name: gpu0, device: cpu}, {name: host, device: cpu}]\n"
        "  placement:\n    gpu_layers: -1\n    override_tensor: ['exps=CPU', '(=gpu0', 'x=gpux']\n"
        "    tensor_split: [1, 1]\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, source="/tmp/p.yaml")
    lines = str(caught.value).splitlines()
    assert any(":5: runtime.placement.gpu_layers:" in line for line in lines)
    assert any("override_tensor[1]: bad regular expression" in line for line in lines)
    assert any("override_tensor[2]: 'gpux' names no pool" in line for line in lines)
    assert any(
        "runtime.placement.tensor_split: 2 proportions for 1 GPU pool" in line for line in lines
    )


def test_runtime_command_refuses_flags_it_does_not_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ggufswap runtime --llama-args` exits 2 before loading anything, naming every refused
    flag (-c outside perplexity mode too); honoured flags become the runtime's placement and
    threads."""
    from ggufswap.main import build_parser

    def runtime(flags: str) -> int:
        args = build_parser().parse_args(
            ["runtime", "--config", str(config), "--llama-args", flags]
        )
        code: int = args.func(args)
        return code

    model = ModelDir.write(tmp_path / "m", tiny_dense())
    config = tmp_path / "r.yaml"
    config.write_text(f"runtime:\n  model: {model.first}\n  serve: {PROBE_YAML}\n")
    assert runtime("-ngl 9 --mlock -fa on") == 2
    err = capsys.readouterr().err
    assert "--llama-args: --mlock: '--mlock' is refused" in err
    assert "--llama-args: -fa: '-fa on' is refused" in err
    assert runtime("-c 512") == 2
    assert "-c and -b size the perplexity mode's windows, not probe mode" in capsys.readouterr().err
    from ggufswap._cmd_runtime import with_llama_args
    from ggufswap.config import load_config

    loaded = load_config(config)
    placed, _ = with_llama_args(loaded, loaded.require_runtime().serve, "-ngl 2 -ot exps=CPU -t 3")
    rc = placed.require_runtime()
    assert (rc.placement.gpu_layers, rc.placement.override_tensor, rc.threads) == (
        2,
        (OverrideRule("exps", "CPU"),),
        3,
    )
