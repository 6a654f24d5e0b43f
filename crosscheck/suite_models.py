"""Which of the GGUF Tool Suite's text models the project reads, by tensor name (issue 25).

``.venv/bin/python crosscheck/suite_models.py <Suite git dir>`` (a bare clone of
Thireus/GGUF-Tool-Suite; nothing is downloaded). For each model of ``models/models.txt`` (not
``mmproj-*``): the names its ``kld_results.csv`` / ``ppl_results.csv`` headers list (quantizable
tensors only), else its ``*.recipe`` regexes' (expanded over the blocks); the recipes' names are
checked too. The architecture comes from the upstream family (``FAMILIES``), the block layout
(dense lead, hybrid / sliding-window pattern, indexer blocks, tied head, MLA form) from the names;
the writer plans a tiny model of that layout (``plan_tensors``: what llama.cpp's loader creates)
and the architecture's decoder is built over zeros of those shapes. A name is *read* when the
decoder's forward reads it (``DecoderStack.required``), *loaded* when planned but never read
(trailing NextN/MTP blocks, ik's ``attn_kv_b``), else *not read*. Shapes and metadata keys are
not in the Suite: unchecked. docs/models.md records what it printed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch

from ggufswap.runtime.models.blocks.weights import DictWeightProvider
from ggufswap.runtime.models.errors import ModelError
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.models.registry import build_model
from ggufswap.shards import presets
from ggufswap.shards.keys import Arch
from ggufswap.shards.writer import ModelSpec, model_metadata, plan_tensors

# Upstream family (the model's folder name) -> llama.cpp architecture, first match wins, and the
# trailing NextN/MTP blocks its GGUF keeps (GLM: num_nextn_predict_layers 1, converted as blocks
# of their own; DeepSeek / Kimi's MTP layer is dropped by the converter). Checked against
# conversion/{glm,deepseek,qwen,qwen3vl,gemma}.py of the llama.cpp llama-cpp-python 0.3.36 vendors.
FAMILIES: tuple[tuple[str, Arch, int, Any], ...] = (
    (r"GLM-5\.", Arch.GLM_DSA, 1, presets.tiny_glm_dsa),  # MLA + the DSA indexer
    (r"GLM-4\.7-Flash", Arch.DEEPSEEK2, 0, presets.tiny_deepseek2),  # Glm4MoeLiteForCausalLM
    (r"GLM-4\.[567]", Arch.GLM4MOE, 1, presets.tiny_glm4moe),
    (r"DeepSeek-V3\.2", Arch.DEEPSEEK32, 0, presets.tiny_deepseek32),
    (r"DeepSeek-|Kimi-K2", Arch.DEEPSEEK2, 0, presets.tiny_deepseek2),  # R1, V2/V3, Chimera
    (r"Qwen3\.[568]-[0-9.]+[BT]-A[0-9]+B", Arch.QWEN35MOE, 0, presets.tiny_qwen35moe),
    (r"Qwen3\.[568]-", Arch.QWEN35, 0, presets.tiny_qwen35),
    (r"Qwen3-VL-", Arch.QWEN3VLMOE, 0, presets.tiny_qwen3vlmoe),  # the text tower
    (r"Qwen3-.*-A[0-9]+B", Arch.QWEN3MOE, 0, presets.tiny_moe),
    (r"Qwen3-[0-9]+B", Arch.QWEN3, 0, lambda **kw: presets.tiny_arch(Arch.QWEN3, **kw)),
    (r"gemma-4-", Arch.GEMMA4, 0, presets.tiny_gemma4),
)
BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def git(git_dir: str, *args: str) -> str | None:
    """``git --git-dir=git_dir args``' output, or None when it fails (no such file)."""
    cmd = [shutil.which("git") or "git", f"--git-dir={git_dir}", *args]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else None


def recipe_names(text: str, max_blocks: int = 128) -> set[str]:
    """The tensor names a recipe's ``regex=type`` lines match, blocks 0 .. max_blocks - 1."""
    names: set[str] = set()
    for line in text.splitlines():
        pattern = line.split("=", 1)[0].strip().removeprefix("^").removesuffix("$")
        if not pattern or pattern.startswith("#") or "=" not in line:
            continue
        m = re.fullmatch(r"blk\\\.(.+?)\\\.([a-z0-9_]+(?:\\\.[a-z0-9_]+)*)", pattern)
        if m is None:  # a name outside the blocks, or a catch-all such as .*
            if re.fullmatch(r"[a-z0-9_]+(\\\.[a-z0-9_]+)*", pattern):
                names.add(pattern.replace("\\.", "."))
            continue
        suffix = m.group(2).replace("\\.", ".")
        blocks = [f"blk.{b}.{suffix}" for b in range(max_blocks)]
        names.update(n for n in blocks if re.fullmatch(pattern, n))
    return names


