"""The reference decoder, its config reader and the perplexity loops."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from ggufswap.runtime.models.blocks import DictWeightProvider, MoEFeedForward, RotaryEmbedding
from ggufswap.runtime.models.errors import HParamsError, MissingWeightError
from ggufswap.runtime.models.hparams import Arch, HParams, RopeType
from ggufswap.runtime.models.llama import Transformer
from ggufswap.runtime.serving.perplexity import (
    NllStats,
    evaluate_batches,
    make_eval_tokens,
    perplexity,
    scored_per_chunk,
    token_windows,
)
from ggufswap.shards.presets import tiny_dense, tiny_moe
from ggufswap.shards.writer import ModelSpec, write_model

V = 61  # vocab: odd on purpose, so no shape coincides with another


def tiny_config(arch: Arch = Arch.LLAMA, **kw: Any) -> HParams:
    base: dict[str, Any] = {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 4,
        "n_head_kv": 2,
        "n_vocab": V,
        "n_ff": 48,
        "context_length": 8,  # shorter than the test sequences: the RoPE cache must grow
    }
    if arch is not Arch.LLAMA or kw.get("n_expert"):
        base.update(n_expert=4, n_expert_used=2, n_ff_exp=24)
    base.update(kw)
    return HParams(arch=arch, **base)


def random_weights(
    c: HParams,
    *,
    seed: int = 0,
    shared_expert: bool = False,
    qk_norm: bool = False,
    qkv_bias: bool = False,
    tied: bool = False,
) -> dict[str, torch.Tensor]:
    """Random llama.cpp-named weights for ``c`` (norms near 1, matrices ~ 1/sqrt(fan_in))."""
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}

    def mat(name: str, *shape: int) -> None:
        t[name] = torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def norm(name: str, n: int) -> None:
        t[name] = 1.0 + 0.1 * torch.randn(n, generator=g)

    d, hd, q, kv = c.n_embd, c.head_dim, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    mat("token_embd.weight", c.n_vocab, d)
    norm("output_norm.weight", d)
    if not tied:
        mat("output.weight", c.n_vocab, d)
    for i in range(c.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        mat(p + "attn_q.weight", q, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d)
        mat(p + "attn_output.weight", d, q)
        if qkv_bias:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                t[p + name + ".bias"] = 0.1 * torch.randn(n, generator=g)
        if qk_norm:
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if c.is_moe:
            e, f = c.n_expert, c.n_ff_exp
            mat(p + "ffn_gate_inp.weight", e, d)
            mat(p + "ffn_gate_exps.weight", e, f, d)
            mat(p + "ffn_up_exps.weight", e, f, d)
            mat(p + "ffn_down_exps.weight", e, d, f)
            if shared_expert:
                sh = c.n_ff_shexp  # qwen2moe: expert_shared_feed_forward_length, else n_ff
                mat(p + "ffn_gate_shexp.weight", sh, d)
                mat(p + "ffn_up_shexp.weight", sh, d)
                mat(p + "ffn_down_shexp.weight", d, sh)
                mat(p + "ffn_gate_inp_shexp.weight", d)
        else:
            mat(p + "ffn_gate.weight", c.n_ff, d)
            mat(p + "ffn_up.weight", c.n_ff, d)
            mat(p + "ffn_down.weight", d, c.n_ff)
    return t


def build(arch: Arch = Arch.LLAMA, *, seed: int = 0, **kw: Any) -> tuple[Transformer, Any]:
    flags = {k: kw.pop(k) for k in ("shared_expert", "qk_norm", "qkv_bias", "tied") if k in kw}
    c = tiny_config(arch, **kw)
    provider = DictWeightProvider(random_weights(c, seed=seed, **flags))
    return Transformer(c, provider), provider


def tokens(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


VARIANTS: list[tuple[Arch, dict[str, Any]]] = [
    (Arch.LLAMA, {}),
    (Arch.LLAMA, {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 24, "tied": True}),
    (Arch.QWEN2MOE, {"shared_expert": True, "qkv_bias": True}),
    (Arch.QWEN3MOE, {"qk_norm": True, "key_length": 16}),
]
VARIANT_IDS = ["llama-dense", "llama-moe-tied", "qwen2moe", "qwen3moe"]


# --- the model -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_forward_gives_float32_logits_per_position(arch: Arch, kw: dict[str, Any]) -> None:
    """forward maps tokens [B, T] to finite float32 logits [B, T, V]."""
    model, _ = build(arch, **kw)
    logits = model(tokens(3, 11))
    assert logits.shape == (3, 11, V)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("arch", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_changing_a_later_token_leaves_earlier_logits_unchanged(
    arch: Arch, kw: dict[str, Any]
) -> None:
    """Attention is causal: logits before position t do not depend on the token at t."""
    model, _ = build(arch, **kw)
    a = tokens(2, 12)
    b = a.clone()
    b[:, 7] = (b[:, 7] + 1) % V
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :7], lb[:, :7])
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


@pytest.mark.parametrize(("arch", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_two_runs_are_bit_identical(arch: Arch, kw: dict[str, Any]) -> None:
    """Two forwards of the same tokens on CPU give bit-identical logits."""
    model, _ = build(arch, **kw)
    x = tokens(2, 16)
    assert torch.equal(model(x), model(x))


def naive_moe(ffn: MoEFeedForward, x: torch.Tensor, arch: Arch) -> torch.Tensor:
    """Per-token MoE written from llama.cpp's description, independent of the model's code."""
    w = ffn.weights.weight
    k = ffn.config.n_expert_used
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = w(ffn.router) @ x[n]
        order = sorted(range(len(logits)), key=lambda e: -float(logits[e]))[:k]
        if arch is Arch.LLAMA:  # Mixtral: softmax over the selected logits
            gates = torch.softmax(logits[order], dim=0)
        else:
            probs = torch.softmax(logits, dim=0)[order]
            gates = probs / probs.sum() if arch is Arch.QWEN3MOE else probs
        for gate, e in zip(gates, order, strict=True):
            h = F.silu(w(ffn.gate_exps)[e] @ x[n]) * (w(ffn.up_exps)[e] @ x[n])
            out[n] += gate * (w(ffn.down_exps)[e] @ h)
        if ffn.shared is not None:
            g, u, d = (w(name) for name in ffn.shared)
            sh = d @ (F.silu(g @ x[n]) * (u @ x[n]))
            out[n] += torch.sigmoid(w(ffn.shared_gate or "") @ x[n]) * sh
    return out


@pytest.mark.parametrize(("arch", "kw"), VARIANTS[1:], ids=VARIANT_IDS[1:])
def test_moe_routing_matches_a_naive_per_token_reference(arch: Arch, kw: dict[str, Any]) -> None:
    """The MoE layer equals a per-token loop over each token's top-k experts."""
    model, _ = build(arch, **kw)
    ffn = model.layers[1].feed_forward
    assert isinstance(ffn, MoEFeedForward)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    expected = naive_moe(ffn, x.reshape(-1, 32), arch).view_as(x)
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-5)


