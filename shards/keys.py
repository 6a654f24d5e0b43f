"""The GGUF metadata keys the project reads, in one namespace (never bare literals in logic)."""

from __future__ import annotations

import enum
from typing import Final


class Arch(str, enum.Enum):
    """The ``general.architecture`` values the project writes and the reference runtime runs."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN2MOE = "qwen2moe"
    QWEN3 = "qwen3"
    QWEN3MOE = "qwen3moe"
    GEMMA3 = "gemma3"
    DEEPSEEK2 = "deepseek2"
    GLM4MOE = "glm4moe"
    GPT_OSS = "gpt-oss"
    QWEN3VLMOE = "qwen3vlmoe"
    MINIMAX_M2 = "minimax-m2"
    LLAMA4 = "llama4"
    GEMMA4 = "gemma4"
    DOTS1 = "dots1"
    QWEN35 = "qwen35"
    QWEN35MOE = "qwen35moe"
    QWEN3NEXT = "qwen3next"
    DEEPSEEK32 = "deepseek32"
    GLM_DSA = "glm-dsa"


class Keys:
    """Metadata keys, grouped as gguf-py's ``Keys`` does."""

    class General:
        ARCHITECTURE: Final = "general.architecture"
        NAME: Final = "general.name"
        ALIGNMENT: Final = "general.alignment"
        FILE_TYPE: Final = "general.file_type"

    class Split:
        NO: Final = "split.no"
        COUNT: Final = "split.count"
        TENSORS_COUNT: Final = "split.tensors.count"

    class LLM:
        """Per-architecture keys: ``Keys.LLM.BLOCK_COUNT.format(arch)``."""

        CONTEXT_LENGTH: Final = "{}.context_length"
        EMBEDDING_LENGTH: Final = "{}.embedding_length"
        BLOCK_COUNT: Final = "{}.block_count"
        FEED_FORWARD_LENGTH: Final = "{}.feed_forward_length"
        EXPERT_FEED_FORWARD_LENGTH: Final = "{}.expert_feed_forward_length"
        EXPERT_SHARED_FEED_FORWARD_LENGTH: Final = "{}.expert_shared_feed_forward_length"
        EXPERT_COUNT: Final = "{}.expert_count"
        EXPERT_USED_COUNT: Final = "{}.expert_used_count"
        VOCAB_SIZE: Final = "{}.vocab_size"
        HEAD_COUNT: Final = "{}.attention.head_count"
        HEAD_COUNT_KV: Final = "{}.attention.head_count_kv"
        KEY_LENGTH: Final = "{}.attention.key_length"
        VALUE_LENGTH: Final = "{}.attention.value_length"
        RMS_EPS: Final = "{}.attention.layer_norm_rms_epsilon"
        ROPE_FREQ_BASE: Final = "{}.rope.freq_base"
        ROPE_DIMENSION_COUNT: Final = "{}.rope.dimension_count"
        ROPE_SCALING_TYPE: Final = "{}.rope.scaling.type"
        ROPE_SCALING_FACTOR: Final = "{}.rope.scaling.factor"
        ROPE_SCALE_LINEAR: Final = "{}.rope.scale_linear"  # the old name of scaling.factor
        ROPE_FREQ_BASE_SWA: Final = "{}.rope.freq_base_swa"
        EXPERT_WEIGHTS_NORM: Final = "{}.expert_weights_norm"
        EXPERT_WEIGHTS_SCALE: Final = "{}.expert_weights_scale"
        EXPERT_GATING_FUNC: Final = "{}.expert_gating_func"
        SLIDING_WINDOW: Final = "{}.attention.sliding_window"
        SLIDING_WINDOW_PATTERN: Final = "{}.attention.sliding_window_pattern"
        FINAL_LOGIT_SOFTCAPPING: Final = "{}.final_logit_softcapping"
        # deepseek2 (multi-head latent attention, grouped routing, YaRN)
        LEADING_DENSE_BLOCK_COUNT: Final = "{}.leading_dense_block_count"
        EXPERT_SHARED_COUNT: Final = "{}.expert_shared_count"
        EXPERT_GROUP_COUNT: Final = "{}.expert_group_count"
        EXPERT_GROUP_USED_COUNT: Final = "{}.expert_group_used_count"
        Q_LORA_RANK: Final = "{}.attention.q_lora_rank"
        KV_LORA_RANK: Final = "{}.attention.kv_lora_rank"
        KEY_LENGTH_MLA: Final = "{}.attention.key_length_mla"
        VALUE_LENGTH_MLA: Final = "{}.attention.value_length_mla"
        # YaRN (deepseek2, gpt-oss): the training context the scaling extends, a magnitude factor
        ROPE_SCALING_ORIG_CTX_LEN: Final = "{}.rope.scaling.original_context_length"
        ROPE_SCALING_ATTN_FACTOR: Final = "{}.rope.scaling.attn_factor"
        ROPE_SCALING_YARN_LOG_MUL: Final = "{}.rope.scaling.yarn_log_multiplier"
        NEXTN_PREDICT_LAYERS: Final = "{}.nextn_predict_layers"
        ROPE_DIMENSION_SECTIONS: Final = "{}.rope.dimension_sections"  # glm4moe: refused
        # qwen3vlmoe: vision features added to the first blocks' outputs (zero for text)
        NUM_DEEPSTACK_LAYERS: Final = "{}.n_deepstack_layers"
        # llama4: every n-th block is MoE (chunked attention and NoPE layers are llama.cpp's own)
        INTERLEAVE_MOE_LAYER_STEP: Final = "{}.interleave_moe_layer_step"
        # gemma4: trailing blocks reusing earlier blocks' keys and values, per-layer embeddings
        SHARED_KV_LAYERS: Final = "{}.attention.shared_kv_layers"
        EMBEDDING_LENGTH_PER_LAYER: Final = "{}.embedding_length_per_layer_input"
        # Read by llama.cpp for every architecture (llama_model_base::load_hparams); each
        # changes what a model computes where its value is not the default.
        ATTENTION_CAUSAL: Final = "{}.attention.causal"
        KEY_LENGTH_SWA: Final = "{}.attention.key_length_swa"
        VALUE_LENGTH_SWA: Final = "{}.attention.value_length_swa"
        ROPE_DIMENSION_COUNT_SWA: Final = "{}.rope.dimension_count_swa"
        ROPE_SCALING_ALPHA: Final = "{}.rope.scaling.alpha"
        # deepseek2 (read by its loader, not implemented: refused)
        ATTENTION_TEMPERATURE_SCALE: Final = "{}.attention.temperature_scale"
        ATTENTION_TEMPERATURE_LENGTH: Final = "{}.attention.temperature_length"
        # qwen35 / qwen35moe / qwen3next: gated delta-net layers and the layer pattern
        SSM_CONV_KERNEL: Final = "{}.ssm.conv_kernel"
        SSM_INNER_SIZE: Final = "{}.ssm.inner_size"
        SSM_STATE_SIZE: Final = "{}.ssm.state_size"
        SSM_TIME_STEP_RANK: Final = "{}.ssm.time_step_rank"
        SSM_GROUP_COUNT: Final = "{}.ssm.group_count"
        FULL_ATTENTION_INTERVAL: Final = "{}.full_attention_interval"
        ATTENTION_RECURRENT_LAYERS: Final = "{}.attention.recurrent_layers"
        # deepseek32 / glm-dsa: the DSA lightning indexer (glm-dsa: which layers run their own)
        INDEXER_HEAD_COUNT: Final = "{}.attention.indexer.head_count"
        INDEXER_KEY_LENGTH: Final = "{}.attention.indexer.key_length"
        INDEXER_TOP_K: Final = "{}.attention.indexer.top_k"
        INDEXER_TYPES: Final = "{}.attention.indexer.types"

    class Tokenizer:
        MODEL: Final = "tokenizer.ggml.model"
        TOKENS: Final = "tokenizer.ggml.tokens"
        SCORES: Final = "tokenizer.ggml.scores"
        TOKEN_TYPE: Final = "tokenizer.ggml.token_type"
        MERGES: Final = "tokenizer.ggml.merges"
        BOS_ID: Final = "tokenizer.ggml.bos_token_id"
        EOS_ID: Final = "tokenizer.ggml.eos_token_id"
        PRE: Final = "tokenizer.ggml.pre"
        UNK_ID: Final = "tokenizer.ggml.unknown_token_id"
        ADD_BOS: Final = "tokenizer.ggml.add_bos_token"
        ADD_EOS: Final = "tokenizer.ggml.add_eos_token"
        ADD_SPACE_PREFIX: Final = "tokenizer.ggml.add_space_prefix"