def listed_names(git_dir: str, model: str) -> tuple[set[str], str]:
    """The names the model's CSV headers list (else its recipes'), and where they came from."""
    names: set[str] = set()
    sources = []
    for csv in ("kld_results.csv", "ppl_results.csv"):
        text = git(git_dir, "show", f"HEAD:models/{model}/{csv}")
        header = text.splitlines()[0].split(",")[1:] if text else []
        if any(header):
            names.update(h.strip() for h in header if h.strip())
            sources.append(csv.split("_")[0])
    if names:
        return names, "+".join(sources)
    names, used = recipe_tensors(git_dir, model, 128)
    return names, "+".join(used) or "none"


def recipe_tensors(git_dir: str, model: str, max_blocks: int) -> tuple[set[str], list[str]]:
    """The names the model's ``*.recipe`` files match (blocks below ``max_blocks``), the files."""
    tree = git(git_dir, "show", f"HEAD:models/{model}/") or ""  # "tree ...", then the entries
    recipes = [p for p in tree.split() if p.endswith(".recipe")]
    texts = (git(git_dir, "show", f"HEAD:models/{model}/{path}") or "" for path in recipes)
    return set().union(*(recipe_names(t, max_blocks) for t in texts)), recipes


def family_of(model: str) -> tuple[Arch, int, Any]:
    """(architecture, trailing NextN blocks, preset) of the first family ``model`` matches."""
    found = [(arch, n, preset) for pat, arch, n, preset in FAMILIES if re.match(pat, model)]
    return found[0] if found else sys.exit(f"{model}: no line of FAMILIES matches it; add one")


def layout_of(arch: Arch, names: set[str]) -> tuple[int, dict[int, set[str]], str]:
    """(blocks, each block's tensor kinds, the MLA file form) that ``names`` show."""
    by_block: dict[int, set[str]] = defaultdict(set)
    for name in names:
        if m := BLOCK.fullmatch(name):
            by_block[int(m.group(1))].add(m.group(2).removesuffix(".weight"))
    n_blocks = max(by_block, default=-1) + 1
    kinds = {BLOCK.sub(r"\2", n).removesuffix(".weight") for n in names}
    form = "mainline"
    if arch in (Arch.DEEPSEEK2, Arch.DEEPSEEK32, Arch.GLM_DSA):
        if "attn_kv_b" in kinds:
            form = "ik attn_kv_b+k_b/v_b" if kinds & {"attn_k_b", "attn_v_b"} else "attn_kv_b"
        elif kinds & {"attn_k_b", "attn_v_b"}:
            form = "split attn_k_b/v_b"
        else:
            form = "MLA form unknown"
    return n_blocks, dict(by_block), form


def pattern_interval(blocks: list[int], n: int) -> int:
    """The N of 'every Nth block' that ``blocks`` follow (ValueError when they do not)."""
    interval = blocks[0] + 1 if blocks else n + 1
    if blocks != [i for i in range(n) if (i + 1) % interval == 0]:
        raise ValueError(f"blocks {blocks} are not every {interval}th")
    return interval


def spec_for(
    arch: Arch, preset: Any, by_block: dict[int, set[str]], *, form: str, tied: bool, trunk: int
) -> ModelSpec:
    """The tiny spec of ``arch`` with the listed names' trunk layout."""
    fields: dict[str, Any] = {"n_layers": trunk}
    kinds_of = {b: by_block.get(b, set()) for b in range(trunk)}
    moe = [b for b, k in kinds_of.items() if any(n.endswith("_exps") for n in k)]
    if arch in (Arch.DEEPSEEK2, Arch.DEEPSEEK32, Arch.GLM_DSA, Arch.GLM4MOE):
        fields["n_dense_lead"] = moe[0] if moe else 0
    if arch is Arch.GLM4MOE:  # per-head Q/K norms and Q/K/V biases are optional
        fields["attn_qk_norm"] = any("attn_q_norm" in k for k in kinds_of.values())
        fields["attn_bias"] = any("attn_q.bias" in k for k in kinds_of.values())
    if form.startswith("ik"):
        fields |= {"mla_split": False, "mla_ik": True}
    elif form == "attn_kv_b":
        fields["mla_split"] = False
    if arch is Arch.GLM_DSA:
        fields["indexer_types"] = tuple(
            any(k.startswith("indexer.") for k in kinds_of[b]) for b in range(trunk)
        )
    if arch in (Arch.QWEN35, Arch.QWEN35MOE):
        full = [b for b, k in kinds_of.items() if "attn_q" in k]
        fields["full_attention_interval"] = pattern_interval(full, trunk)
    if arch is Arch.GEMMA4:
        full = [b for b, k in kinds_of.items() if "attn_q" in k and "attn_v" not in k]
        fields["full_attention_interval"] = pattern_interval(full, trunk)
    fields["tied_output"] = tied
    spec: ModelSpec = preset(**fields)
    return spec


def read_names(spec: ModelSpec) -> tuple[set[str], set[str]]:
    """(the names the writer plans, those the decoder's forward reads) for ``spec``."""
    planned = plan_tensors(spec)
    md = {key: typed.value for key, typed in model_metadata(spec)}
    weights = DictWeightProvider(
        {t.name: torch.zeros(tuple(reversed(t.ne)), dtype=torch.float32) for t in planned}
    )
    model = build_model(HParams.from_metadata(md), weights)
    return {t.name for t in planned}, set(model.required)