def test_top_k_equal_to_n_expert_is_the_dense_softmax_mixture() -> None:
    """With every expert used and renormalised, MoE = sum over all experts of softmax * expert."""
    model, _ = build(Arch.QWEN3MOE, n_expert_used=4)
    ffn = model.layers[0].feed_forward
    assert isinstance(ffn, MoEFeedForward)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(6))
    w = ffn.weights.weight
    probs = torch.softmax(x @ w(ffn.router).T, dim=-1)  # [N, E]
    h = F.silu(torch.einsum("nd,efd->nef", x, w(ffn.gate_exps)))
    h = h * torch.einsum("nd,efd->nef", x, w(ffn.up_exps))
    y = torch.einsum("nef,edf->ned", h, w(ffn.down_exps))  # [N, E, D]
    torch.testing.assert_close(ffn(x), (probs[..., None] * y).sum(1), rtol=1e-5, atol=1e-5)


def test_swapped_weight_is_visible_at_the_next_forward_and_swapping_back_restores() -> None:
    """A provider change shows at the next forward; restoring it restores the logits bit-exactly."""
    model, provider = build(Arch.QWEN3MOE, qk_norm=True)
    x = tokens(2, 10)
    before = model(x)
    name = "blk.1.ffn_down_exps.weight"
    original = provider.weight(name)
    provider.set(name, original * 1.5)
    assert not torch.allclose(model(x), before)
    provider.set(name, original)
    assert torch.equal(model(x), before)


def test_qk_norm_and_biases_are_read_only_when_the_file_has_them() -> None:
    """Optional tensors (qwen3 q/k norms, qwen2 biases, shared expert) are read iff present."""
    llama, _ = build(Arch.LLAMA)
    qwen3, _ = build(Arch.QWEN3MOE, qk_norm=True)
    qwen2, _ = build(Arch.QWEN2MOE, shared_expert=True, qkv_bias=True)
    assert not any("norm.weight" in n and "attn_q" in n for n in llama.required)
    assert "blk.0.attn_q_norm.weight" in qwen3.required
    assert "blk.0.attn_k_norm.weight" in qwen3.required
    assert "blk.1.attn_q.bias" in qwen2.required
    assert "blk.0.ffn_gate_inp_shexp.weight" in qwen2.required


