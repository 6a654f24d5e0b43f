"""Tiny DeepSeek-V3.2 and GLM-5 checkpoints converted by llama.cpp's own converter; runs in
``.venv-convert`` (torch, transformers, safetensors: neither this project nor llama-cpp-python).

``python convert_mla.py --llama-src VENDOR/llama.cpp --out DIR [--only NAME]``: for each checkpoint
of ``CHECKPOINTS`` (``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM`` text models with small
random weights, laid out as ``transformers`` saves them: ``config.json``, ``model.safetensors``, a
tiny byte-level BPE tokenizer with the special tokens each converter looks up) this writes the
checkpoint under ``DIR/hf/NAME`` and converts it with ``convert_hf_to_gguf.py`` from the llama.cpp
sources llama-cpp-python vendors: ``DIR/NAME-F32.gguf`` and ``NAME-F16.gguf``, and from the
``-wide`` checkpoint (every row 256 values: K-quant blocks) ``NAME-wide-F32.gguf``, which
``families.py`` has llama.cpp's quantizer turn into Q4_K_S. Prints one JSON line:
``{"files": {NAME/TYPE: path}}``.

Two changes to the converter's run: the tiny tokenizer's pre-tokenizer is unknown to its table of
checksums, so it is named ``qwen2`` (the regex of a byte-level BPE like this one), as
``convert_tiny.py`` does; and transformers 5 drops ``add_bos_token`` from tokenizer_config.json,
which DeepSeek-V3.2's converter asserts, so it is passed on (``keep_add_bos_token``). Every tensor
and every other key is the converter's own work.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SEED = 0
CORPUS = (
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week. "
    "The quick brown fox jumps over the lazy dog. 0123456789 the a an and of to in is it"
)
VOCAB = 320
# What the two converters look up: DeepSeek's BOS, GLM's [gMASK] (its BOS) and turn tokens.
SPECIAL = ["<|endoftext|>", "<|begin_of_sentence|>", "[gMASK]", "<|user|>", "<|observation|>"]


def tokenizer_files(out: Path) -> int:
    """A byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json); its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_sentence|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": True,  # DeepseekV32Model.set_vocab asserts it
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def _normal(g: torch.Generator, *shape: int, std: float | None = None) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + torch.randn(n, generator=g) * 0.05


def attention(g: torch.Generator, cfg: dict[str, Any], p: str) -> dict[str, torch.Tensor]:
    """One layer's latent attention and indexer, with transformers' names."""
    d, h, q_lora, rank = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["q_lora_rank"],
        cfg["kv_lora_rank"],
    )
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = p + "self_attn."
    out = {
        a + "q_a_proj.weight": _normal(g, q_lora, d),
        a + "q_a_layernorm.weight": _norm(g, q_lora),
        a + "q_b_proj.weight": _normal(g, h * (nope + rope), q_lora),
        a + "kv_a_proj_with_mqa.weight": _normal(g, rank + rope, d),
        a + "kv_a_layernorm.weight": _norm(g, rank),
        a + "kv_b_proj.weight": _normal(g, h * (nope + v), rank),
        a + "o_proj.weight": _normal(g, d, h * v),
    }
    if "index_n_heads" not in cfg:  # DeepSeek-V3: no indexer
        return out
    idx_h, idx_d = cfg["index_n_heads"], cfg["index_head_dim"]
    return out | {
        a + "indexer.wq_b.weight": _normal(g, idx_h * idx_d, q_lora),
        a + "indexer.wk.weight": _normal(g, idx_d, d),
        a + "indexer.k_norm.weight": _norm(g, idx_d),
        a + "indexer.k_norm.bias": torch.randn(idx_d, generator=g) * 0.05,
        a + "indexer.weights_proj.weight": _normal(g, idx_h, d),
    }