def group(names: set[str]) -> str:
    """``names`` by pattern: ``blk.{0..2,5}.ffn_up.weight`` style, one per tensor kind."""
    blocks: dict[str, list[int]] = defaultdict(list)
    for name in names:
        m = BLOCK.fullmatch(name)
        blocks[m.group(2) if m else name].append(int(m.group(1)) if m else -1)
    parts = []
    for kind, ids in sorted(blocks.items()):
        found = sorted(i for i in ids if i >= 0)
        parts.append(f"blk.{{{compact(found)}}}.{kind}" if found else kind)
    return "; ".join(parts)


def compact(ids: list[int]) -> str:
    """``0,1,2,5`` as ``0..2,5``."""
    runs = [[b for _, b in g] for _, g in groupby(enumerate(ids), lambda p: p[1] - p[0])]
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


@dataclass
class Row:
    model: str
    arch: str
    form: str
    source: str
    listed: int
    read: int
    loaded: set[str]  # loaded, never read: NextN blocks', ik's attn_kv_b
    unread: set[str]  # not in the plan llama.cpp's loader has for the architecture
    recipe: str  # the recipes' names: "read/listed" (norms, biases, routers included)
    verdict: str


def classify(
    names: set[str], read: set[str], planned: set[str], trunk: int
) -> tuple[set[str], ...]:
    """``names`` as (read, loaded and never read, not in the plan)."""
    nextn = {n for n in names if (m := BLOCK.fullmatch(n)) and int(m.group(1)) >= trunk}
    return names & read - nextn, nextn | (names & planned - read), names - read - planned - nextn


def check(git_dir: str, model: str) -> Row:
    """One model's row: its names against what the project's decoder reads."""
    arch, nextn_blocks, preset = family_of(model)
    names, source = listed_names(git_dir, model)
    recipe, _ = recipe_tensors(git_dir, model, layout_of(arch, names)[0] or 128)
    n_blocks, by_block, form = layout_of(arch, names | recipe)
    if form != layout_of(arch, names)[2]:  # only the recipes name the MLA tensors
        form += " (recipe)"
    base = Row(model, arch.value, form, source, len(names), 0, set(), set(), "-", "")
    if not names:
        base.verdict = "unverified: no names"
        return base
    trunk = n_blocks - nextn_blocks
    try:  # the spec or the decoder refusing this layout is a finding
        planned, read = read_names(
            spec_for(
                arch, preset, by_block, form=form, tied="output.weight" not in names, trunk=trunk
            )
        )
    except (ValueError, ModelError) as e:
        base.verdict = "refused: " + str(e).splitlines()[0][:120]
        return base
    ok, loaded, unread = classify(names, read, planned, trunk)
    if recipe and recipe != names:
        r_ok, r_loaded, r_unread = classify(recipe, read, planned, trunk)
        base.recipe = f"{len(r_ok)}+{len(r_loaded)}/{len(recipe)}"
        loaded, unread = loaded | r_loaded, unread | r_unread
    base.read, base.loaded, base.unread = len(ok), loaded, unread
    if unread:
        base.verdict = f"NOT READ: {len(unread)} names"
    else:
        base.verdict = "reads all" + ("; some loaded, not read" if loaded else "")
    if form.startswith("ik"):
        base.verdict += " (ik_llama.cpp form: mainline refuses it)"
    return base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite_git_dir", help="a bare clone of Thireus/GGUF-Tool-Suite")
    git_dir = parser.parse_args().suite_git_dir
    head = (git(git_dir, "rev-parse", "HEAD") or "?").strip()
    listing = git(git_dir, "show", "HEAD:models/models.txt") or ""
    models = [
        line.split(":", 1)[0]
        for line in listing.splitlines()
        if line.strip() and not line.startswith(("mmproj-", "mtp-"))
    ]
    print(f"GGUF Tool Suite {head}: {len(models)} text models in models/models.txt\n")
    print(
        "| model | architecture | file form | names from | listed | read | loaded, not read "
        "| recipe: read+loaded/listed | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [check(git_dir, m) for m in models]
    for r in rows:
        print(
            f"| {r.model} | {r.arch} | {r.form} | {r.source} | {r.listed} | {r.read} "
            f"| {len(r.loaded)} | {r.recipe} | {r.verdict} |"
        )
    print()
    for r in rows:
        if r.unread:
            print(f"- {r.model}, not read: {group(r.unread)}")
        if r.loaded:
            print(f"- {r.model}, loaded, never read: {group(r.loaded)}")
    counts = Counter((r.arch, r.form, r.verdict.split(";")[0].split(":")[0]) for r in rows)
    print("\n| architecture | file form | verdict | models |\n|---|---|---|---|")
    for (arch, form, ok), n in sorted(counts.items()):
        print(f"| {arch} | {form} | {ok} | {n} |")
    read_all = sum(r.verdict.startswith("reads all") for r in rows)
    print(f"\n{read_all} of {len(rows)} text models: every listed name read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