def test_tied_output_reads_token_embd() -> None:
    """Without output.weight the head is token_embd.weight, and a change to it reaches the head."""
    model, provider = build(Arch.LLAMA, tied=True)
    assert model.output == "token_embd.weight"
    x = tokens(1, 6)
    before = model(x)
    provider.set("token_embd.weight", provider.weight("token_embd.weight") * 2)
    assert not torch.allclose(model(x), before)


def test_missing_and_misshapen_weights_are_all_named() -> None:
    """Construction fails with one error naming every missing tensor and every wrong shape."""
    c = tiny_config(Arch.LLAMA)
    w = random_weights(c)
    del w["blk.0.attn_q.weight"], w["blk.1.ffn_up.weight"]
    w["blk.1.attn_k.weight"] = torch.zeros(3, 32)
    with pytest.raises(MissingWeightError) as exc:
        Transformer(c, DictWeightProvider(w))
    assert "blk.0.attn_q.weight: missing" in str(exc.value)
    assert "blk.1.ffn_up.weight: missing" in str(exc.value)
    w["blk.0.attn_q.weight"] = torch.zeros(32, 32)
    w["blk.1.ffn_up.weight"] = torch.zeros(48, 32)
    with pytest.raises(
        MissingWeightError, match=r"blk\.1\.attn_k\.weight: expected shape \[16, 32\]"
    ):
        Transformer(c, DictWeightProvider(w))


def _halves_from_pairs(n: int) -> torch.Tensor:
    """Index that reorders interleaved pairs (x0 y0 x1 y1 ...) into halves (x0 x1 ... y0 y1 ...)."""
    return torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2)))


def rotate(arch: Arch, x: torch.Tensor, start: int) -> torch.Tensor:
    """RoPE of ``arch`` applied to x [B, T, H, hd] at positions start .. start + T - 1."""
    return RotaryEmbedding(tiny_config(arch))(start, x.shape[1], x.device).rotate(x)


def test_rope_norm_equals_neox_on_permuted_dims() -> None:
    """RoPE NORM rotates adjacent pairs: it is NEOX applied to the pair-to-halves permutation."""
    rope_types = (tiny_config(Arch.LLAMA).rope_type, tiny_config(Arch.QWEN3MOE).rope_type)
    assert rope_types == (RopeType.NORM, RopeType.NEOX)
    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(7))
    perm = _halves_from_pairs(8)
    torch.testing.assert_close(
        rotate(Arch.LLAMA, x, 3)[..., perm], rotate(Arch.QWEN3MOE, x[..., perm], 3)
    )


@pytest.mark.parametrize("arch", [Arch.LLAMA, Arch.QWEN3MOE])
def test_rope_scores_depend_only_on_relative_position(arch: Arch) -> None:
    """q·k after RoPE is unchanged by shifting both positions, and position 0 is the identity."""
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    torch.testing.assert_close(rotate(arch, q, 0), q)

    def score(pq: int, pk: int) -> torch.Tensor:
        return (rotate(arch, q, pq) * rotate(arch, k, pk)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_start_pos_offsets_rope_and_attention_sees_only_relative_positions() -> None:
    """start_pos selects the RoPE rows from that position on (the hook for a KV cache), and
    shifting every position leaves the logits unchanged up to rounding (RoPE is relative)."""
    model, _ = build(Arch.LLAMA)
    cpu = torch.device("cpu")
    shifted, full = model.rope(5, 3, cpu), model.rope(0, 40, cpu)
    assert torch.equal(shifted.cos, full.cos[5:8])
    assert torch.equal(shifted.sin, full.sin[5:8])
    x = tokens(1, 6)
    torch.testing.assert_close(model(x, start_pos=30), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a mixed pool")
def test_weights_split_between_cpu_and_cuda_give_the_cpu_logits() -> None:
    """With some weights on CUDA (mixed pools), activations follow them and the logits match CPU."""
    model, provider = build(Arch.QWEN2MOE, shared_expert=True, qkv_bias=True)
    x = tokens(2, 10)
    expected = model(x)
    for name in list(provider.names()):
        if name.startswith("blk.1.") or name == "output.weight":
            provider.set(name, provider.weight(name).cuda())
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(x.cuda()).cpu(), expected, rtol=1e-4, atol=1e-4)


# --- the config ----------------------------------------------------------------------------------


def metadata(arch: str, **extra: Any) -> dict[str, Any]:
    md: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 32,
        f"{arch}.feed_forward_length": 48,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1e6,
        f"{arch}.context_length": 128,
        f"{arch}.vocab_size": V,
    }
    md.update({f"{arch}.{k}": v for k, v in extra.items()})
    return md