def feed_forward(g: torch.Generator, cfg: dict[str, Any], p: str, *, moe: bool) -> dict[str, Any]:
    """One layer's dense SwiGLU, or routed experts with the selection bias and a shared expert."""
    d, m = cfg["hidden_size"], p + "mlp."
    if not moe:
        f = cfg["intermediate_size"]
        return {
            m + "gate_proj.weight": _normal(g, f, d),
            m + "up_proj.weight": _normal(g, f, d),
            m + "down_proj.weight": _normal(g, d, f),
        }
    f, n_exp = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out = {
        m + "gate.weight": _normal(g, n_exp, d),
        m + "gate.e_score_correction_bias": torch.randn(n_exp, generator=g) * 0.1,
    }
    for e in range(n_exp):
        out[m + f"experts.{e}.gate_proj.weight"] = _normal(g, f, d)
        out[m + f"experts.{e}.up_proj.weight"] = _normal(g, f, d)
        out[m + f"experts.{e}.down_proj.weight"] = _normal(g, d, f)
    s = f * cfg["n_shared_experts"]
    out[m + "shared_experts.gate_proj.weight"] = _normal(g, s, d)
    out[m + "shared_experts.up_proj.weight"] = _normal(g, s, d)
    out[m + "shared_experts.down_proj.weight"] = _normal(g, d, s)
    return out