class TensorNames:
    """llama.cpp tensor names (gguf-py's ``TENSOR_NAMES``, checked by the tests); per-layer
    templates are formatted with the block index."""

    TOKEN_EMBD: Final = "token_embd.weight"
    OUTPUT_NORM: Final = "output_norm.weight"
    OUTPUT: Final = "output.weight"
    ROPE_FREQS: Final = "rope_freqs.weight"
    ATTN_NORM: Final = "blk.{}.attn_norm.weight"
    ATTN_Q: Final = "blk.{}.attn_q.{}"  # second field: weight or bias
    ATTN_K: Final = "blk.{}.attn_k.{}"
    ATTN_V: Final = "blk.{}.attn_v.{}"
    ATTN_OUT: Final = "blk.{}.attn_output.{}"
    ATTN_Q_NORM: Final = "blk.{}.attn_q_norm.weight"
    ATTN_K_NORM: Final = "blk.{}.attn_k_norm.weight"
    ATTN_POST_NORM: Final = "blk.{}.post_attention_norm.weight"  # gemma3
    FFN_NORM: Final = "blk.{}.ffn_norm.weight"
    FFN_POST_NORM: Final = "blk.{}.post_ffw_norm.weight"  # gemma3
    # gemma4's MoE blocks: second pre/post norms, router and per-expert scales; layer scale
    FFN_PRE_NORM_2: Final = "blk.{}.pre_ffw_norm_2.weight"
    FFN_POST_NORM_1: Final = "blk.{}.post_ffw_norm_1.weight"
    FFN_POST_NORM_2: Final = "blk.{}.post_ffw_norm_2.weight"
    FFN_GATE_INP_SCALE: Final = "blk.{}.ffn_gate_inp.scale"
    FFN_DOWN_EXPS_SCALE: Final = "blk.{}.ffn_down_exps.scale"
    FFN_GATE_UP_EXPS: Final = "blk.{}.ffn_gate_up_exps.weight"
    LAYER_OUT_SCALE: Final = "blk.{}.layer_output_scale.weight"
    PER_LAYER_TOKEN_EMBD: Final = "per_layer_token_embd.weight"
    ATTN_SINKS: Final = "blk.{}.attn_sinks.weight"  # gpt-oss: [n_head] logits
    FFN_GATE: Final = "blk.{}.ffn_gate.weight"
    FFN_UP: Final = "blk.{}.ffn_up.weight"
    FFN_DOWN: Final = "blk.{}.ffn_down.weight"
    FFN_GATE_INP: Final = "blk.{}.ffn_gate_inp.weight"
    FFN_GATE_EXPS: Final = "blk.{}.ffn_gate_exps.weight"
    FFN_UP_EXPS: Final = "blk.{}.ffn_up_exps.weight"
    FFN_DOWN_EXPS: Final = "blk.{}.ffn_down_exps.weight"
    # gpt-oss: the router's and the experts' biases ([n_expert], [n_ff_exp or n_embd, n_expert]).
    FFN_GATE_INP_BIAS: Final = "blk.{}.ffn_gate_inp.bias"
    FFN_GATE_EXPS_BIAS: Final = "blk.{}.ffn_gate_exps.bias"
    FFN_UP_EXPS_BIAS: Final = "blk.{}.ffn_up_exps.bias"
    FFN_DOWN_EXPS_BIAS: Final = "blk.{}.ffn_down_exps.bias"
    FFN_GATE_SHEXP: Final = "blk.{}.ffn_gate_shexp.weight"
    FFN_UP_SHEXP: Final = "blk.{}.ffn_up_shexp.weight"
    FFN_DOWN_SHEXP: Final = "blk.{}.ffn_down_shexp.weight"
    FFN_GATE_INP_SHEXP: Final = "blk.{}.ffn_gate_inp_shexp.weight"
    FFN_EXP_PROBS_B: Final = "blk.{}.exp_probs_b.bias"
    # deepseek2's multi-head latent attention
    ATTN_Q_A: Final = "blk.{}.attn_q_a.weight"
    ATTN_Q_B: Final = "blk.{}.attn_q_b.weight"
    ATTN_Q_A_NORM: Final = "blk.{}.attn_q_a_norm.weight"
    ATTN_KV_A_MQA: Final = "blk.{}.attn_kv_a_mqa.weight"
    ATTN_KV_A_NORM: Final = "blk.{}.attn_kv_a_norm.weight"
    ATTN_KV_B: Final = "blk.{}.attn_kv_b.weight"
    ATTN_K_B: Final = "blk.{}.attn_k_b.weight"
    ATTN_V_B: Final = "blk.{}.attn_v_b.weight"
    # qwen35 / qwen35moe / qwen3next: gated delta-net layers (ssm_a has no suffix)
    ATTN_QKV: Final = "blk.{}.attn_qkv.weight"
    ATTN_GATE: Final = "blk.{}.attn_gate.weight"
    SSM_CONV1D: Final = "blk.{}.ssm_conv1d.weight"
    SSM_DT_BIAS: Final = "blk.{}.ssm_dt.bias"
    SSM_A: Final = "blk.{}.ssm_a"
    SSM_BETA: Final = "blk.{}.ssm_beta.weight"
    SSM_ALPHA: Final = "blk.{}.ssm_alpha.weight"
    SSM_BETA_ALPHA: Final = "blk.{}.ssm_ba.weight"
    SSM_NORM: Final = "blk.{}.ssm_norm.weight"
    SSM_OUT: Final = "blk.{}.ssm_out.weight"
    SSM_IN: Final = "blk.{}.ssm_in.weight"
    # deepseek32 / glm-dsa: the DSA lightning indexer (k_norm comes as weight and bias).
    # (gguf-py releases before the DSA architectures lack these tensors.)
    INDEXER_K_NORM: Final = "blk.{}.indexer.k_norm.{}"
    INDEXER_PROJ: Final = "blk.{}.indexer.proj.weight"
    INDEXER_ATTN_K: Final = "blk.{}.indexer.attn_k.weight"
    INDEXER_ATTN_Q_B: Final = "blk.{}.indexer.attn_q_b.weight"
    # NextN/MTP blocks (glm4moe, deepseek2): loaded, never computed
    NEXTN_EH_PROJ: Final = "blk.{}.nextn.eh_proj.weight"
    NEXTN_ENORM: Final = "blk.{}.nextn.enorm.weight"
    NEXTN_HNORM: Final = "blk.{}.nextn.hnorm.weight"
    NEXTN_SHARED_HEAD_NORM: Final = "blk.{}.nextn.shared_head_norm.weight"
    # Old Mixtral files: one tensor per expert (llama.cpp's LLM_TENSOR_FFN_*_EXP,
    # "blk.%d.ffn_gate.%d"), formatted with the block and the expert index.
    FFN_GATE_EXPERT: Final = "blk.{}.ffn_gate.{}.weight"
    FFN_UP_EXPERT: Final = "blk.{}.ffn_up.{}.weight"
    FFN_DOWN_EXPERT: Final = "blk.{}.ffn_down.{}.weight"


GGUF_MAGIC: Final = 0x46554747  # b"GGUF" read as a little-endian uint32
GGUF_DEFAULT_ALIGNMENT: Final = 32
GGUF_SUPPORTED_VERSIONS: Final = frozenset({2, 3})
