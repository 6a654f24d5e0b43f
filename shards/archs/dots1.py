"""dots1 (rednote's dots.llm1): qwen3's attention (per-head Q/K norms, as many key/value heads
as query heads) over deepseek-style blocks: leading dense blocks, then routed experts (the file's
gating function, the optional ``exp_probs_b`` selection bias, groups, weights norm and scale)
plus ungated shared experts.

The torch-free spec of the architecture: what llama.cpp's loader and graph do for it (``RULES``,
read by the writer and by the runtime's ``HParams``), and what the writer does for it: its
refusals and keys (the shared plan writes its tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufswap.shards.archs._common import routing_metadata, u32
from ggufswap.shards.archs._rules import Experts, ExpertWidth, SharedExpert, WriterHooks, rules
from ggufswap.shards.keys import Arch, Keys
from ggufswap.shards.value_types import TypedValue

if TYPE_CHECKING:
    from ggufswap.shards.writer import ModelSpec

SOURCE = "llama_model_dots1::load_arch_hparams/load_arch_tensors (src/models/dots1.cpp)"


def errors(spec: ModelSpec, why: str) -> list[str]:
    """K and V are created {n_embd, n_head * head}; build_moe_ffn aborts without a gating
    function; the graph rotates the whole head."""
    out = []
    if spec.n_head_kv != spec.n_head:
        out.append(f"dots1 sizes attn_k/attn_v by n_head: n_head_kv must equal n_head {why}")
    if spec.expert_gating_func not in (1, 2):
        out.append(f"dots1 needs expert_gating_func 1 (softmax) or 2 (sigmoid) {why}")
    if spec.n_rot != spec.n_embd_head:
        out.append(f"dots1 rotates the whole head: rope_dim must be unset {why}")
    return out


def metadata(spec: ModelSpec) -> list[tuple[str, TypedValue]]:
    """As Dots1Model writes them: the leading dense blocks and the routing keys."""
    key = Keys.LLM.LEADING_DENSE_BLOCK_COUNT.format(spec.arch_name)
    return [(key, u32(spec.n_dense_lead)), *routing_metadata(spec)]


RULES = rules(
    Arch.DOTS1,
    SOURCE,
    experts=Experts.AFTER_DENSE_LEAD,
    expert_width=ExpertWidth.EXPERT_KEY,
    shared_expert=SharedExpert.COUNTED,
    tied_output=False,
    qk_norm=True,
    rope_dims_equal_head=True,
    norm_topk=False,
    writer=WriterHooks(errors=errors, metadata=metadata),
    llama_cpp_keys=(
        Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
        Keys.LLM.EXPERT_SHARED_COUNT,
        Keys.LLM.EXPERT_WEIGHTS_SCALE,
        Keys.LLM.EXPERT_WEIGHTS_NORM,
        Keys.LLM.EXPERT_GATING_FUNC,
    ),
)
