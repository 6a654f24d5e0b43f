"""The cross-check against llama.cpp: its cases, metrics and golden fixtures.

Shared by ``crosscheck/run.py`` (``make crosscheck``: writes every case's model, has llama.cpp and
the project's decoder compute its logits, records the figures and the golden fixtures) and by
``tests/test_crosscheck.py`` (part of ``make test``: rewrites each model from its recorded spec,
checks the bytes, and compares the decoder to the recorded llama.cpp logits; no llama.cpp).

A case is one model variant (``VARIANTS``: every architecture with every writer option llama.cpp
accepts for it, named after the preset or ``make-model`` options that write it) with every matrix
tensor in one GGML type (``CHECK_TYPES``; norms and routers stay F32, as llama.cpp's quantizer
leaves them). K-quant blocks hold 256 values, so K-quant cases use the variant widened to rows
of 256 (``WIDE``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
from gguf import GGMLQuantizationType

from ggufswap.shards.archs import rules_of
from ggufswap.shards.ggml_types import GGMLType
from ggufswap.shards.keys import Arch
from ggufswap.shards.presets import (
    deepseek2_wide,
    demo_moe,
    gemma4_wide,
    hybrid_wide,
    tiny_arch,
    tiny_deepseek2,
    tiny_dense,
    tiny_dots1,
    tiny_gemma4,
    tiny_glm4moe,
    tiny_gpt_oss,
    tiny_llama3,
    tiny_llama4,
    tiny_minimax_m2,
    tiny_moe,
    tiny_qwen3next,
    tiny_qwen3vlmoe,
    tiny_qwen35,
    tiny_qwen35moe,
)
from ggufswap.shards.writer import (
    DEFAULT_TYPES,
    F32_ROLES,
    WRITABLE_TYPES,
    Layout,
    ModelSpec,
    Role,
    write_model,
)

Q = GGMLQuantizationType
REPO: Final = Path(__file__).resolve().parents[1]
FIXTURES: Final = REPO / "tests" / "fixtures" / "crosscheck"
MANIFEST: Final = FIXTURES / "cases.json"
LOGITS: Final = FIXTURES / "logits.npz"

# The fixed token sequence (BOS first; every id < 256, the smallest vocabulary). Longer than
# gemma3's window of 4, so its local layers' masks matter.
TOKENS: Final = (1, 17, 33, 250, 4, 99, 7, 128, 5, 60, 200, 3)
# The positions whose logits the golden fixtures keep (a third of them keeps the files small;
# all but the first lie past gemma3's window).
GOLDEN_POSITIONS: Final = (2, 5, 8, 11)
CHECK_TYPES: Final = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
# K-quant cases: every row a multiple of 256 values (n_head 4 -> head width 64).
WIDE: Final[Mapping[str, int]] = {"n_embd": 256, "n_ff": 256, "n_ff_expert": 256, "n_ff_shexp": 256}


@dataclass(frozen=True)
class Threshold:
    """What a case must meet: issue 12's figures per weight type."""

    max_mean_kld: float
    exact_top1: bool


def type_named(name: str) -> GGMLQuantizationType | GGMLType:
    """A GGML type by name: gguf-py's, or one of ik_llama.cpp's (``GGMLType``)."""
    return Q[name] if name in Q.__members__ else GGMLType[name]


def threshold(ggml_type: GGMLQuantizationType | GGMLType) -> Threshold:
    """Top-1 100% and mean KLD < 1e-4 for F32/F16; < 1e-3 for Q8_0 (and the 6-bit Q6_K and ik's
    Q6_0, which issue 12 does not name); < 1e-2 for the 4-bit types (ik's IQ4_K among them)."""
    if ggml_type in (Q.F32, Q.F16):
        return Threshold(1e-4, exact_top1=True)
    if ggml_type in (Q.Q8_0, Q.Q6_K, GGMLType.Q6_0):
        return Threshold(1e-3, exact_top1=False)
    return Threshold(1e-2, exact_top1=False)


# --- cases ----------------------------------------------------------------------------------


