"""Every architecture's tiny model runs in the reference server's real processes.

For each preset (llama dense, with ``rope_freqs``, Mixtral stacked and per-expert, qwen2, qwen3,
qwen2moe, qwen3moe, gemma3, deepseek2 in both MLA file forms, glm4moe, gpt-oss) three processes
run on the files the writer makes: ``ggufswap runtime --mode http`` answers a greedy completion
with the text an in-process server gives; ``ggufswap runtime --mode perplexity`` reports for
weight version 0 the perplexity an in-process evaluation of its stream gives; and ``ggufswap
perplexity`` prints the perplexity of the same text windows evaluated in this process. The three
processes start together and the references are computed while they load; a module's zygote
(tests/zygote.py: one ``import torch`` for the worker) forks them, each running the
``ggufswap`` entry point, so a case costs no interpreter start. The first preset's two runtimes
are fresh interpreters: each mode is seen to start and exit 0 as the installed command. Every
wait has a timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from processes import Proc, status_of, wait_for
from runtime_helpers import ModelDir, one_thread
from test_http import WAIT_S, complete, start_server
from test_perplexity_cmd import license_text, reference
from zygote import Child, Zygote

from ggufswap.runtime import HotSwapRuntime, Storage
from ggufswap.runtime.serving.daemon import served_model
from ggufswap.runtime.serving.perplexity import make_eval_tokens, perplexity
from ggufswap.runtime.serving.serve import ServeOptions
from ggufswap.shards import ModelSpec
from ggufswap.shards.presets import (
    tiny_arch,
    tiny_deepseek2,
    tiny_dense,
    tiny_glm4moe,
    tiny_gpt_oss,
    tiny_llama3,
    tiny_moe,
    tiny_qwen35moe,
)

pytestmark = [pytest.mark.process, pytest.mark.usefixtures(one_thread.__name__)]

START_S = 90.0  # a runtime process loads the model on a busy machine
STOP_S = 60.0  # a runtime that logged runtime.stopped took over 15 s to exit on 2 busy cores
CTX = 32
# The processes run on one torch thread (the zygote's OMP_NUM_THREADS=1, ENV for a fresh one), as
# the in-process references do.
ENV = {"OMP_NUM_THREADS": "1"}

PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "llama": tiny_dense,
    "llama-rope-freqs": tiny_llama3,
    "mixtral": lambda: tiny_moe(arch="llama"),
    "mixtral-per-expert": lambda: tiny_moe(arch="llama", per_expert_tensors=True),
    "qwen2": lambda: tiny_arch("qwen2"),
    "qwen3": lambda: tiny_arch("qwen3"),
    "qwen2moe": lambda: tiny_arch("qwen2moe"),
    "qwen3moe": tiny_moe,
    "gemma3": lambda: tiny_arch("gemma3"),
    "deepseek2": tiny_deepseek2,  # attn_k_b / attn_v_b
    "deepseek2-kv-b": lambda: tiny_deepseek2(mla_split=False),
    "glm4moe": tiny_glm4moe,
    "gpt-oss": tiny_gpt_oss,
    "qwen35moe": tiny_qwen35moe,  # delta-net state through the server's per-request caches
    "glm-dsa": lambda: tiny_arch("glm-dsa"),  # the indexer's keys in the per-request caches
}


def start_runtime(
    zygote: Zygote | None, tmp: Path, first: Path, mode: str, *extra: str
) -> tuple[Child | Proc, str]:
    """``ggufswap runtime --mode MODE`` forked by ``zygote``, or a fresh interpreter (None)."""
    run_dir = tmp / f"run-{mode}"
    run_dir.mkdir()
    control = f"ipc://{run_dir}/rt.sock"
    config = tmp / f"{mode}.yaml"
    config.write_text(f"runtime:\n  name: tiny\n  model: {first}\n  control_endpoint: {control}\n")
    args = ["runtime", "--config", str(config), "--mode", mode, "--threads", "1", *extra]
    log = tmp / f"{mode}.log"
    if zygote is None:
        return Proc(args, log=log, env=ENV, fresh=True), control
    return zygote.spawn(args, log=log), control


def stream_perplexity(first: Path) -> float:
    """What ``runtime --mode perplexity`` reports for a fresh load: its evaluation stream
    (``ServeOptions``' defaults) evaluated in this process."""
    options = ServeOptions()
    runtime = HotSwapRuntime.open(first, storage=Storage.AUTO)  # the configuration's default
    try:
        model = served_model(runtime)  # numerics: auto, as the runtime serves
        config = model.config
        stream = make_eval_tokens(config.n_vocab, options.eval_tokens, options.seed)
        return perplexity(model, stream, ctx=options.eval_ctx, batch_size=options.eval_batch)
    finally:
        runtime.close()


def first_result(control: str) -> dict[str, Any] | None:
    """Version 0's perplexity result from a runtime's status, once a pass has completed."""
    status = status_of(control)
    result = (status or {}).get("serve", {}).get("results", {}).get("0", {})
    return result if "perplexity" in result else None


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_architecture_runs_in_the_reference_server(
    tmp_path: Path, preset: str, zygote: Zygote
) -> None:
    """HTTP completions, the runtime's perplexity mode and ``ggufswap perplexity`` all run the
    preset's files and give what the decoder gives in this process."""
    models = ModelDir.write(tmp_path / "model", PRESETS[preset]())
    text = tmp_path / "english.txt"
    text.write_text(license_text()[:1500], encoding="utf-8")
    forks = None if preset == next(iter(PRESETS)) else zygote  # the first: fresh interpreters
    http, http_control = start_runtime(forks, tmp_path, models.first, "http", "--http-port", "0")
    ppl, ppl_control = start_runtime(forks, tmp_path, models.first, "perplexity")
    printed = tmp_path / "perplexity-command.out"
    command = zygote.spawn(
        ["perplexity", "--model", str(models.first), "--text", str(text),
         "--ctx", str(CTX), "--batch", "4", "--json"],
        log=tmp_path / "perplexity-command.log",
        out=printed,
    )  # fmt: skip
    try:
        for served in start_server(models.first):
            expected = complete(served.port, max_tokens=6, temperature=0)
        windows_ppl = reference(models.first, text, ctx=CTX, batch=4)
        stream_ppl = stream_perplexity(models.first)

        assert command.wait(START_S) == 0, command.log()
        (line,) = printed.read_text().splitlines()
        result = json.loads(line)
        assert result["weight_version"] == 0
        assert result["perplexity"] == pytest.approx(windows_ppl, rel=1e-9)

        status = wait_for(
            lambda: (s := status_of(http_control)) is not None and "http" in s and s,
            timeout=START_S,
            what=f"the {preset} runtime to serve HTTP",
        )
        reply = complete(status["http"]["port"], max_tokens=6, temperature=0)
        assert reply["weight_version"] == 0
        assert reply["choices"] == expected["choices"]
        assert reply["usage"] == expected["usage"]

        measured = wait_for(
            lambda: first_result(ppl_control),
            timeout=START_S + WAIT_S,
            what=f"the {preset} runtime's first perplexity pass",
        )
        assert measured["perplexity"] == pytest.approx(stream_ppl, rel=1e-9)
    finally:
        command.kill()
        codes = {"http": http.stop(timeout=STOP_S), "perplexity": ppl.stop(timeout=STOP_S)}
    assert codes == {"http": 0, "perplexity": 0}, (http.log(), ppl.log())