MOE_KEYS = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 16}


def test_config_reads_each_architecture_with_its_rope_and_routing() -> None:
    """llama is NORM rope with renormalised top-k, qwen2moe NEOX without, qwen3moe NEOX with."""
    llama = HParams.from_metadata(metadata("llama"))
    mixtral = HParams.from_metadata(metadata("llama", **MOE_KEYS))
    qwen2 = HParams.from_metadata(metadata("qwen2moe", **MOE_KEYS))
    head16 = {"attention.key_length": 16, "attention.value_length": 16}
    qwen3 = HParams.from_metadata(metadata("qwen3moe", **MOE_KEYS, **head16))
    assert (llama.rope_type, llama.is_moe, llama.head_dim, llama.n_ff) == (
        RopeType.NORM,
        False,
        8,
        48,
    )
    assert (mixtral.is_moe, mixtral.norm_topk, mixtral.n_expert_used) == (True, True, 2)
    assert (qwen2.rope_type, qwen2.norm_topk) == (RopeType.NEOX, False)
    assert (qwen3.rope_type, qwen3.norm_topk, qwen3.head_dim) == (RopeType.NEOX, True, 16)
    assert (qwen3.rope_base, qwen3.norm_eps, qwen3.n_ff_exp) == (1e6, pytest.approx(1e-6), 16)


def test_config_vocab_falls_back_to_the_tokenizer_then_to_the_argument() -> None:
    """Without {arch}.vocab_size, n_vocab comes from the token list, else from n_vocab=."""
    md = metadata("llama")
    del md["llama.vocab_size"]
    assert HParams.from_metadata(md, n_vocab=77).n_vocab == 77
    md["tokenizer.ggml.tokens"] = ["a"] * 9
    assert HParams.from_metadata(md, n_vocab=77).n_vocab == 9
    del md["tokenizer.ggml.tokens"]
    with pytest.raises(HParamsError, match=r"llama\.vocab_size"):
        HParams.from_metadata(md)


def test_config_names_every_missing_key() -> None:
    """A metadata map missing several keys gets one error listing all of them."""
    md = metadata("qwen3moe", **MOE_KEYS)
    del md["qwen3moe.block_count"], md["qwen3moe.attention.layer_norm_rms_epsilon"]
    with pytest.raises(HParamsError) as exc:
        HParams.from_metadata(md)
    assert "'qwen3moe.block_count'" in str(exc.value)
    assert "'qwen3moe.attention.layer_norm_rms_epsilon'" in str(exc.value)


def test_config_rejects_an_unsupported_architecture_by_name() -> None:
    """An unimplemented architecture is refused, naming it and the supported ones."""
    with pytest.raises(
        HParamsError, match=r"'mamba'.*llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma3"
    ):
        HParams.from_metadata(metadata("mamba"))
    with pytest.raises(HParamsError, match=r"general\.architecture"):
        HParams.from_metadata({})


def test_config_rejects_inconsistent_dimensions() -> None:
    """Head counts that do not divide, or an MoE arch without experts, are refused."""
    with pytest.raises(HParamsError, match="multiple of n_head_kv"):
        tiny_config(Arch.LLAMA, n_head_kv=3)
    with pytest.raises(HParamsError, match="needs expert_count"):
        HParams.from_metadata(metadata("qwen3moe"))


# --- perplexity ----------------------------------------------------------------------------------


def uniform_model(tokens: torch.Tensor) -> torch.Tensor:
    """A language model that knows nothing: equal logits for every token."""
    return torch.zeros(*tokens.shape, V)