def _llama_moe(**kw: Any) -> ModelSpec:
    """``make-model --preset tiny-moe --arch llama``: Mixtral's form (4 experts, 2 used)."""
    return tiny_moe(arch=Arch.LLAMA, **kw)


def _demo_llama(**kw: Any) -> ModelSpec:
    """``make-model --preset demo-moe --arch llama``: the demo's model in Mixtral's form."""
    return demo_moe(arch=Arch.LLAMA, **kw)


def _deepseek2(**fixed: Any) -> Callable[..., ModelSpec]:
    """``tiny-deepseek2`` with ``fixed`` options; widened (``deepseek2_wide``: the latent and
    head widths too) when asked for the K-quant rows of 256."""

    def build(**kw: Any) -> ModelSpec:
        if kw.get("n_embd") == WIDE["n_embd"]:
            kw = deepseek2_wide(**kw)
        return tiny_deepseek2(**{**kw, **fixed})

    return build


def _glm4moe(**fixed: Any) -> Callable[..., ModelSpec]:
    """``tiny-glm4moe`` with ``fixed`` options; heads of 64 (32 rotated) in the K-quant rows."""

    def build(**kw: Any) -> ModelSpec:
        if kw.get("n_embd") == WIDE["n_embd"]:
            kw = {"head_dim": 64, "rope_dim": 32, **kw}
        return tiny_glm4moe(**{**kw, **fixed})

    return build


def _hybrid(preset: Callable[..., ModelSpec]) -> Callable[..., ModelSpec]:
    """A Qwen3.5 / Qwen3-Next preset; widened (``hybrid_wide``: heads, delta-net state) when
    asked for the K-quant rows of 256."""

    def build(**kw: Any) -> ModelSpec:
        if kw.get("n_embd") == WIDE["n_embd"]:
            kw = hybrid_wide(**kw)
        return preset(**kw)

    return build


# name -> spec builder. Every architecture with each option llama.cpp accepts for it
# (shards.archs): dense/MoE where the architecture offers both, a tied output where allowed,
# qwen2moe's shared expert (required there, refused elsewhere); plus the presets.
VARIANTS: Final[Mapping[str, Callable[..., ModelSpec]]] = {
    "tiny-dense": tiny_dense,  # llama, dense
    "llama-tied": lambda **kw: tiny_dense(tied_output=True, **kw),
    "llama-moe": _llama_moe,
    "llama-moe-tied": lambda **kw: _llama_moe(tied_output=True, **kw),
    "qwen2": lambda **kw: tiny_arch(Arch.QWEN2, **kw),
    "qwen2-tied": lambda **kw: tiny_arch(Arch.QWEN2, tied_output=True, **kw),
    "qwen2moe-shexp": lambda **kw: tiny_arch(Arch.QWEN2MOE, **kw),  # shared expert required
    "qwen3": lambda **kw: tiny_arch(Arch.QWEN3, **kw),
    "qwen3-tied": lambda **kw: tiny_arch(Arch.QWEN3, tied_output=True, **kw),
    "tiny-moe": tiny_moe,  # qwen3moe
    "qwen3moe-tied": lambda **kw: tiny_moe(tied_output=True, **kw),
    "gemma3": lambda **kw: tiny_arch(Arch.GEMMA3, **kw),
    "gemma3-tied": lambda **kw: tiny_arch(Arch.GEMMA3, tied_output=True, **kw),
    "demo-moe": demo_moe,  # qwen3moe, n_embd 256, 8 experts
    "demo-moe-llama": _demo_llama,
    # attn_k_b/attn_v_b, q_lora, sigmoid + exp_probs_b, 4 groups (2 used), YaRN, 1 dense block
    "deepseek2": _deepseek2(),
    "deepseek2-kv-b": _deepseek2(mla_split=False),  # the older attn_kv_b form
    # DeepSeek-V2-style: attn_q, softmax gating, no bias, groups, norm or scale; tied output
    "deepseek2-v2-tied": _deepseek2(
        q_lora_rank=0,
        expert_gating_func=0,
        expert_probs_bias=False,
        n_expert_groups=0,
        n_group_used=0,
        expert_weights_norm=False,
        expert_weights_scale=0.0,
        rope_scaling=None,
        rope_orig_ctx=0,
        yarn_log_mul=0.0,
        tied_output=True,
    ),
    # Q/K/V biases, half-rotated heads, sigmoid + exp_probs_b, shared expert, a NextN block
    "glm4moe": _glm4moe(),
    # GLM-4.5's per-head Q/K norms, no biases, no NextN block, tied output
    "glm4moe-qk-norm-tied": _glm4moe(
        attn_qk_norm=True, attn_bias=False, n_nextn=0, tied_output=True
    ),
    "llama-rope-freqs": tiny_llama3,  # llama 3.1 RoPE scaling: rope_freqs.weight
    "gpt-oss": tiny_gpt_oss,  # every matrix in the case's type, experts included
    "gpt-oss-mxfp4": tiny_gpt_oss,  # experts in MXFP4 as OpenAI ships them (PINNED_TYPES)
    # gated delta-net blocks 0-2 (conv and recurrent state), gated full attention in block 3
    "qwen35": _hybrid(tiny_qwen35),  # interleaved multimodal RoPE sections, dense FFN
    "qwen35moe": _hybrid(tiny_qwen35moe),  # routed experts + gated shared expert
    "qwen3next": _hybrid(tiny_qwen3next),  # ssm_ba, interleaved value heads, NEOX RoPE
}
_EXPERT_ROLES: Final = (Role.FFN_GATE_EXPS, Role.FFN_UP_EXPS, Role.FFN_DOWN_EXPS)
# Variants some of whose roles keep their type whatever the case's type is.
PINNED_TYPES: Final[Mapping[str, Mapping[Role, GGMLQuantizationType]]] = {
    "gpt-oss-mxfp4": dict.fromkeys(_EXPERT_ROLES, Q.MXFP4),
}


