"""Tiny Hugging Face checkpoints of Qwen3-VL-MoE, Llama 4, MiniMax-M2, dots.llm1 and Gemma 4,
converted by llama.cpp's own converter; runs in ``.venv-convert`` beside ``convert_tiny.py``
(whose tokenizer, converter run and JSON output it shares).

``python convert_families.py --llama-src VENDOR/llama.cpp --out DIR [--only NAME]``: for each
checkpoint of ``CHECKPOINTS``, in two sizes (tiny: rows of 32 and more, for F32, F16 and Q8_0;
wide: every quantizable row 256 values, for K-quants), writes the checkpoint under
``DIR/hf/NAME-SIZE`` and converts it with ``convert_hf_to_gguf.py``: ``DIR/NAME-tiny-F32.gguf``,
``-tiny-F16``, ``-wide-F32``. Prints one JSON line ``{"files": {NAME-SIZE/TYPE: path}}``.

The weights are laid out as the released checkpoints lay them out, which is what the converter
reads: Qwen3-VL-MoE's text tower under ``model.language_model`` with its experts packed and
transposed (``gate_up_proj`` ``[E, d, 2f]``), Llama 4's packed ``feed_forward.experts``,
MiniMax-M2's per-expert ``block_sparse_moe.experts.N.w1/w2/w3`` and routing bias; Gemma 4 is
``transformers``' own ``Gemma4ForCausalLM`` saved by ``save_pretrained`` (its checkpoints are
that model's state). Values are random: matrices ``N(0, 1/fan_in)``, norms and scales near 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import convert_tiny
import torch
from convert_tiny import SEED, _normal, tokenizer_files
from safetensors.torch import save_file

# name -> per size: the widths each checkpoint writer reads.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "qwen3vlmoe": {
        "tiny": {"d": 64, "head": 16, "ff": 32},
        "wide": {"d": 256, "head": 64, "ff": 256},
    },
    "llama4": {
        "tiny": {"d": 64, "head": 16, "ff": 64, "ff_mlp": 128},
        "wide": {"d": 256, "head": 64, "ff": 256, "ff_mlp": 256},
    },
    "minimax-m2": {
        "tiny": {"d": 64, "head": 16, "ff": 64, "rot": 8},
        "wide": {"d": 256, "head": 64, "ff": 256, "rot": 32},
    },
    "dots1": {
        "tiny": {"d": 64, "head": 16, "ff": 32, "ff_mlp": 128},
        "wide": {"d": 256, "head": 64, "ff": 256, "ff_mlp": 256},
    },
    "gemma4": {
        "tiny": {"d": 64, "head": 16, "head_full": 32, "ff": 128, "ff_moe": 32},
        "wide": {"d": 256, "head": 64, "head_full": 128, "ff": 256, "ff_moe": 256},
    },
}
N_LAYER, N_HEAD, N_KV, N_EXPERT = 4, 4, 2, 4


def _near_one(g: torch.Generator, *shape: int) -> torch.Tensor:
    return 1.0 + 0.05 * torch.randn(*shape, generator=g)


def qwen3vlmoe(s: dict[str, int], vocab: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Qwen3-VL-MoE: qwen3moe's text blocks, interleaved M-RoPE sections over the whole head."""
    g = torch.Generator().manual_seed(SEED)
    d, hd, ff = s["d"], s["head"], s["ff"]
    pairs = hd // 2
    text = {
        "hidden_size": d,
        "intermediate_size": 2 * ff,
        "moe_intermediate_size": ff,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": hd,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 5000000.0,
        # Qwen3-VL's [24, 20, 20] over 64 pairs, scaled: one pair of each head stays unrotated
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [pairs // 2, pairs // 4, pairs // 4],
            "mrope_interleaved": True,
        },
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    cfg = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "text_config": text,
        "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27},
        "tie_word_embeddings": False,
    }
    p = "model.language_model."
    out = {
        p + "embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        p + "norm.weight": _near_one(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i in range(N_LAYER):
        b = f"{p}layers.{i}."
        out |= _attention(g, b + "self_attn.", d, hd, qk_norm=(hd, hd))
        out[b + "input_layernorm.weight"] = _near_one(g, d)
        out[b + "post_attention_layernorm.weight"] = _near_one(g, d)
        out[b + "mlp.gate.weight"] = _normal(g, N_EXPERT, d)
        out[b + "mlp.experts.gate_up_proj"] = _normal(g, N_EXPERT, 2 * ff, d).transpose(1, 2)
        out[b + "mlp.experts.down_proj"] = _normal(g, N_EXPERT, d, ff).transpose(1, 2)
    return cfg, out


def _attention(
    g: torch.Generator,
    a: str,
    d: int,
    hd: int,
    *,
    qk_norm: tuple[int, int] | None,
    n_kv: int = N_KV,
) -> dict[str, torch.Tensor]:
    out = {
        a + "q_proj.weight": _normal(g, N_HEAD * hd, d),
        a + "k_proj.weight": _normal(g, n_kv * hd, d),
        a + "v_proj.weight": _normal(g, n_kv * hd, d),
        a + "o_proj.weight": _normal(g, d, N_HEAD * hd),
    }
    if qk_norm is not None:
        out[a + "q_norm.weight"] = _near_one(g, qk_norm[0])
        out[a + "k_norm.weight"] = _near_one(g, qk_norm[1])
    return out


def llama4(s: dict[str, int], vocab: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Llama 4 (Maverick's pattern): MoE every 2nd block with a shared expert, chunked attention
    with a NoPE layer every 4th, llama3-type RoPE scaling over a short original context."""
    g = torch.Generator().manual_seed(SEED)
    d, hd, ff, ff_mlp = s["d"], s["head"], s["ff"], s["ff_mlp"]
    cfg = {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": d,
        "intermediate_size": ff,
        "intermediate_size_mlp": ff_mlp,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": hd,
        "num_local_experts": N_EXPERT,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "attention_chunk_size": 8192,
        "use_qk_norm": True,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    out = {
        "model.embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        "model.norm.weight": _near_one(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i in range(N_LAYER):
        b = f"model.layers.{i}."
        out |= _attention(g, b + "self_attn.", d, hd, qk_norm=None)
        out[b + "input_layernorm.weight"] = _near_one(g, d)
        out[b + "post_attention_layernorm.weight"] = _near_one(g, d)
        f = b + "feed_forward."
        if (i + 1) % 2 == 0:
            out[f + "router.weight"] = _normal(g, N_EXPERT, d)
            out[f + "experts.gate_up_proj"] = _normal(g, N_EXPERT, 2 * ff, d).transpose(1, 2)
            out[f + "experts.down_proj"] = _normal(g, N_EXPERT, d, ff).transpose(1, 2)
            names, width = (f + "shared_expert.",), ff
        else:
            names, width = (f,), ff_mlp
        for n in names:
            out[n + "gate_proj.weight"] = _normal(g, width, d)
            out[n + "up_proj.weight"] = _normal(g, width, d)
            out[n + "down_proj.weight"] = _normal(g, d, width)
    return cfg, {k: v.contiguous() for k, v in out.items()}


def minimax_m2(s: dict[str, int], vocab: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """MiniMax-M2: Q/K norms across heads, partial RoPE, sigmoid routing with its bias."""
    g = torch.Generator().manual_seed(SEED)
    d, hd, ff = s["d"], s["head"], s["ff"]
    cfg = {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": hd,
        "rotary_dim": s["rot"],
        "num_local_experts": N_EXPERT,
        "num_experts_per_tok": 2,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    out = {
        "model.embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        "model.norm.weight": _near_one(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i in range(N_LAYER):
        b = f"model.layers.{i}."
        out |= _attention(g, b + "self_attn.", d, hd, qk_norm=(N_HEAD * hd, N_KV * hd))
        out[b + "input_layernorm.weight"] = _near_one(g, d)
        out[b + "post_attention_layernorm.weight"] = _near_one(g, d)
        m = b + "block_sparse_moe."
        out[m + "gate.weight"] = _normal(g, N_EXPERT, d)
        out[m + "e_score_correction_bias"] = 0.1 * torch.randn(N_EXPERT, generator=g)
        for e in range(N_EXPERT):
            out[m + f"experts.{e}.w1.weight"] = _normal(g, ff, d)
            out[m + f"experts.{e}.w2.weight"] = _normal(g, d, ff)
            out[m + f"experts.{e}.w3.weight"] = _normal(g, ff, d)
    return cfg, out


def dots1(s: dict[str, int], vocab: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """dots.llm1: qwen3's attention (as many key/value heads as query heads) over DeepSeek-V3's
    blocks (a dense first block, sigmoid routing with its bias, a shared expert). Seed
    ``SEED + 1``: with ``SEED`` the F16 file had a near-tied routing choice (2nd and 3rd expert
    6.5e-5 apart, block 2, position 4) that llama.cpp's F16 arithmetic settled the other way and
    ggml's emulated rounding did not (mean KLD 1.1e-2, all of it at that position)."""
    g = torch.Generator().manual_seed(SEED + 1)
    d, hd, ff, ff_mlp = s["d"], s["head"], s["ff"], s["ff_mlp"]
    cfg = {
        "architectures": ["Dots1ForCausalLM"],
        "model_type": "dots1",
        "hidden_size": d,
        "intermediate_size": ff_mlp,
        "moe_intermediate_size": ff,
        "num_hidden_layers": 3,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD,
        "head_dim": hd,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    out = {
        "model.embed_tokens.weight": _normal(g, vocab, d, std=1.0),
        "model.norm.weight": _near_one(g, d),
        "lm_head.weight": _normal(g, vocab, d),
    }
    for i in range(3):
        b = f"model.layers.{i}."
        out |= _attention(g, b + "self_attn.", d, hd, qk_norm=(hd, hd), n_kv=N_HEAD)
        out[b + "input_layernorm.weight"] = _near_one(g, d)
        out[b + "post_attention_layernorm.weight"] = _near_one(g, d)
        m = b + "mlp."
        mlps = [(m, ff_mlp)]
        if i > 0:
            out[m + "gate.weight"] = _normal(g, 8, d)
            out[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(8, generator=g)
            mlps = [(m + f"experts.{e}.", ff) for e in range(8)]
            mlps.append((m + "shared_experts.", ff))
        for prefix, width in mlps:
            out[prefix + "gate_proj.weight"] = _normal(g, width, d)
            out[prefix + "up_proj.weight"] = _normal(g, width, d)
            out[prefix + "down_proj.weight"] = _normal(g, d, width)
    return cfg, out


def gemma4_checkpoint(root: Path, s: dict[str, int], vocab: int) -> None:
    """Gemma 4 31B's shape, tiny, with 26B-A4B's routed experts in every block: five sliding
    layers then a full one (wider heads, one key/value head, V = K), proportional RoPE,
    soft-capping 30; ``transformers``' Gemma4ForCausalLM with random weights, saved."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=s["d"],
        intermediate_size=s["ff"],
        num_hidden_layers=6,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV,
        head_dim=s["head"],
        global_head_dim=s["head_full"],
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=4,
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=N_EXPERT,
        top_k_experts=2,
        moe_intermediate_size=s["ff_moe"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = Gemma4ForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.ndim == 0 or "inv_freq" in name:
                continue
            if t.ndim == 1 or name.endswith("layer_scalar"):
                t.copy_(_near_one(g, *t.shape))
            else:
                t.copy_(_normal(g, *t.shape, std=1.0 if "embed_tokens" in name else None))
    model.save_pretrained(root, safe_serialization=True)


def gemma4_tokenizer(out: Path) -> int:
    """A byte-fallback BPE like Gemma's (what the converter's LlamaHfVocab reads): byte tokens,
    merges trained on a small text, ``▁`` for spaces."""
    from convert_tiny import CORPUS, VOCAB
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))  # noqa: S106 (a token)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB + 256, special_tokens=specials + byte_tokens, show_progress=False
    )
    tok.train_from_iterator([CORPUS] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


StateWriter = Callable[[dict[str, int], int], tuple[dict[str, Any], dict[str, torch.Tensor]]]
CHECKPOINTS: dict[str, StateWriter | None] = {
    "qwen3vlmoe": qwen3vlmoe,
    "llama4": llama4,
    "minimax-m2": minimax_m2,
    "dots1": dots1,
    "gemma4": None,  # transformers' model: gemma4_checkpoint
}


def write_checkpoint(name: str, size: str, out: Path) -> Path:
    """The checkpoint ``name`` of ``size`` under ``out/hf/name-size``."""
    root = out / "hf" / f"{name}-{size}"
    root.mkdir(parents=True, exist_ok=True)
    widths = SIZES[name][size]
    writer = CHECKPOINTS[name]
    if writer is None:
        gemma4_checkpoint(root, widths, gemma4_tokenizer(root))
        return root
    cfg, state = writer(widths, tokenizer_files(root))
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {k: v.float().contiguous() for k, v in state.items()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def convert(llama_src: Path, checkpoint: Path, outfile: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on ``checkpoint`` through ``convert_tiny.py``'s run
    (its named pre-tokenizer), in a process of its own; without ``--no-mtp``, which the
    converter refuses for models without multi-token prediction."""
    argv = [str(checkpoint), "--outfile", str(outfile), "--outtype", outtype]
    subprocess.run(
        [sys.executable, convert_tiny.__file__, "--run-converter", str(llama_src), *argv],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-src", required=True, type=Path, help="vendor/llama.cpp")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", help="the checkpoint of this name")
    args = parser.parse_args()
    files = {}
    for name in CHECKPOINTS:
        if args.only and args.only != name:
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
