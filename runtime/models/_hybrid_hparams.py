"""The gated delta net's hyper-parameters (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): ``SSMShape`` and
what llama.cpp's hybrid loaders refuse of a config (``hybrid_problems``, called by
``HParams.__post_init__``); the modules read the keys (``qwen35.hybrid_kwargs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ggufswap.shards.archs import rules_of

if TYPE_CHECKING:
    from ggufswap.runtime.models.hparams import HParams


@dataclass(frozen=True)
class SSMShape:
    """The gated delta net of Qwen3.5 / Qwen3-Next (llama.cpp's ``ssm.*`` keys)."""

    d_conv: int  # ssm.conv_kernel: taps of the causal convolution
    d_inner: int  # ssm.inner_size: value heads x value head width
    d_state: int  # ssm.state_size: key (and value) head width
    n_v_heads: int  # ssm.time_step_rank
    n_k_heads: int  # ssm.group_count

    @property
    def head_v(self) -> int:
        return self.d_inner // self.n_v_heads if self.n_v_heads else 0

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.d_inner

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def problems(self) -> list[str]:
        """What llama.cpp's hybrid loaders and graphs assert of these sizes."""
        out = []
        if min(self.d_conv, self.d_inner, self.d_state, self.n_v_heads, self.n_k_heads) <= 0:
            out.append(f"ssm sizes must be > 0, found {self}")
        elif self.n_v_heads % self.n_k_heads:
            out.append(
                f"ssm.time_step_rank {self.n_v_heads} must be a multiple of ssm.group_count "
                f"{self.n_k_heads}"
            )
        elif self.head_v != self.d_state or self.d_inner % self.n_v_heads:
            out.append(
                f"ssm.inner_size {self.d_inner} must be ssm.state_size {self.d_state} x "
                f"ssm.time_step_rank {self.n_v_heads} (llama.cpp: S_k == S_v)"
            )
        return out


def hybrid_problems(config: HParams, *, head_dim: int) -> list[str]:
    """What llama.cpp's qwen35 / qwen35moe / qwen3next loaders and graphs refuse."""
    a = config.arch.value
    if config.ssm is None or config.recurrent_layers is None:
        return [f"{a}: the delta net's shape (SSMShape) and the layer pattern are missing"]
    problems = [f"{a}: {p}" for p in config.ssm.problems()]
    if len(config.recurrent_layers) != config.n_layer:
        problems.append(
            f"{a}: attention.recurrent_layers has {len(config.recurrent_layers)} entries for "
            f"{config.n_layer} blocks"
        )
    rules = rules_of(config.arch)
    sections = config.rope_sections
    if rules.rope_sections and (sections is None or sum(sections[:4]) > head_dim):
        problems.append(
            f"{a}: rope.dimension_sections {sections} must hold four values summing to at most "
            f"the head width {head_dim} (GGML_ASSERT(sect_dims <= ne0))"
        )
    return problems