def _gemma4(**fixed: Any) -> Callable[..., ModelSpec]:
    """``tiny-gemma4`` with ``fixed`` options; widened (``gemma4_wide``: both head widths too)
    when asked for the K-quant rows of 256."""

    def build(**kw: Any) -> ModelSpec:
        if kw.get("n_embd") == WIDE["n_embd"]:
            kw = gemma4_wide(**kw)
        return tiny_gemma4(**{**fixed, **kw})  # the wide widths win over a fixed width

    return build


def _dots1(**fixed: Any) -> Callable[..., ModelSpec]:
    """``tiny-dots1`` with ``fixed`` options (the K-quant rows: ``WIDE``, heads of 64)."""

    def build(**kw: Any) -> ModelSpec:
        return tiny_dots1(**{**kw, **fixed})

    return build


# Families whose golden fixtures live in files of their own (``tests/fixtures/crosscheck/<family>``,
# ``family_fixtures``): an architecture added beside the others records and replays its cases
# without rewriting the shared ``cases.json`` / ``logits.npz`` (``run.py --family NAME`` records
# one family). family -> variant name -> spec builder; every matrix role takes the case's type.
FAMILY_VARIANTS: Final[Mapping[str, Mapping[str, Callable[..., ModelSpec]]]] = {
    "qwen3vlmoe": {
        # qwen3moe's blocks, interleaved multimodal RoPE over the whole head (one pair unrotated)
        "qwen3vlmoe": tiny_qwen3vlmoe,
        "qwen3vlmoe-tied": lambda **kw: tiny_qwen3vlmoe(tied_output=True, **kw),
    },
    "minimax-m2": {
        # Q/K norms across heads, half-rotated heads, sigmoid + exp_probs_b, renormalised
        "minimax-m2": tiny_minimax_m2,
        "minimax-m2-softmax": lambda **kw: tiny_minimax_m2(expert_gating_func=1, **kw),
    },
    "llama4": {
        # Maverick-like: MoE every 2nd block, chunked RoPE layers + a NoPE layer, rope_freqs
        "llama4": tiny_llama4,
        # Scout-like: MoE in every block, 2 experts used, tied output, no rope_freqs
        "llama4-scout-tied": lambda **kw: tiny_llama4(
            moe_layer_step=1, n_expert_used=2, tied_output=True, rope_llama3_factor=0.0, **kw
        ),
    },
    "gemma4": {
        # Gemma 4 31B-like: 5 sliding + 1 full layer of other head shapes, V = K, proportional RoPE
        "gemma4": _gemma4(),
        # 26B-A4B-like: routed experts beside the dense MLP in every block; attn_v everywhere, tied
        "gemma4-moe-tied": _gemma4(
            n_expert=4, n_expert_used=2, n_ff_expert=32, attn_k_eq_v=False, tied_output=True
        ),
    },
    "dots1": {
        # deepseek2's routed blocks (sigmoid + bias, norm, scale, a shared expert, a dense
        # block) under qwen3's attention
        "dots1": _dots1(),
        # softmax, no bias, 4 groups of 2 (2 used), no norm or scale
        "dots1-softmax-groups": _dots1(
            expert_gating_func=1,
            expert_probs_bias=False,
            n_expert_groups=4,
            n_group_used=2,
            expert_weights_norm=False,
            expert_weights_scale=0.0,
        ),
    },
}
# Every variant: the shared ones, then each family's.
ALL_VARIANTS: Final[Mapping[str, Callable[..., ModelSpec]]] = {
    **VARIANTS,
    **{name: build for family in FAMILY_VARIANTS.values() for name, build in family.items()},
}