def bigram_model(stream: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A count-based bigram model fitted on ``stream`` (add-one smoothing)."""
    counts = torch.ones(V, V)
    counts.index_put_((stream[:-1], stream[1:]), torch.ones(stream.numel() - 1), accumulate=True)
    log_probs = counts.log() - counts.sum(1, keepdim=True).log()
    return lambda tokens: log_probs[tokens]


def test_uniform_model_has_perplexity_equal_to_the_vocab_size() -> None:
    """A model with equal logits has perplexity n_vocab."""
    stream = make_eval_tokens(V, 1000, seed=0)
    ppl = perplexity(uniform_model, stream, ctx=32, batch_size=4)
    assert ppl == pytest.approx(V, rel=1e-6)  # float32 log-softmax


def test_eval_tokens_are_deterministic_and_learnable() -> None:
    """The stream depends only on the seed, and a bigram model fitted on it beats uniform by far."""
    a, b = make_eval_tokens(V, 4000, seed=3), make_eval_tokens(V, 4000, seed=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, make_eval_tokens(V, 4000, seed=4))
    assert a.dtype == torch.int64
    assert 0 <= int(a.min())
    assert int(a.max()) < V
    ppl = perplexity(bigram_model(a[:3000]), a[3000:], ctx=50, batch_size=5)
    assert ppl < V / 4


def test_perplexity_is_deterministic_and_independent_of_batch_size() -> None:
    """Repeated evaluation is bit-identical; regrouping windows into batches changes nothing."""
    model, _ = build(Arch.QWEN3MOE, qk_norm=True)
    stream = make_eval_tokens(V, 200, seed=1)
    p1 = perplexity(model, stream, ctx=16, batch_size=3)
    assert p1 == perplexity(model, stream, ctx=16, batch_size=3)
    assert p1 == pytest.approx(perplexity(model, stream, ctx=16, batch_size=12), rel=1e-6)
    assert math.isfinite(p1)
    assert p1 > 1


def test_token_windows_drop_the_partial_tail() -> None:
    """A stream splits into whole ctx windows grouped by batch_size; the remainder is dropped."""
    batches = token_windows(torch.arange(50), ctx=8, batch_size=4)
    assert [tuple(b.shape) for b in batches] == [(4, 8), (2, 8)]
    assert torch.equal(torch.cat(batches).flatten(), torch.arange(48))


def test_evaluate_batches_attributes_nll_to_the_weight_version_of_each_batch() -> None:
    """between_batches runs before each batch; a batch's NLL lands under the version it ran on."""
    model, provider = build(Arch.QWEN3MOE, qk_norm=True)
    batches = token_windows(make_eval_tokens(V, 16 * 6, seed=2), ctx=16, batch_size=1)
    name = "blk.0.ffn_up_exps.weight"
    original = provider.weight(name)
    calls: list[int] = []

    def at_batch_boundary() -> int:  # swaps at the 3rd boundary, like a committed plan
        calls.append(len(calls))
        if len(calls) == 3:
            provider.set(name, original.flip(0))
        return 0 if len(calls) < 3 else 1

    result = evaluate_batches(model, batches, between_batches=at_batch_boundary)
    assert calls == list(range(6))
    assert list(result) == [0, 1]
    assert (result[0].n_batches, result[1].n_batches) == (2, 4)
    assert result[0].n_tokens == 2 * scored_per_chunk(16)  # the second half of each window
    provider.set(name, original)
    v0 = evaluate_batches(model, batches[:2], between_batches=lambda: 7)[7]
    assert v0 == result[0]
    assert result[1].mean_nll != pytest.approx(result[0].mean_nll)


def test_nll_stats_add_and_refuse_an_empty_mean() -> None:
    """NllStats sum field-wise; the mean of zero tokens is an error, not a NaN."""
    s = NllStats(2.0, 4, 1) + NllStats(1.0, 2, 1)
    assert s == NllStats(3.0, 6, 2)
    assert s.perplexity == pytest.approx(math.exp(0.5))
    with pytest.raises(ValueError, match="no tokens"):
        _ = NllStats().mean_nll


# --- a real GGUF file ----------------------------------------------------------------------------


def load_gguf(path: Path) -> tuple[dict[str, Any], DictWeightProvider]:
    """Metadata and dequantized float32 weights of one GGUF file, via gguf-py."""
    import gguf

    reader = gguf.GGUFReader(path)
    md = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    weights = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml ne -> torch order
        weights[t.name] = torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))
    return md, DictWeightProvider(weights)


@pytest.mark.parametrize("preset", [tiny_moe, tiny_dense], ids=["tiny_moe", "tiny_dense"])
def test_a_written_gguf_model_runs(preset: Callable[[], ModelSpec], tmp_path: Path) -> None:
    """A model written by shards.writer loads through gguf-py and gives a finite perplexity."""
    path = write_model(preset(), tmp_path)[0]
    md, provider = load_gguf(path)
    config = HParams.from_metadata(md)
    assert config.arch.value == md["general.architecture"]
    model = Transformer(config, provider)
    stream = make_eval_tokens(config.n_vocab, 256, seed=0)
    ppl = perplexity(model, stream, ctx=64, batch_size=2)
    assert math.isfinite(ppl)
    assert ppl > 1
