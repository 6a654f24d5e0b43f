"""Tiny Hugging Face checkpoints converted by llama.cpp's own converter; runs in ``.venv-convert``.

``python convert_tiny.py --llama-src VENDOR/llama.cpp --out DIR [--only NAME]``: for each
checkpoint of ``CHECKPOINTS`` (a Qwen3.5, Qwen3.5-MoE and Qwen3-Next text model with small random
weights, laid out as ``transformers`` saves them: ``config.json``, ``model.safetensors``, a tiny
byte-level BPE tokenizer), in two sizes (``SIZES``: tiny, and wide rows for K-quants), this writes
the checkpoint under ``DIR/hf/NAME-SIZE`` and converts it with ``convert_hf_to_gguf.py`` from the
llama.cpp sources llama-cpp-python vendors: ``DIR/NAME-tiny-F32.gguf``, ``-tiny-F16``,
``-wide-F32``. Quantized files are made from the F32 ones by llama.cpp's own quantizer
(``llama_logits.py``'s ``quantize`` job, in the cross-check venv). Prints one JSON line:
``{"files": {NAME-SIZE/TYPE: path}}``.

The one change to the converter's run: the tiny tokenizer's pre-tokenizer is unknown to its table
of checksums (``get_vocab_base_pre`` recognizes released tokenizers by the hash of their output on a
fixed text), so this driver names it ``qwen2``, the regex Qwen's own tokenizers use. Every tensor
and every other key is the converter's own work.

Needs torch, safetensors, transformers (tokenizers): neither this project nor llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SEED = 0
# A text to train the tiny tokenizer on: byte-level BPE with a few hundred merges.
CORPUS = (
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week. "
    "The quick brown fox jumps over the lazy dog. 0123456789 the a an and of to in is it"
)
VOCAB = 320


def tokenizer_files(out: Path) -> int:
    """A byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json); its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def _normal(g: torch.Generator, *shape: int, std: float | None = None) -> torch.Tensor:
    fan_in = shape[-1]
    return torch.randn(*shape, generator=g) * (std if std is not None else fan_in**-0.5)


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    """A zero-centred RMS norm weight (Qwen3-Next / Qwen3.5 store ``w - 1``)."""
    return torch.randn(n, generator=g) * 0.05


def hybrid_state(cfg: dict[str, Any], *, moe: bool) -> dict[str, torch.Tensor]:
    """Random weights of a Qwen3.5 / Qwen3-Next text model with ``transformers``' names."""
    g = torch.Generator().manual_seed(SEED)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sk, sv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hk, hv, kern = (
        cfg["linear_num_key_heads"],
        cfg["linear_num_value_heads"],
        cfg["linear_conv_kernel_dim"],
    )
    out = {
        "model.embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        "model.norm.weight": _norm(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = _norm(g, d)
        out[p + "post_attention_layernorm.weight"] = _norm(g, d)
        if kind == "linear_attention":
            a = p + "linear_attn."
            conv = 2 * hk * sk + hv * sv
            if cfg["_qkvz"]:  # Qwen3-Next: one projection, q/k/v/z grouped by key head
                out[a + "in_proj_qkvz.weight"] = _normal(g, 2 * hk * sk + 2 * hv * sv, d)
                out[a + "in_proj_ba.weight"] = _normal(g, 2 * hv, d)
            else:
                out[a + "in_proj_qkv.weight"] = _normal(g, conv, d)
                out[a + "in_proj_z.weight"] = _normal(g, hv * sv, d)
                out[a + "in_proj_b.weight"] = _normal(g, hv, d)
                out[a + "in_proj_a.weight"] = _normal(g, hv, d)
            out[a + "conv1d.weight"] = _normal(g, conv, 1, kern, std=0.5)
            out[a + "dt_bias"] = torch.ones(hv) + 0.1 * torch.randn(hv, generator=g)
            out[a + "A_log"] = torch.randn(hv, generator=g) * 0.5
            out[a + "norm.weight"] = 1.0 + _norm(g, sv)
            out[a + "out_proj.weight"] = _normal(g, d, hv * sv)
        else:
            a = p + "self_attn."
            out[a + "q_proj.weight"] = _normal(g, 2 * nh * hd, d)
            out[a + "k_proj.weight"] = _normal(g, nkv * hd, d)
            out[a + "v_proj.weight"] = _normal(g, nkv * hd, d)
            out[a + "o_proj.weight"] = _normal(g, d, nh * hd)
            out[a + "q_norm.weight"] = _norm(g, hd)
            out[a + "k_norm.weight"] = _norm(g, hd)
        m = p + "mlp."
        if moe:
            f, sf, n_exp = (
                cfg["moe_intermediate_size"],
                cfg["shared_expert_intermediate_size"],
                cfg["num_experts"],
            )
            out[m + "gate.weight"] = _normal(g, n_exp, d)
            for e in range(n_exp):
                out[m + f"experts.{e}.gate_proj.weight"] = _normal(g, f, d)
                out[m + f"experts.{e}.up_proj.weight"] = _normal(g, f, d)
                out[m + f"experts.{e}.down_proj.weight"] = _normal(g, d, f)
            out[m + "shared_expert.gate_proj.weight"] = _normal(g, sf, d)
            out[m + "shared_expert.up_proj.weight"] = _normal(g, sf, d)
            out[m + "shared_expert.down_proj.weight"] = _normal(g, d, sf)
            out[m + "shared_expert_gate.weight"] = _normal(g, 1, d)
        else:
            f = cfg["intermediate_size"]
            out[m + "gate_proj.weight"] = _normal(g, f, d)
            out[m + "up_proj.weight"] = _normal(g, f, d)
            out[m + "down_proj.weight"] = _normal(g, d, f)
    return {k: v.float().contiguous() for k, v in out.items()}


# The checkpoints' sizes: "tiny" (rows of 32 and 64: the F32, F16 and Q8_0 files) and "wide"
# (every quantizable row 256 values: llama.cpp's K-quants).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 32,
        "head_dim": 32,
        "intermediate_size": 64,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "wide": {
        "hidden_size": 256,
        "head_dim": 128,
        "intermediate_size": 256,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
    },
}