def family_of(case: str) -> str | None:
    """The family whose fixture files hold ``case`` (``variant/TYPE``), or None (the shared
    files)."""
    variant = case.rpartition("/")[0]
    return next((f for f, variants in FAMILY_VARIANTS.items() if variant in variants), None)


def family_fixtures(family: str | None) -> Path:
    """The folder of a family's fixture files (None: the shared ``FIXTURES``)."""
    return FIXTURES if family is None else FIXTURES / family


# deepseek2's attention and glm4moe's NextN matrix roles (DSA_ROLES: the indexer's): only their
# cases set them (the other specs have no such tensors; their recorded specs predate the roles).
OWN_ROLES: Final = frozenset(
    {
        Role.ATTN_Q_A,
        Role.ATTN_Q_B,
        Role.ATTN_KV_A_MQA,
        Role.ATTN_KV_B,
        Role.ATTN_K_B,
        Role.ATTN_V_B,
        Role.NEXTN_EH_PROJ,
        Role.ATTN_QKV,
        Role.ATTN_GATE,
        Role.SSM_BETA,
        Role.SSM_ALPHA,
        Role.SSM_BETA_ALPHA,
        Role.SSM_OUT,
    }
)
DSA_ROLES: Final = frozenset({Role.INDEXER_PROJ, Role.INDEXER_ATTN_K, Role.INDEXER_ATTN_Q_B})


def case_spec(
    variant: str,
    ggml_type: GGMLQuantizationType | GGMLType,
    build: Callable[..., ModelSpec] | None = None,
) -> ModelSpec:
    """The spec of one case: the variant (``build``, else ``VARIANTS``' own) with every matrix
    role in ``ggml_type``, widened (``WIDE``) when its rows cannot hold the type's blocks."""
    build = build or ALL_VARIANTS[variant]
    rules = rules_of(build().arch)
    own = rules.mla or rules.glm or rules.hybrid or variant not in VARIANTS
    types = {
        role.name: ggml_type
        for role in Role
        if role not in F32_ROLES
        and (own or role not in OWN_ROLES)
        and (rules.dsa or role not in DSA_ROLES)
    }
    types |= {role.name: t for role, t in PINNED_TYPES.get(variant, {}).items()}
    name = f"xc-{variant}-{ggml_type.name.lower()}"
    try:
        return replace(build(), name=name).with_types(**types)
    except ValueError:  # a row length is not a multiple of the block size
        return replace(build(**WIDE), name=name).with_types(**types)