def mla_state(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random weights of a DeepSeek-V3.2 / GLM-5 text model with transformers' names."""
    g = torch.Generator().manual_seed(SEED)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out = {
        "model.embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        "model.norm.weight": _norm(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = _norm(g, d)
        out[p + "post_attention_layernorm.weight"] = _norm(g, d)
        out |= attention(g, cfg, p)
        out |= feed_forward(g, cfg, p, moe=i >= cfg["first_k_dense_replace"])
    return {k: v.float().contiguous() for k, v in out.items()}


def mla_config(architecture: str, model_type: str, *, wide: bool) -> dict[str, Any]:
    """Two layers (one dense), four heads of 32 + 16 rope dims with q_lora and a latent of 32,
    4 experts (2 used) in 2 groups (1 used) with sigmoid scores and the selection bias, a shared
    expert, an indexer of 4 heads of 64 keeping the 4 best positions. ``wide``: rows of 256."""
    w = 256 if wide else 32
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 256 if wide else 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 256 if wide else 64,
        "moe_intermediate_size": w,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "q_lora_rank": w,
        "kv_lora_rank": w,
        "qk_nope_head_dim": 256 if wide else 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": w,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return cfg


def deepseek32_config(*, wide: bool) -> dict[str, Any]:
    """DeepSeek-V3.2's layout: YaRN x4 over 64 positions (mscale_all_dim 1, as V3.2's)."""
    cfg = mla_config("DeepseekV32ForCausalLM", "deepseek_v32", wide=wide)
    cfg["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    return cfg


def glm_dsa_config(*, wide: bool) -> dict[str, Any]:
    """GLM-5.2's layout: the second block shares the first one's indexer selection."""
    cfg = mla_config("GlmMoeDsaForCausalLM", "glm_moe_dsa", wide=wide)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg["indexer_types"] = ["full", "shared"]
    return cfg


def deepseek_v3_config(*, wide: bool) -> dict[str, Any]:
    """DeepSeek-V3 / R1's layout without the indexer, the config keys of its original release
    (``rope_scaling`` with ``type``), which ik_llama.cpp's converter reads."""
    cfg = mla_config("DeepseekV3ForCausalLM", "deepseek_v3", wide=wide)
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        del cfg[key]
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    return cfg


CHECKPOINTS: dict[str, Callable[[], dict[str, Any]]] = {
    "hf-deepseek32": lambda: deepseek32_config(wide=False),
    "hf-deepseek32-wide": lambda: deepseek32_config(wide=True),
    "hf-glm-dsa": lambda: glm_dsa_config(wide=False),
    "hf-glm-dsa-wide": lambda: glm_dsa_config(wide=True),
}
# Converted by ik_llama.cpp's converter (``--ik-src``): its three-tensor deepseek2 form.
IK_CHECKPOINTS: dict[str, Callable[[], dict[str, Any]]] = {
    "hf-deepseek2-ik": lambda: deepseek_v3_config(wide=False),
    "hf-deepseek2-ik-wide": lambda: deepseek_v3_config(wide=True),
}


def write_checkpoint(name: str, out: Path) -> Path:
    """The checkpoint ``name`` under ``out/hf/name``."""
    root = out / "hf" / name
    root.mkdir(parents=True, exist_ok=True)
    cfg = {**CHECKPOINTS, **IK_CHECKPOINTS}[name]()
    cfg["vocab_size"] = tokenizer_files(root)
    cfg["bos_token_id"], cfg["eos_token_id"] = SPECIAL.index("<|begin_of_sentence|>"), 0
    state = mla_state(cfg)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def convert(src: Path, checkpoint: Path, outfile: Path, outtype: str, *, ik: bool = False) -> None:
    """The converter of ``src`` (llama.cpp's, or ``ik``: ik_llama.cpp's) on ``checkpoint`` in a
    process of its own (the converters keep per-run state in their classes); ``--no-mtp``:
    the checkpoints have no MTP block (ik's converter has no such option)."""
    argv = [str(checkpoint), "--outfile", str(outfile), "--outtype", outtype]
    run = "--run-ik-converter" if ik else "--run-converter"
    subprocess.run(
        [sys.executable, __file__, run, str(src), *argv, *([] if ik else ["--no-mtp"])],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def run_ik_converter(ik_src: str, argv: list[str]) -> int:
    """ik_llama.cpp's converter (its own gguf-py beside it), the pre-tokenizer named as for
    llama.cpp's."""
    sys.path.insert(0, ik_src)
    import convert_hf_to_gguf  # ik's converter; it puts its gguf-py first on the path

    convert_hf_to_gguf.Model.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
    return 0


def keep_add_bos_token() -> None:
    """transformers 5 drops ``add_bos_token`` from tokenizer_config.json when it loads a fast
    tokenizer (``TokenizersBackend``), and DeepseekV32Model.set_vocab asserts it: pass the file's
    value on, as transformers 4 did."""
    import transformers

    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path: Any, *args: Any, **kwargs: Any) -> Any:
        config = Path(path) / "tokenizer_config.json"
        if config.is_file() and "add_bos_token" not in kwargs:
            value = json.loads(config.read_text()).get("add_bos_token")
            if value is not None:
                kwargs["add_bos_token"] = value
        return original(path, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = from_pretrained  # type: ignore[method-assign]


def run_converter(llama_src: str, argv: list[str]) -> int:
    """The converter's main with the tiny tokenizer's pre-tokenizer named (module docstring)."""
    sys.path.insert(0, llama_src)
    import convert_hf_to_gguf  # the vendored converter and its gguf-py
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # type: ignore[method-assign]
    keep_add_bos_token()
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--run-converter"]:
        return run_converter(sys.argv[2], sys.argv[3:])
    if sys.argv[1:2] == ["--run-ik-converter"]:
        return run_ik_converter(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-src", required=True, type=Path, help="vendor/llama.cpp")
    parser.add_argument("--ik-src", type=Path, help="ik_llama.cpp's sources (its converter)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", help="the checkpoints whose name contains this")
    args = parser.parse_args()
    todo = [(name, args.llama_src, False) for name in CHECKPOINTS]
    if args.ik_src is not None:
        todo += [(name, args.ik_src, True) for name in IK_CHECKPOINTS]
    files = {}
    for name, src, ik in todo:
        if args.only and args.only not in name:
            continue
        checkpoint = write_checkpoint(name, args.out)
        outtypes = ("f32",) if name.endswith("-wide") else ("f32", "f16")
        for outtype in outtypes:
            path = args.out / f"{name}-{outtype.upper()}.gguf"
            convert(src, checkpoint, path, outtype, ik=ik)
            files[f"{name}/{outtype.upper()}"] = str(path)
    print(json.dumps({"files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