def hybrid_config(
    architecture: str, model_type: str, *, moe: bool, qkvz: bool, size: str
) -> dict[str, Any]:
    """A small text config: 4 layers (3 linear attention, then full attention), two query
    heads over one kv head with a quarter of each head rotated, 2 key heads and 4 value heads in
    the delta net, conv kernel 4; ``SIZES[size]`` sets the widths."""
    sizes = dict(SIZES[size])
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "_qkvz": qkvz,
        "hidden_size": sizes["hidden_size"],
        "head_dim": sizes["head_dim"],
        "intermediate_size": sizes["intermediate_size"],
        "linear_key_head_dim": sizes["linear_key_head_dim"],
        "linear_value_head_dim": sizes["linear_value_head_dim"],
    }
    if moe:
        cfg |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": sizes["moe_intermediate_size"],
            "shared_expert_intermediate_size": sizes["shared_expert_intermediate_size"],
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return cfg


# name -> (HF architecture, model_type, MoE, Qwen3-Next's fused in_proj_qkvz / in_proj_ba)
CHECKPOINTS: dict[str, tuple[str, str, bool, bool]] = {
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text", False, False),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", True, False),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next", True, True),
}


def write_checkpoint(name: str, size: str, out: Path) -> Path:
    """The checkpoint ``name`` of ``size`` under ``out/hf/name-size``."""
    root = out / "hf" / f"{name}-{size}"
    root.mkdir(parents=True, exist_ok=True)
    architecture, model_type, moe, qkvz = CHECKPOINTS[name]
    cfg = hybrid_config(architecture, model_type, moe=moe, qkvz=qkvz, size=size)
    cfg["vocab_size"] = tokenizer_files(root)
    state = hybrid_state(cfg, moe="num_experts" in cfg)
    qkvz = cfg.pop("_qkvz")
    assert qkvz == any("in_proj_qkvz" in k for k in state), "config and weights agree"
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def convert(llama_src: Path, checkpoint: Path, outfile: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on ``checkpoint``, in a process of its own (the
    converter keeps per-run state in its classes). ``--no-mtp``: the tiny checkpoints have no
    multi-token-prediction block."""
    argv = [str(checkpoint), "--outfile", str(outfile), "--outtype", outtype, "--no-mtp"]
    subprocess.run(
        [sys.executable, __file__, "--run-converter", str(llama_src), *argv],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def run_converter(llama_src: str, argv: list[str]) -> int:
    """The converter's main with the tiny tokenizer's pre-tokenizer named (module docstring)."""
    sys.path.insert(0, llama_src)
    import convert_hf_to_gguf  # the vendored converter and its gguf-py
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # type: ignore[method-assign]
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--run-converter"]:
        return run_converter(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-src", required=True, type=Path, help="vendor/llama.cpp")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", help="the checkpoints whose name contains this")
    args = parser.parse_args()
    files = {}
    for name in CHECKPOINTS:
        if args.only and args.only not in name:
            continue
        for size, outtypes in (("tiny", ("f32", "f16")), ("wide", ("f32",))):
            checkpoint = write_checkpoint(name, size, args.out)
            for outtype in outtypes:
                path = args.out / f"{name}-{size}-{outtype.upper()}.gguf"
                convert(args.llama_src, checkpoint, path, outtype)
                files[f"{name}-{size}/{outtype.upper()}"] = str(path)
    print(json.dumps({"files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