def case_name(variant: str, ggml_type: GGMLQuantizationType | GGMLType) -> str:
    return f"{variant}/{ggml_type.name}"


def case_threshold(name: str) -> Threshold:
    """The threshold of case ``variant/TYPE``: its type's, or the loosest of it and the types its
    variant pins (``gpt-oss-mxfp4/F32`` holds 4-bit experts: the 4-bit threshold)."""
    variant, _, type_name = name.rpartition("/")
    limits = [threshold(type_named(type_name))]
    limits += [threshold(t) for t in PINNED_TYPES.get(variant, {}).values()]
    return Threshold(
        max(limit.max_mean_kld for limit in limits),
        exact_top1=all(limit.exact_top1 for limit in limits),
    )


def all_cases() -> dict[str, ModelSpec]:
    """Every case, by name (``variant/TYPE``), in a stable order."""
    return {case_name(v, t): case_spec(v, t) for v in ALL_VARIANTS for t in CHECK_TYPES}


# Beyond the cases: the other layouts make-model writes (the same tensors over several files) and
# the writable types the cases do not cover, each on the widened dense llama.
LAYOUT_CASE: Final = "tiny-moe/Q8_0"
LAYOUTS: Final = (Layout.SPLIT, Layout.PER_TENSOR)


def other_type_specs() -> dict[str, ModelSpec]:
    """``tiny-dense`` (rows of 256) with every matrix role in each writable type not in
    ``CHECK_TYPES``: llama.cpp must load them, and agree within the 4-bit threshold."""
    out = {}
    for t in WRITABLE_TYPES:
        if t in CHECK_TYPES:
            continue
        types = {role.name: t for role in Role if role not in F32_ROLES}
        name = f"xc-types-{t.name.lower()}"
        out[f"tiny-dense-wide/{t.name}"] = tiny_dense(name=name, **WIDE).with_types(**types)
    return out


# --- specs as JSON --------------------------------------------------------------------------


def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    """The fields of ``spec`` that differ from ``ModelSpec()``'s, JSON-ready (arch and types by
    name; types only where they differ from the writer's defaults). ``spec_from_json`` gives the
    same spec back for as long as the defaults stay; if they change, the rewritten file's bytes
    change too, which is what the golden test checks."""
    default = ModelSpec()
    out: dict[str, Any] = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name == "types":
            roles = sorted(value, key=lambda r: r.name)
            value = {r.name: value[r].name for r in roles if DEFAULT_TYPES[r] != value[r]}
            if value:
                out[f.name] = value
            continue
        if value == getattr(default, f.name):
            continue
        if f.name == "arch":
            value = Arch(value).value
        elif f.name == "moe_layers" and value is not None:
            value = list(value)
        out[f.name] = value
    return out


def spec_from_json(data: Mapping[str, Any]) -> ModelSpec:
    """The spec ``spec_to_json`` recorded."""
    kw = dict(data)
    kw["types"] = {Role[r]: type_named(t) for r, t in kw.get("types", {}).items()}
    if kw.get("moe_layers") is not None:
        kw["moe_layers"] = tuple(kw["moe_layers"])
    if "rope_sections" in kw:  # a tuple field, a list in JSON
        kw["rope_sections"] = tuple(kw["rope_sections"])
    return ModelSpec(**kw)


def write_case(spec: ModelSpec, out_dir: Path) -> tuple[Path, str]:
    """Write ``spec`` as one file; returns it and the SHA-256 of its bytes."""
    (path,) = write_model(spec, out_dir)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def write_layout(spec: ModelSpec, out_dir: Path, layout: Layout) -> Path:
    """Write ``spec`` in ``layout``; returns the file to load (the first shard)."""
    return write_model(spec, out_dir, layout=layout)[0]


# --- metrics --------------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Figures:
    """How the project's logits compare with llama.cpp's (the reference) over some positions."""

    positions: int
    top1: float  # fraction of positions with the same arg-max
    mean_kld: float  # KL(llama.cpp || project), mean over positions
    max_kld: float
    max_dlogit_std: float  # max |logit difference| / std of llama.cpp's logits at that position

    def meets(self, limit: Threshold) -> list[str]:
        """Every way these figures miss ``limit`` (empty when they meet it)."""
        misses = []
        if limit.exact_top1 and self.top1 < 1.0:
            misses.append(f"top-1 agreement {self.top1:.1%} < 100%")
        if not self.mean_kld < limit.max_mean_kld:
            misses.append(f"mean KLD {self.mean_kld:.3g} >= {limit.max_mean_kld:g}")
        return misses

    def as_json(self) -> dict[str, float | int]:
        """The figures to 4 significant digits (what the docs and the golden test need)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v if isinstance(v, int) else float(f"{v:.4g}") for k, v in values.items()}


def compare(reference: np.ndarray, ours: np.ndarray) -> Figures:
    """Figures of ``ours`` against ``reference`` (both ``[positions, vocab]`` logits)."""
    assert reference.shape == ours.shape, f"shapes differ: {reference.shape} vs {ours.shape}"
    ref64, ours64 = reference.astype(np.float64), ours.astype(np.float64)
    lp, lq = log_softmax(ref64), log_softmax(ours64)
    kld = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    dlogit = np.abs(ours64 - ref64).max(axis=-1) / ref64.std(axis=-1)
    return Figures(
        positions=int(reference.shape[0]),
        top1=float((reference.argmax(-1) == ours.argmax(-1)).mean()),
        mean_kld=float(kld.mean()),
        max_kld=float(kld.max()),
        max_dlogit_std=float(dlogit.max()),
    )


# --- golden fixtures ------------------------------------------------------------------------

# Logits are stored per position as int16 codes around the row mean, at a step of
# max|x - mean| / 32767: half a step is ~1e-4 of the row's range, far below what the thresholds
# measure (a KLD error of ~1e-9 at the tiny models' logit scales).
_CODE_MAX: Final = 32767


def encode_logits(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[P, V]`` float logits -> int16 codes, per-row offsets and steps (float32)."""
    x = logits.astype(np.float64)
    offset = x.mean(axis=-1, keepdims=True)
    step = np.abs(x - offset).max(axis=-1, keepdims=True) / _CODE_MAX
    step[step == 0] = 1.0
    codes = np.rint((x - offset) / step).astype(np.int16)
    return codes, offset[:, 0].astype(np.float32), step[:, 0].astype(np.float32)


def decode_logits(codes: np.ndarray, offset: np.ndarray, step: np.ndarray) -> np.ndarray:
    return codes.astype(np.float64) * step[:, None].astype(np.float64) + offset[:, None]


@dataclass(frozen=True)
class GoldenCase:
    """One recorded case: its spec, the SHA-256 of its file, and llama.cpp's logits."""

    name: str
    spec: ModelSpec
    sha256: str
    ggml_type: GGMLQuantizationType | GGMLType
    figures: Mapping[str, Any]  # what make crosscheck measured over every position
    logits: np.ndarray  # [len(GOLDEN_POSITIONS), V] llama.cpp's logits (decoded)


def save_golden(
    manifest: Mapping[str, Any], logits: Mapping[str, np.ndarray], out_dir: Path = FIXTURES
) -> None:
    """Write the manifest (JSON) and every case's golden logits (one compressed .npz)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {}
    for i, name in enumerate(sorted(logits)):
        codes, offset, step = encode_logits(logits[name][list(GOLDEN_POSITIONS)])
        arrays |= {f"c{i}_codes": codes, f"c{i}_offset": offset, f"c{i}_step": step}
        manifest["cases"][name]["logits_key"] = f"c{i}"
    (out_dir / MANIFEST.name).write_text(_manifest_text(manifest))
    np.savez_compressed(out_dir / LOGITS.name, **arrays)


def _manifest_text(manifest: Mapping[str, Any]) -> str:
    """The manifest as JSON with one line per case (small diffs when a figure changes)."""
    head = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in manifest.items() if k != "cases"]
    cases = [
        f"    {json.dumps(name)}: {json.dumps(case, sort_keys=True)}"
        for name, case in manifest["cases"].items()
    ]
    return "{\n" + "\n".join(head) + '\n  "cases": {\n' + ",\n".join(cases) + "\n  }\n}\n"


def load_golden(out_dir: Path = FIXTURES) -> tuple[dict[str, Any], dict[str, GoldenCase]]:
    """The manifest and every recorded case."""
    manifest = json.loads((out_dir / MANIFEST.name).read_text())
    out = {}
    with np.load(out_dir / LOGITS.name) as arrays:
        for name, case in manifest["cases"].items():
            key = case["logits_key"]
            logits = decode_logits(
                arrays[f"{key}_codes"], arrays[f"{key}_offset"], arrays[f"{key}_step"]
            )
            out[name] = GoldenCase(
                name=name,
                spec=spec_from_json(case["spec"]),
                sha256=case["sha256"],
                ggml_type=type_named(case["type"]),
                figures=case["figures"],
                logits=logits,
            )
    return manifest, out


def save_golden_by_family(manifest: Mapping[str, Any], logits: Mapping[str, np.ndarray]) -> None:
    """``save_golden`` into each family's own files (``family_fixtures``): only the groups
    ``logits`` holds cases of are written."""
    groups: dict[str | None, list[str]] = {}
    for name in logits:
        groups.setdefault(family_of(name), []).append(name)
    for family, names in groups.items():
        head = {k: v for k, v in manifest.items() if k != "cases"}
        part = {**head, "cases": {n: manifest["cases"][n] for n in names}}
        save_golden(part, {n: logits[n] for n in names}, family_fixtures(family))


def load_all_golden() -> tuple[dict[str, Any], dict[str, GoldenCase]]:
    """The shared manifest (its ``cases`` merged with every family's) and every recorded case."""
    manifest, cases = load_golden()
    for family in FAMILY_VARIANTS:
        if (family_fixtures(family) / MANIFEST.name).exists():
            more, more_cases = load_golden(family_fixtures(family))
            manifest["cases"] |= more["cases"]
            cases |= more_cases
    return manifest, cases


# --- the project's side ---------------------------------------------------------------------


def project_logits(
    path: Path,
    tokens: tuple[int, ...] = TOKENS,
    *,
    within: Callable[[Any, Path], AbstractContextManager[None]] | None = None,
    numerics: str = "exact",
) -> np.ndarray:
    """``[T, V]`` logits of the project's decoder over ``path``, read through the tensor store
    as the server does (``HotSwapRuntime.open``, ``HParams.from_metadata``, ``build_model``);
    ``within(runtime, path)`` wraps the forward (``emulate.emulating``). ``numerics="ggml"``:
    the decoder rounds as ggml's CPU kernels do (native storage), its KV cache F32 as the
    reference runs here hold theirs (``llama_logits.py``: ``type_k = type_v = F32``)."""
    import torch

    from ggufswap.config import Storage
    from ggufswap.runtime import HotSwapRuntime
    from ggufswap.runtime.models import HParams, build_model
    from ggufswap.runtime.models.ggml_numerics import kv_cache_type
    from ggufswap.shards.ggml_types import GGMLType

    storage = Storage.NATIVE if numerics == "ggml" else Storage.DEQUANTIZED
    runtime = HotSwapRuntime.open(path, storage=storage)
    try:
        assert runtime.shards is not None, "open() keeps the shard set"
        model = build_model(
            HParams.from_metadata(runtime.shards.metadata, source=str(path)),
            runtime.store,
            store=runtime.store,
            numerics=numerics,
        )
        with (
            torch.inference_mode(),
            kv_cache_type(GGMLType.F32),
            within(runtime, path) if within else nullcontext(),
        ):
            out = model(torch.tensor([tokens], dtype=torch.int64))[0]
        return out.numpy().astype(np.float32)
    finally:
        runtime.close()
