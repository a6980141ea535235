"""Model configuration: the subset of a Hugging Face `config.json` the engine needs, validated."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CheckpointError, UnsupportedModelError

# model_type -> which attention projections carry a bias, as transformers builds them: "config" (q, k, v
# and o when `attention_bias` is true), "qkv" (q, k, v always, o never: Qwen2), "config_qkv" (q, k, v when
# `attention_bias` is true, o never: GLM-4.5; Seed-OSS's o by `attention_out_bias`: _seed_oss_fields), "use_bias"
# (q, k, v and o when `use_bias` is true: ERNIE 4.5), "qkv_bias" (q, k, v when `qkv_bias` is true, its default; o
# never: Qwen2-MoE), "none" (the key is ignored); DeepSeek-V3's latent attention refuses attention_bias
# (config._parse_mla)
SUPPORTED_MODEL_TYPES = {"llama": "config", "mistral": "none", "qwen2": "qkv", "qwen3": "config",
                         "mixtral": "none", "qwen3_moe": "config", "deepseek_v3": "none", "deepseek_v2": "none",
                         "phi3": "none",
                         "granite": "config", "gemma2": "config", "gemma3_text": "config", "gpt_oss": "config",
                         "glm4_moe": "config_qkv", "smollm3": "config", "olmo2": "config",
                         "olmo3": "config", "cohere": "config", "cohere2": "config", "llama4_text": "config",
                         "seed_oss": "config_qkv", "ernie4_5": "use_bias", "ernie4_5_moe": "use_bias",
                         "glm4": "config_qkv", "glm4_moe_lite": "none", "minimax_m2": "none", "ministral3": "none",
                         "mistral4": "none", "exaone4": "none",
                         "hunyuan_v1_dense": "config", "hunyuan_v1_moe": "config", "qwen2_moe": "qkv_bias",
                         "olmoe": "config", "cwm": "none", "granitemoe": "config", "granitemoeshared": "config",
                         "starcoder2": "use_bias", "dots1": "config", "exaone_moe": "none",
                         "solar_open": "config_qkv", "youtu": "none", "arcee": "config", "nemotron": "config",
                         "apertus": "config", "afmoe": "config", "flex_olmo": "config", "nanochat": "config"}
QK_NORM_MODEL_TYPES = {"qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3", "hunyuan_v1_dense",
                       "hunyuan_v1_moe", "olmoe", "dots1", "apertus", "afmoe", "flex_olmo"}
# ... and those with q/k norms only when `use_qk_norm` is true (GLM-4.5 and 4.6: true; GLM-4.5-Air: false; Command R+:
# true; Command R: false)
USE_QK_NORM_MODEL_TYPES = {"glm4_moe", "cohere"}
# Only Llama's, Granite's, SmolLM3's and Seed-OSS's MLPs have `mlp_bias` (ERNIE 4.5's follow `use_bias`:
# _ernie4_5_fields); the others' never carry a bias, whatever the key says
MLP_BIAS_MODEL_TYPES = {"llama", "granite", "smollm3", "seed_oss", "cwm", "arcee", "nemotron"}
# Defaults that differ from the usual ones (rope_theta 10000, rms_norm_eps 1e-6), for configs that omit the key
DEFAULT_ROPE_THETA = {"mixtral": 1000000.0, "gemma3_text": 1000000.0, "gpt_oss": 150000.0, "smollm3": 2000000.0,
                      "olmo3": 500000.0, "cohere": 500000.0, "ernie4_5": 500000.0, "ernie4_5_moe": 500000.0,
                      "cwm": 1000000.0, "apertus": 12000000.0, "flex_olmo": 500000.0}
DEFAULT_RMS_NORM_EPS = {"mixtral": 1e-5, "phi3": 1e-5, "gpt_oss": 1e-5, "olmo2": 1e-5, "olmo3": 1e-5,
                        "ernie4_5": 1e-5, "ernie4_5_moe": 1e-5, "olmoe": 1e-5}
# Rope scalings of every model type but DeepSeek-V2 and V3 (MLA_ROPE_TYPES) and Phi-3 (PHI3_ROPE_TYPES), as
# transformers computes them. "dynamic" (NTK) changes the frequencies only past max_position_embeddings,
# which no sequence here reaches (the context is capped there), so it computes as "default" does.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
MLA_ROPE_TYPES = ("default", "yarn")
# Phi-3's long context (Phi-3/3.5/4-mini 128k): "longrope", which transformers also reads from the older
# names "su" and "yarn" on this model type
PHI3_ROPE_TYPES = ("default", "longrope")
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
# transformers' Phi-3 reads original_max_position_embeddings from the top level only, defaulting it to this
PHI3_ORIGINAL_CONTEXT = 4096
# Gemma 3: the MLP activations the engine computes (transformers' names), and the defaults transformers gives
# the fields its configs may omit
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)
GEMMA3_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 131072, "sliding_window": 4096,
                   "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0}
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
# ... and the text model's shape and token ids, which the image-and-text checkpoints (gemma-3-4b and larger) omit
# from their text_config: transformers gives every gemma3_text config these
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "bos_token_id": 2, "eos_token_id": 1}
# Gemma 2 computes as Gemma 3 does (GEMMA_MODEL_TYPES) but with one rope for all layers, no q/k norms, every other
# layer sliding (the first included), and tanh soft-capping of the attention scores and the logits; the defaults
# transformers gives the fields its configs may omit (a null cap: none)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
GEMMA2_DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
                   "bos_token_id": 2, "eos_token_id": 1, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# gpt-oss: the defaults transformers gives the fields its configs may omit (its yarn rope included), and the one
# quantization its checkpoints come in (MXFP4 experts, which the loader dequantizes: engine.mxfp4)
GPT_OSS_DEFAULTS = {"head_dim": 64, "sliding_window": 128, "attention_bias": True, "swiglu_alpha": 1.702,
                    "swiglu_limit": 7.0, "max_position_embeddings": 131072, "num_local_experts": 128,
                    "num_experts_per_tok": 4}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
GPT_OSS_QUANTIZATION = "mxfp4"
# GLM-4.5/4.5-Air/4.6 (glm4_moe): DeepSeek-V3's routing (sigmoid, correction bias, groups, shared experts) under
# grouped-query attention with partial rotary; the defaults transformers gives the fields its configs may omit,
# and the partial_rotary_factor it assumes when neither the top level nor the rope's parameters give one
GLM4_MOE_DEFAULTS = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                     "norm_topk_prob": True, "num_nextn_predict_layers": 1}
GLM4_MOE_PARTIAL_ROTARY = 0.5
# GLM-4-0414 and GLM-Z1 (glm4: 9B, 32B), dense: grouped-query attention with q/k/v biases (o never), interleaved rotary
# on each head's first partial_rotary_factor of dims (GLM4_MOE_PARTIAL_ROTARY unless given), gate and up stored as
# one gate_up_proj, and four norms a layer (the attention's and the MLP's outputs normed too); the defaults
# transformers gives the fields its configs may omit (128-dim heads whatever hidden_size says)
GLM4_DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                 "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                 "max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07, "attention_bias": True,
                 "eos_token_id": [151329, 151336, 151338]}
# GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's latent attention and routing (sigmoid scores, correction bias, groups,
# shared experts), its layers dense or sparse by mlp_layer_types; the defaults transformers gives the fields its
# configs may omit. Its published checkpoint stores a multi-token-prediction layer after the decoder's, which
# transformers leaves unread (num_nextn_predict_layers, a key transformers does not read, says how many)
GLM4_MOE_LITE_DEFAULTS = {"vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                          "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                          "n_shared_experts": 1, "n_routed_experts": 64, "routed_scaling_factor": 1.8,
                          "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256,
                          "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
                          "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
                          "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1}
GLM4_MOE_LITE_MLP_TYPES = ("dense", "sparse")
# DeepSeek-V2, V2-Lite, V2.5, Coder-V2 (deepseek_v2): DeepSeek-V3's latent attention and shared experts, routed by a
# softmax over the router's logits, without correction bias; the defaults transformers gives the fields its configs may
# omit (q_lora_rank: a compressed query unless the config says null, as V2-Lite's does)
DEEPSEEK_V2_DEFAULTS = {"max_position_embeddings": 2048, "kv_lora_rank": 512, "q_lora_rank": 1536,
                        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
                        "n_shared_experts": 2, "moe_intermediate_size": 1407, "first_k_dense_replace": 0,
                        "routed_scaling_factor": 1.0, "topk_method": "greedy", "bos_token_id": 1, "eos_token_id": 2}
# its topk_method: "greedy", the top-k of all experts; "group_limited_greedy", the top-k of the topk_group groups (of
# n_group) whose best scores are highest
DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# Command R and R+ (cohere), Command R7B and Command A (cohere2): the defaults transformers gives the fields their
# configs may omit
COHERE_MODEL_TYPES = ("cohere", "cohere2")
COHERE_DEFAULTS = {"max_position_embeddings": 8192, "bos_token_id": 5, "eos_token_id": 255001}
COHERE2_DEFAULTS = {**COHERE_DEFAULTS, "sliding_window": 4096}
# EXAONE 4.0 (exaone4: EXAONE-4.0-32B, -1.2B): the defaults transformers gives the fields its configs may omit (as many
# KV heads as its default query heads, 32, whatever num_attention_heads says)
EXAONE4_DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "sliding_window": 4096,
                    "sliding_window_pattern": 4}
# Seed-OSS-36B (seed_oss): the defaults transformers gives the fields its configs may omit (q/k/v biases, 8 KV heads
# and 128-dim heads whatever hidden_size says; a null head_dim: hidden_size / num_attention_heads)
SEED_OSS_DEFAULTS = {"attention_bias": True, "head_dim": 128, "max_position_embeddings": 524288, "bos_token_id": 0,
                     "eos_token_id": 2, "num_key_value_heads": 8}
# ERNIE 4.5, dense (ernie4_5: ERNIE-4.5-0.3B) and mixture of experts (ernie4_5_moe: ERNIE-4.5-21B-A3B, -300B-A47B):
# the defaults transformers gives the fields their configs may omit (the dense model's heads 128 wide whatever
# hidden_size says, the MoE model's hidden_size / num_attention_heads; 2 KV heads in the dense model, 4 in the MoE one)
ERNIE4_5_DEFAULTS = {"max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2}
ERNIE4_5_MOE_DEFAULTS = {**ERNIE4_5_DEFAULTS, "num_key_value_heads": 4, "moe_num_experts": 64, "moe_k": 6,
                         "moe_intermediate_size": 1536, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                         "moe_layer_end_index": -1, "moe_layer_interval": 1, "moe_norm_min": 1e-12}
# MiniMax-M2 and M2.1 (minimax_m2): grouped-query attention whose q and k are each RMS-normed over the whole projection
# (as OLMo 2's), rotary on each head's first rotary_dim dims, every layer a mixture of experts routed as DeepSeek-V3
# routes (sigmoid scores, a correction bias steering the choice) over one group, renormalized, unscaled, no shared
# expert; the defaults transformers gives the fields its configs may omit (128-dim heads whatever hidden_size says)
MINIMAX_M2_DEFAULTS = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                       "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
                       "bos_token_id": 200034, "eos_token_id": 200020, "num_local_experts": 256,
                       "num_experts_per_tok": 8}
# ... and the keys its published configs carry that transformers does not read: the values of the variant it computes
MINIMAX_M2_VARIANTS = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                       "qk_norm_type": "per_layer", "shared_intermediate_size": 0}
# Hunyuan (hunyuan_v1_dense: Hunyuan-0.5B/1.8B/4B/7B; hunyuan_v1_moe: Hunyuan-A13B): Llama's decoder whose q and k
# are each RMS-normed over each head after the rotary (query_layernorm, key_layernorm), q/k/v/o biased by
# attention_bias, and whose "dynamic" rope with an alpha is NTK's base stretched once (_hunyuan_fields); A13B's every
# MLP a mixture of experts (_parse_hunyuan_moe). The defaults transformers gives the fields its configs may omit
# (head_dim: hidden_size / num_attention_heads, which transformers' rotary assumes; its attention needs one)
HUNYUAN_MODEL_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe")
HUNYUAN_DEFAULTS = {"vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                    "bos_token_id": 1, "eos_token_id": 2, "num_experts": 1, "moe_topk": 1}
# Qwen2-MoE (qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biased by qkv_bias, true unless
# it says false) with Qwen3-MoE's layers (sparse by decoder_sparse_step and mlp_only_layers, a float32 softmax's
# top-k, renormalized by norm_topk_prob), and beside the routed experts one shared expert of its own width, its output
# times the sigmoid of shared_expert_gate's one logit. The defaults transformers gives the fields its configs may omit
QWEN2_MOE_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                      "sliding_window": 4096, "max_window_layers": 28, "moe_intermediate_size": 1408,
                      "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60}
# OLMoE (olmoe: OLMoE-1B-7B): OLMo 2's q/k norms over the whole projections (their weights multiplying the row rounded
# to the model's dtype, as Llama's norms do) in Llama's layer (normed inputs), every MLP a mixture of experts routed by
# a float32 softmax's top-k (renormalized by norm_topk_prob), q/k/v/o biased by attention_bias. The defaults
# transformers gives the fields its configs may omit
OLMOE_DEFAULTS = {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
                  "num_attention_heads": 16, "max_position_embeddings": 4096, "eos_token_id": 50279,
                  "num_experts": 64, "num_experts_per_tok": 8}
# FlexOlmo (flex_olmo: FlexOlmo-7x7B-1T, the Flex-*-2x7B-1T): OLMo 2's layer (norms of each attention and MLP output
# only, q/k norms over the whole projections, the weights multiplying the float32 row) with OLMoE's experts on every
# layer, routed by a float32 softmax's top-k (renormalized by norm_topk_prob), q/k/v/o biased by attention_bias. The
# defaults transformers gives the fields its configs may omit (clip_qkv, which some configs carry, it does not read)
FLEX_OLMO_DEFAULTS = {"vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "max_position_embeddings": 4096, "eos_token_id": 100257,
                      "num_experts": 7, "num_experts_per_tok": 5}
# nanochat (nanochat: nanochat-d20, -d32): Llama's layer whose every norm is an RMSNorm without a weight (the inputs of
# the attention and the MLP, the final one, and the embeddings before the first layer), q and k so normed over each
# head after the rotary, which turns each pair the other way (rotate-half's signs flipped), an ungated MLP (fc1
# activated into fc2), q/k/v/o biased by attention_bias, and the logits soft-capped by tanh
# (final_logit_softcapping, null: none). The defaults transformers gives the fields its configs may omit
NANOCHAT_DEFAULTS = {"vocab_size": 50304, "hidden_size": 768, "intermediate_size": 8192, "num_hidden_layers": 12,
                     "num_attention_heads": 6, "max_position_embeddings": 2048, "hidden_act": "relu2",
                     "final_logit_softcapping": 15.0, "bos_token_id": 0, "eos_token_id": 1}
# dots.llm1 (dots1: dots.llm1.base, .inst): Qwen3's attention (per-head q/k norms, q/k/v/o biased by attention_bias)
# with DeepSeek-V3's layers (the first first_k_dense_replace dense, the others sigmoid-routed experts in groups beside
# shared experts), sliding-window layers by layer_types (without it: those from max_window_layers on, when
# sliding_window is set). The defaults transformers gives the fields its configs may omit (unrenormalized, unscaled
# weights; no routed experts nor shared ones: those must be given)
DOTS1_DEFAULTS = {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                  "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_group": 1,
                  "topk_group": 1, "first_k_dense_replace": 0, "norm_topk_prob": False, "max_position_embeddings": 2048,
                  "routed_scaling_factor": 1.0, "sliding_window": 4096, "max_window_layers": 62}
# K-EXAONE (exaone_moe: K-EXAONE-236B-A23B): EXAONE 4.0's attention (per-head q/k norms, sliding-window layers that
# rotate beside global ones that do not) in Llama's layer (the attention's and the MLP's inputs normed, not their
# outputs), dense or sparse MLPs by mlp_layer_types (without it: the first first_k_dense_replace dense), the sparse
# ones DeepSeek-V3's sigmoid-routed experts beside num_shared_experts shared ones. The defaults transformers gives the
# fields its configs may omit
EXAONE_MOE_DEFAULTS = {**EXAONE4_DEFAULTS, "bos_token_id": 1, "eos_token_id": 53, "first_k_dense_replace": 1,
                       "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
                       "num_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1,
                       "topk_group": 1}
# Solar Open (solar_open: Solar-Open-100B): GLM-4.5's every layer a mixture of experts (DeepSeek-V3's sigmoid routing
# beside shared experts; transformers reads no first_k_dense_replace, nor use_qk_norm) under Llama's attention (q/k/v
# biased by attention_bias, o never; rotary on every dim of each head). The defaults transformers gives the fields its
# configs may omit (128-dim heads whatever hidden_size says)
SOLAR_OPEN_DEFAULTS = {"vocab_size": 196608, "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 64,
                       "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                       "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "moe_intermediate_size": 1280,
                       "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
                       "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True}
# Youtu-LLM (youtu: Youtu-LLM-2B): DeepSeek-V3's latent attention with a dense MLP on every layer; the defaults
# transformers gives the fields its configs may omit (tied embeddings)
YOUTU_DEFAULTS = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": 1536,
                  "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                  "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
                  "tie_word_embeddings": True}
# Code World Model (cwm: CWM-32B): Llama's decoder without attention biases whose layers attend a window
# (sliding_window) but for the full-attention ones layer_types names (without it: every CWM_FULL_ATTENTION_EVERY-th,
# the first included); the defaults transformers gives the fields its configs may omit (128-dim heads whatever
# hidden_size says), its rope when neither rope_parameters nor rope_scaling is given (a top-level rope_theta then
# changes nothing, as transformers reads it)
CWM_DEFAULTS = {"vocab_size": 128256, "hidden_size": 6144, "intermediate_size": 21504, "num_hidden_layers": 64,
                "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                "sliding_window": 8192}
CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CWM_FULL_ATTENTION_EVERY = 4
# Granite 3.x MoE (granitemoe: granite-3.1-1b-a400m, -3b-a800m; granitemoeshared: beside the experts one shared MLP of
# shared_intermediate_size, 0: none): Granite's multipliers, every MLP a mixture of experts of intermediate_size
# each, a token's top-k router logits weighted by a softmax over those k (_parse_granitemoe_moe); the defaults
# transformers gives the fields their configs may omit
GRANITE_MODEL_TYPES = ("granite", "granitemoe", "granitemoeshared")
GRANITEMOE_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "max_position_embeddings": 2048, "bos_token_id": 1,
                       "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2}
# StarCoder2 (starcoder2: StarCoder2-3B/7B/15B): LayerNorms with biases (norm_epsilon), an MLP of one GELU-tanh
# activated projection (c_fc, c_proj), a bias on every projection with use_bias, every layer attending sliding_window
# tokens (null: all); the defaults transformers gives the fields its configs may omit, and the activations it computes
STARCODER2_DEFAULTS = {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
                       "num_attention_heads": 24, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                       "bos_token_id": 50256, "eos_token_id": 50256, "use_bias": True}
STARCODER2_ACTIVATIONS = ("gelu_pytorch_tanh",)
# Model types whose MLP is one activated projection (up_proj) into down_proj, no gate, and the activation each computes
# (transformers' name): Arcee AFM-4.5B and Nemotron-4/Minitron (nemotron) square a ReLU, Apertus applies xIELU, whose
# parameters each layer learns (act_fn.alpha_p, alpha_n, beta, eps beside up_proj and down_proj); nanochat's squares a
# ReLU of fc1 into fc2
UNGATED_ACTIVATIONS = {"arcee": ("relu2",), "nemotron": ("relu2",), "apertus": ("xielu",), "nanochat": ("relu2",)}
# Arcee AFM-4.5B (arcee): Llama's decoder with that MLP; the defaults transformers gives the fields its configs may omit
ARCEE_DEFAULTS = {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "relu2"}
# Nemotron-4 and Minitron (nemotron): LayerNorms with a bias, each scaling by 1 + weight (eps: norm_eps), rotary on each
# head's first partial_rotary_factor of dims (NEMOTRON_PARTIAL_ROTARY unless given), q/k/v/o biased by attention_bias,
# the MLP's by mlp_bias; the defaults transformers gives the fields its configs may omit (transformers builds no
# attention without num_key_value_heads: the engine reads one KV head per query head then)
NEMOTRON_DEFAULTS = {"vocab_size": 256000, "hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 32,
                     "num_attention_heads": 48, "max_position_embeddings": 4096, "norm_eps": 1e-5, "bos_token_id": 2,
                     "eos_token_id": 3, "hidden_act": "relu2"}
NEMOTRON_PARTIAL_ROTARY = 0.5
# Apertus-8B and -70B (apertus): Llama's attention with q and k RMS-normed over each head before the rotary, the MLP
# above by xIELU, its norms named attention_layernorm and feedforward_layernorm; the defaults transformers gives the
# fields its configs may omit, its rope when neither rope_parameters nor rope_scaling is given (a top-level rope_theta
# then changes nothing, as transformers reads it), and the keys its published configs carry that transformers does not
# read: the values of the variant it computes
APERTUS_DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
                    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "xielu"}
APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
APERTUS_VARIANTS = {"qk_norm": True, "post_norm": False}
# Arcee Trinity Nano, Mini and Large (afmoe): q and k RMS-normed over each head, the attention's output times the
# sigmoid of gate_proj of the layer's input (attn_output_gate), four norms a layer (the attention's and the MLP's
# inputs and outputs; their weights multiplying the float32 row, as gpt-oss's), sliding-window layers by layer_types
# (without it all but every global_attn_every_n_layers-th) that rotate beside full-attention ones that do not, the
# embeddings times sqrt(hidden_size) with mup_enabled, the first num_dense_layers MLPs dense and the others experts
# routed as MiniMax-M2's (sigmoid scores plus expert_bias choosing, renormalized) times route_scale, beside
# num_shared_experts shared ones. The defaults transformers gives the fields its configs may omit (128-dim heads
# whatever hidden_size says), and the keys its published configs carry that transformers does not read: the values of
# the variant it computes
AFMOE_DEFAULTS = {"vocab_size": 200192, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 1408,
                  "num_hidden_layers": 32, "num_dense_layers": 1, "num_attention_heads": 16, "head_dim": 128,
                  "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "num_experts": 64,
                  "num_experts_per_tok": 6, "num_shared_experts": 2, "route_scale": 1.0,
                  "global_attn_every_n_layers": 4, "sliding_window": 1024}
AFMOE_VARIANTS = {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1, "num_expert_groups": 1,
                  "num_limited_groups": 1}
# Image-and-text checkpoints whose text model the engine serves (alone: images are not): for each, the model_types
# its text_config may name (the first is the one transformers assumes when it names none) -> the text model the
# engine runs. Mistral 3: Mistral Small 3.1/3.2, Ministral 3 (a ministral3 text model) and Mistral Small 4 (a
# mistral4 one); Qwen2-VL and Qwen2.5-VL:
# a Qwen2 text model; Qwen3-VL (dense):
# a Qwen3 one; Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): a Qwen3-MoE one. Qwen2-VL and Qwen2.5-VL were first
# published with their text model's fields at the top level (FLAT_TEXT_CONFIG_TYPES), later saves nest them in
# text_config. GLM-4.1V (glm4v: GLM-4.1V-9B-Thinking, -Base): a GLM-4 one; GLM-4.5V and GLM-4.6V (glm4v_moe): a
# GLM-4.5 one (_glm4v_text).
IMAGE_TEXT_MODEL_TYPES = {"gemma3": {"gemma3_text": "gemma3_text"},
                          "mistral3": {"mistral": "mistral", "llama": "llama", "ministral3": "ministral3",
                                       "mistral4": "mistral4"},
                          "qwen2_vl": {"qwen2_vl_text": "qwen2"},
                          "qwen2_5_vl": {"qwen2_5_vl_text": "qwen2"},
                          "qwen3_vl": {"qwen3_vl_text": "qwen3"},
                          "qwen3_vl_moe": {"qwen3_vl_moe_text": "qwen3_moe"},
                          "llama4": {"llama4_text": "llama4_text"},
                          "glm4v": {"glm4v_text": "glm4"}, "glm4v_moe": {"glm4v_moe_text": "glm4_moe"}}
FLAT_TEXT_CONFIG_TYPES = ("qwen2_vl", "qwen2_5_vl")
# Their rope is M-RoPE (_mrope_as_rope)
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe")
# Tied embeddings when either the top level or text_config says so, as transformers reads Qwen2-VL and Qwen2.5-VL
# (older saves kept the key in text_config; Qwen3-VL's published configs carry it in both). For the others the
# top-level key decides when present, else text_config's; a stored lm_head.weight that differs from the
# embeddings is used all the same (loader._read_lm_head), as transformers uses it
TIED_BY_EITHER_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "glm4v_moe")
# The Qwen VL text models' fields as transformers defaults them for configs that omit them (rope_theta, rms_norm_eps,
# max_window_layers and the shape differ from a text-only Qwen2/Qwen3 config's defaults)
QWEN2_VL_TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                          "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                          "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                          "sliding_window": 4096, "max_window_layers": 80, "bos_token_id": 151643,
                          "eos_token_id": 151645}
QWEN3_VL_TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                          "head_dim": 128, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                          "rope_theta": 500000.0}
QWEN3_VL_MOE_TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                              "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                              "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60,
                              "decoder_sparse_step": 1}
# GLM-4.1V's and GLM-4.5V's text models as transformers defaults their omitted fields (not GLM-4's nor GLM-4.5's
# defaults: no eos_token_id, other shapes, q/k/v biases whatever attention_bias says in GLM-4.1V)
GLM4V_TEXT_DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                       "num_attention_heads": 32, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                       "rms_norm_eps": 1e-5, "eos_token_id": None}
GLM4V_MOE_TEXT_DEFAULTS = {"vocab_size": 151424, "hidden_size": 4096, "intermediate_size": 10944,
                           "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
                           "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "attention_bias": True,
                           "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
                           "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                           "first_k_dense_replace": 1, "norm_topk_prob": True}
# The M-RoPE sections transformers assumes when a GLM-4.xV config names none
GLM4V_MROPE_SECTION = [8, 12, 12]
IMAGE_TEXT_DEFAULTS = {"glm4v_text": GLM4V_TEXT_DEFAULTS, "glm4v_moe_text": GLM4V_MOE_TEXT_DEFAULTS,
                       "qwen2_vl_text": QWEN2_VL_TEXT_DEFAULTS, "qwen2_5_vl_text": QWEN2_VL_TEXT_DEFAULTS,
                       "qwen3_vl_text": QWEN3_VL_TEXT_DEFAULTS, "qwen3_vl_moe_text": QWEN3_VL_MOE_TEXT_DEFAULTS}
# Text models whose router always renormalizes its top-k weights, whatever norm_topk_prob says (transformers'
# Qwen3-VL-MoE reads no such key)
RENORMALIZED_TOPK_TEXT_TYPES = ("qwen3_vl_moe_text",)
# Llama 4 (Scout 17B-16E, Maverick 17B-128E; llama4_text, or the text model of the image-and-text llama4): the
# defaults transformers gives the fields its configs may omit (head_dim 128 whatever hidden_size says), and its
# layer_types
LLAMA4_TEXT_DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
                        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2,
                        "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                        "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "use_qk_norm": True,
                        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}
LLAMA4_LAYER_TYPES = ("chunked_attention", "full_attention")
# Ministral 3 (ministral3: Ministral-3-3B, -8B, -14B, published as the text model of the image-and-text mistral3):
# Mistral's decoder whose queries are scaled by position (_ministral3_fields); the defaults transformers gives the
# fields its configs may omit (128-dim heads whatever hidden_size says), its rope when neither rope_parameters nor
# rope_scaling is given (a top-level rope_theta then changes nothing, as transformers reads it)
MINISTRAL3_DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "bos_token_id": 1,
                       "eos_token_id": 2}
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                   "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
# Mistral Small 4 (mistral4): DeepSeek-V3's latent attention and experts (groups ranked by their best two scores,
# shared experts), the scores a softmax without correction bias, and Ministral 3's query scaling by position; the
# defaults transformers gives the fields its configs may omit, its rope likewise (the rope rotating all of
# qk_rope_head_dim: partial_rotary_factor qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim))
MISTRAL4_DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288,
                     "moe_intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 32,
                     "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256,
                     "q_lora_rank": 1024, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64,
                     "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 0,
                     "norm_topk_prob": True, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
                     "bos_token_id": 1, "eos_token_id": 2}
MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                 "llama_4_scaling_beta": 0.1}
# ... whose rope is yarn's alone: transformers rotates all of a head's dims (not qk_rope_head_dim) by any other
MISTRAL4_ROPE_TYPES = ("yarn",)


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES ("dynamic" is parsed as "default")
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the band of rotations blended between interpolated and original frequencies, and the
    # factor cos and sin are multiplied by (from mscale / mscale_all_dim unless given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0   # yarn and longrope: cos and sin are multiplied by it
    mscale_all_dim: float = 0.0   # DeepSeek: also scales the attention softmax by mscale(factor, this) squared
    # longrope: each rotary frequency is divided by its factor. transformers picks short_factor or long_factor
    # per forward pass by the sequence's length (long past original_max_position_embeddings), re-rotating
    # nothing already cached. A paged engine serves many sequences at once, reuses cached prefixes between
    # them and prefills in chunks, so a per-length switch would make a sequence's keys depend on how it was
    # batched. The choice is made once, from the context the engine serves (uses_long_factor): short_factor
    # when max_model_len is at most the original context, where every sequence rotates as transformers
    # rotates it; long_factor when longer (Phi-3.5-mini, Phi-4-mini served at their full context), where a
    # sequence within the original context rotates as transformers rotates a long one, not as it rotates
    # that sequence.
    short_factor: list[float] = field(default_factory=list)
    long_factor: list[float] = field(default_factory=list)

    def uses_long_factor(self, max_model_len: int) -> bool:
        """longrope: whether an engine serving sequences of up to max_model_len tokens rotates by long_factor."""
        return max_model_len > self.original_max_position_embeddings


@dataclass(slots=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's hidden state goes to its top-k of num_experts experts."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int       # of one expert
    norm_topk_prob: bool         # renormalize the top-k router probabilities to sum to 1
    sparse_layers: list[bool]    # per layer: MoE (True) or the dense MLP of intermediate_size (False)
    # DeepSeek-V3 routing: sigmoid scores; experts chosen by score plus a per-expert correction bias
    # among the topk_groups best of num_groups equal groups; weights are the (normalized) sigmoid
    # scores times routed_scaling_factor. Mixtral and Qwen3-MoE: softmax over all experts.
    scoring: str = "softmax"     # "softmax", "sigmoid", "softmax_topk" (gpt-oss) or "sigmoid_topk" (Llama 4)
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # a dense MLP of num_shared_experts * intermediate_size every token also takes
    # Qwen2-MoE: the shared expert's own width (None: num_shared_experts * intermediate_size), and its output weighed
    # by the sigmoid of a one-row gate's logit (shared_expert_gate)
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    # DeepSeek's group-limited routing (engine.moe.route_grouped) as above, with sigmoid scoring (DeepSeek-V3, GLM-4.5)
    # or softmax scoring and no correction bias (DeepSeek-V2); a group ranks by the sum of its best
    # group_score_experts scores (V3: 2; V2: 1, its best)
    grouped: bool = False
    group_score_experts: int = 2
    # ERNIE 4.5's grouped routing (one group): softmax scores, the choice steered by a correction bias all the same
    # (score_correction; sigmoid scoring always has one), the renormalized weights' denominator at least norm_min
    # (moe_norm_min; None: the sum plus 1e-20, as DeepSeek's)
    score_correction: bool = False
    norm_min: float | None = None
    # MiniMax-M2's grouped routing: the router kept in the model's dtype and its logits computed in it (DeepSeek's and
    # ERNIE's: a float32 router, float32 logits)
    router_in_model_dtype: bool = False
    # gpt-oss: the router's logits carry a bias and the softmax runs over the top-k logits only ("softmax_topk"
    # scoring); each expert's projections carry biases, and its activation is the clamped SwiGLU
    # (up.clamp(-limit, limit) + 1) * gate * sigmoid(alpha * gate), gate clamped to at most limit
    router_bias: bool = False
    expert_bias: bool = False
    swiglu: tuple[float, float] | None = None   # (alpha, limit); None: SiLU(gate) * up

    @property
    def shared_width(self) -> int:
        """The shared experts' intermediate width, all of them as one dense MLP (0: none)."""
        return self.shared_intermediate_size or self.num_shared_experts * self.intermediate_size

    @property
    def has_correction_bias(self) -> bool:
        """Whether a per-expert correction bias (float32, stored beside the router) steers the choice of experts."""
        return self.scoring == "sigmoid" or self.score_correction


@dataclass(slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 and V3): queries and keys have a position-free part of
    qk_nope_head_dim and a rotary part of qk_rope_head_dim per head; keys and values of every head
    are decompressed from one latent per token (kv_lora_rank dims, RMS-normed) by kv_b_proj, and
    the rotary key part is one head shared by all. The KV cache holds the latent and the rotary key."""

    q_lora_rank: int | None      # None: q_proj straight from the hidden state; else q_a_proj, norm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool        # rotary dims stored as interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def num_parameters(self, hidden: int, num_heads: int) -> int:
        """Weight elements of one layer's attention (projections and the latent norms) with num_heads
        query heads (under tensor parallelism a rank's share: the latent projections are whole on each)."""
        rank, q_rows = self.kv_lora_rank, num_heads * self.qk_head_dim
        query = hidden * q_rows if self.q_lora_rank is None else self.q_lora_rank * (hidden + 1 + q_rows)
        latent = (rank + self.qk_rope_head_dim) * hidden + rank   # kv_a_proj_with_mqa, kv_a_layernorm
        kv_b = num_heads * (self.qk_nope_head_dim + self.v_head_dim) * rank
        return query + latent + kv_b + num_heads * self.v_head_dim * hidden


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False         # o_proj carries a bias (attention_bias on Llama, Qwen3, Qwen3-MoE)
    qk_norm: bool = False
    mlp_bias: bool = False
    # Per layer: attention window in tokens, or None for full attention. A negative one is Llama 4's chunked
    # attention: a token sees the earlier tokens of its own chunk of -window tokens (keys from its position rounded
    # down to a multiple of -window), not the last `window` (engine.ops.window_start). The KV cache keeps every
    # token of these layers, as of the sliding ones, though keys before a chunk's (or window's) start are not read.
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    moe: MoEConfig | None = None
    # Multi-head latent attention; then num_kv_heads and head_dim describe its cache: one "head"
    # per token of kv_lora_rank + qk_rope_head_dim dims, keys and values at once.
    mla: MLAConfig | None = None
    # DeepSeek-V3's, GLM-4.5's and MiniMax-M2's multi-token-prediction layers, stored after the decoder's
    # (model.layers.{num_layers}...); the engine does not run them, so the loader knows their tensors go unread
    num_nextn_layers: int = 0
    # Phi-3's and GLM-4.5's partial_rotary_factor (Phi-4-mini: 0.75, GLM: 0.5): rotary (rotate-half) on each head's
    # first rotary_dim dims only
    rotary_dim: int | None = None
    # Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (the loader splits them per rank)
    fused_projections: bool = False
    # GLM-4 stores gate/up as one gate_up_proj, q/k/v apart
    fused_gate_up: bool = False
    # Granite's scalars: embeddings times embedding_multiplier; attention_multiplier as the softmax scale
    # (None: 1/sqrt(head_dim)); each block's attention and MLP output times residual_multiplier before the
    # residual add; logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Gemma 3: the embeddings' multiplier (sqrt(hidden_size)) is rounded to the model's dtype before it
    # multiplies, as transformers rounds it (55.4256 becomes 55.5 in bfloat16)
    embedding_multiplier_in_dtype: bool = False
    # The MLP's activation: "silu", or Gemma 3's "gelu_pytorch_tanh" (GELU, tanh approximation)
    hidden_act: str = "silu"
    # Gemma 3's norms scale by 1 + weight in float32 and round after: the loader stores 1 + weight as
    # float32, which engine.ops.rms_norm multiplies before rounding to the activations' dtype. Nemotron's biased
    # LayerNorms (norm_bias) scale by 1 + weight computed in the model's dtype, as transformers adds it
    norm_weight_offset: bool = False
    # Gemma 3 also norms each attention and MLP output before its residual add: four norms a layer
    sandwich_norms: bool = False
    # OLMo 2 and 3 norm only those outputs (sandwich_norms' outer pair, two norms a layer): False, and the
    # attention and the MLP each take the residual stream unnormed
    input_norms: bool = True
    # OLMo 2 and 3's q_norm and k_norm (MiniMax-M2's too) are each one RMSNorm over the whole q (k) projection, all
    # heads together, not one over each head (qk_norm's usual shape); under TP a rank's heads' sums of squares are
    # all-reduced
    qk_norm_over_heads: bool = False
    # Gemma 3: the sliding-attention layers (True here) rotate by local_rope (rope_local_base_freq, no
    # scaling), the full-attention ones by rope
    local_rope: RopeConfig | None = None
    local_rope_layers: list[bool] = field(default_factory=list)
    # SmolLM3's NoPE layers (True here): their queries and keys are not rotated at all; [] when every layer rotates
    nope_layers: list[bool] = field(default_factory=list)
    # An image-and-text checkpoint (IMAGE_TEXT_MODEL_TYPES) served as its text model, which this describes: the
    # loader reads the text model's tensors under their nested names and leaves the image encoder unread
    image_text_checkpoint: bool = False
    # gpt-oss: each attention head's learned sink, one more logit in its softmax's denominator (weighing no value)
    attention_sinks: bool = False
    # gpt-oss keeps its norms' weights in float32 (engine.ops.rms_norm multiplies them before rounding); OLMo 2
    # and 3 multiply theirs by the float32 row too
    norms_in_float32: bool = False
    # Gemma 2's tanh soft-capping, each a positive cap or None (none): every scaled attention score becomes
    # cap * tanh(score / cap) before the mask and softmax, and every logit likewise by final_logit_softcapping
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Cohere's models (COHERE_MODEL_TYPES): one norm of the residual stream feeds both the attention and the MLP, whose
    # outputs are both added to the stream (parallel_block: no post_norm); every norm is a LayerNorm (the row's mean
    # subtracted, a weight and no bias; rms_norm_eps is its eps); the rotary dims are stored as interleaved pairs
    # (x0, x1), (x2, x3), ..., which the loader reorders within each q and k head to the halves the engine rotates;
    # the logits are multiplied by logit_scale. Command R+'s q and k norms (use_qk_norm) weigh each head by a row of
    # its own: their weights are [heads, head_dim] (qk_norm_weight_per_head)
    parallel_block: bool = False
    layer_norms: bool = False
    # StarCoder2: every LayerNorm also adds a bias (the norms computed as torch's layer_norm), and the MLP is one
    # activated projection (gate_up holds c_fc's rows alone) into down, not a gated pair
    norm_bias: bool = False
    gated_mlp: bool = True
    rope_interleaved: bool = False
    logit_scale: float = 1.0
    qk_norm_weight_per_head: bool = False
    # Llama 4: on these layers (True) q and k are each normed over each head after the rotary, without a weight
    # (use_qk_norm: an RMSNorm of weight 1); [] on every other model
    l2_qk_norm_layers: list[bool] = field(default_factory=list)
    # Llama 4's attention temperature tuning, (floor_scale, attn_scale), or None: on the NoPE layers the query at
    # position p is multiplied by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
    attn_temperature: tuple[float, float] | None = None
    # Ministral 3's and Mistral 4's query scaling, (original_max_position_embeddings, llama_4_scaling_beta), or None: on
    # every layer the query at position p is multiplied, after the rotary, by 1 + beta * log(1 + floor(p / original))
    position_query_scale: tuple[int, float] | None = None
    # Hunyuan: the per-head q and k norms apply after the rotary, not before it
    qk_norm_after_rope: bool = False
    # nanochat: its norms have no weight (each an RMSNorm of weight 1: the loader gives them float32 ones, which the
    # engine keeps but the checkpoint does not store), the embeddings are normed so before the first layer, and its
    # rotary turns each pair the other way (rotate-half's signs flipped: the sin tables negated)
    norm_weights: bool = True
    embedding_norm: bool = False
    rope_reversed: bool = False
    # Trinity (afmoe): the attention's output, each element of each head, times the sigmoid of the gate_proj row of
    # the layer's input before o_proj (gate_proj's rows fused after q, k and v's, sharded with the query heads)
    attn_output_gate: bool = False

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def kv_parts(self) -> int:
        """Tensors per layer in the KV cache: keys and values (2), or one latent whose first
        kv_lora_rank dims are also the values (1, multi-head latent attention)."""
        return 1 if self.mla is not None else 2

    def kv_pool_shape(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """A KV pool's shape [layers, kv_parts, blocks, block_size, KV heads, head_dim], for the layers and
        KV heads it holds (one rank's under tensor/pipeline parallelism, or the whole model's)."""
        return (num_layers, self.kv_parts, num_blocks, block_size, num_kv_heads, self.head_dim)

    def num_parameters(self) -> int:
        """Weights the engine keeps resident: every expert of every MoE layer counts, not just the active ones."""
        from engine.memory import shard_parameters   # counts any rank's part (engine.parallel.layout)
        from engine.parallel.layout import whole_model

        return shard_parameters(self, whole_model(self))


def _optional_int(raw: dict, key: str, default: int, path: Path) -> int:
    return default if raw.get(key) is None else _positive_int(raw, (key,), path)


def _is_number(value) -> bool:
    # JSON writes some floats as integers; true and false are not numbers here
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_float(raw: dict, key: str, default: float, path: Path) -> float:
    """A number > 0, or `default` when absent."""
    return _float(raw, key, default, path, allow_zero=False)


def _nonnegative_float(raw: dict, key: str, default: float, path: Path) -> float:
    """A number >= 0, or `default` when absent."""
    return _float(raw, key, default, path, allow_zero=True)


def _float(raw: dict, key: str, default: float, path: Path, allow_zero: bool) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if not _is_number(value) or value < 0 or (value == 0 and not allow_zero):
        wanted = "a number >= 0" if allow_zero else "a positive number"
        raise CheckpointError(f"{path}: {key} must be {wanted}, got {value!r}")
    return float(value)


def _flag(raw: dict, key: str, default: bool, path: Path) -> bool:
    # bool("false") is True: a string here would silently flip the setting
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def _mapping(raw: dict, key: str, path: Path) -> dict:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {key} must be an object, got {value!r}")
    return value


def _parse_rope(raw: dict, path: Path, supported: tuple[str, ...] = ROPE_TYPES, rotary_dim: int = 0) -> RopeConfig:
    # Newer checkpoints nest everything under rope_parameters; older ones use rope_theta + rope_scaling.
    parameters = _mapping(raw, "rope_parameters", path)
    merged = {**_mapping(raw, "rope_scaling", path), **parameters}
    default_theta = DEFAULT_ROPE_THETA.get(raw.get("model_type"), 10000.0)
    theta = _positive_float(merged, "rope_theta", _positive_float(raw, "rope_theta", default_theta, path), path)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if supported is PHI3_ROPE_TYPES:
        rope_type = PHI3_ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in supported:
        key = "rope_parameters" if {"rope_type", "type"} & parameters.keys() else "rope_scaling"
        raise UnsupportedModelError(f"{path}: {key}: rope type {rope_type!r} is not supported for "
                                    f"{raw.get('model_type')} (supported: {', '.join(supported)})")
    if rope_type == "dynamic":
        _positive_float(merged, "factor", 1.0, path)   # checked, but it never applies (ROPE_TYPES)
        return RopeConfig(theta=theta)
    rope = RopeConfig(theta=theta, rope_type=rope_type)
    if rope_type == "yarn":
        return _parse_yarn(rope, merged, raw, path)
    if rope_type == "longrope":
        return _parse_longrope(rope, merged, raw, path, rotary_dim)
    if rope_type == "linear":
        if merged.get("factor") is None:
            raise CheckpointError(f"{path}: linear rope scaling lacks 'factor'")
        rope.factor = _positive_float(merged, "factor", 1.0, path)
        return rope
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in merged:
                raise CheckpointError(f"{path}: llama3 rope scaling lacks {key!r}")
        rope.factor = _positive_float(merged, "factor", 1.0, path)
        rope.low_freq_factor = _positive_float(merged, "low_freq_factor", 1.0, path)
        rope.high_freq_factor = _positive_float(merged, "high_freq_factor", 4.0, path)
        rope.original_max_position_embeddings = _original_context(raw, merged, path)
    return rope


def _original_context(raw: dict, merged: dict, path: Path) -> int:
    """The context a scaled rope (llama3, yarn) was trained at, read as transformers reads it: a top-level
    original_max_position_embeddings wins over the rope's own, and max_position_embeddings stands in for both."""
    for source in (raw, merged):
        if source.get("original_max_position_embeddings") is not None:
            return _positive_int(source, ("original_max_position_embeddings",), path)
    return _positive_int(raw, ("max_position_embeddings",), path)


def _parse_yarn(rope: RopeConfig, merged: dict, raw: dict, path: Path) -> RopeConfig:
    """yarn's fields, defaulted as the reference implementation defaults them (mscale 0: none given)."""
    rope.original_max_position_embeddings = original = _original_context(raw, merged, path)
    if merged.get("factor") is not None:
        rope.factor = _positive_float(merged, "factor", 1.0, path)
    else:   # the context the scaling reaches over the one trained at
        rope.factor = _positive_int(raw, ("max_position_embeddings",), path) / original
    rope.beta_fast = _positive_float(merged, "beta_fast", 32.0, path)
    rope.beta_slow = _positive_float(merged, "beta_slow", 1.0, path)
    rope.truncate = _flag(merged, "truncate", True, path)
    mscale = _nonnegative_float(merged, "mscale", 0.0, path)
    rope.mscale_all_dim = _nonnegative_float(merged, "mscale_all_dim", 0.0, path)
    if merged.get("attention_factor") is not None:
        rope.attention_factor = _positive_float(merged, "attention_factor", 1.0, path)
    elif mscale and rope.mscale_all_dim:
        rope.attention_factor = yarn_mscale(rope.factor, mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        rope.attention_factor = yarn_mscale(rope.factor)
    return rope


def _parse_longrope(rope: RopeConfig, merged: dict, raw: dict, path: Path, rotary_dim: int) -> RopeConfig:
    """longrope's fields as transformers' Phi-3 reads them (RopeConfig.uses_long_factor says which list is used)."""
    original = PHI3_ORIGINAL_CONTEXT
    if raw.get("original_max_position_embeddings") is not None:
        original = _positive_int(raw, ("original_max_position_embeddings",), path)
    max_positions = _optional_int(raw, "max_position_embeddings", 4096, path)
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = merged.get(key)
        if (not isinstance(value, list) or len(value) != rotary_dim // 2
                or not all(_is_number(f) and f > 0 for f in value)):
            got = f"a list of {len(value)}" if isinstance(value, list) else repr(value)
            raise CheckpointError(f"{path}: longrope {key} must list {rotary_dim // 2} positive numbers (one per "
                                  f"rotary frequency), got {got}")
        factors[key] = [float(f) for f in value]
    rope.original_max_position_embeddings = original
    # transformers scales by the context the model reaches over the one it was trained at, unless given
    rope.factor = _positive_float(merged, "factor", max_positions / original, path)
    if merged.get("attention_factor") is not None:
        rope.attention_factor = _positive_float(merged, "attention_factor", 1.0, path)
    elif rope.factor > 1:
        rope.attention_factor = math.sqrt(1 + math.log(rope.factor) / math.log(original))
    rope.short_factor, rope.long_factor = factors["short_factor"], factors["long_factor"]
    return rope


def _rotary_dim(raw: dict, head_dim: int, path: Path, default: float | None = None) -> int | None:
    """Phi-3's and GLM-4.5's rotary dims per head: int(head_dim * partial_rotary_factor), read from the rope's
    parameters or else the top level as transformers reads it (`default` when neither gives it); None when every
    dim rotates."""
    merged = {**_mapping(raw, "rope_scaling", path), **_mapping(raw, "rope_parameters", path)}
    factor = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", default))
    if factor is None:
        return None
    if not _is_number(factor) or not 0 < factor <= 1:
        raise CheckpointError(f"{path}: partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    if factor == 1:
        return None
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor {factor} leaves {rotary_dim} of the {head_dim} "
                                    f"head dims to rotate; the rotary dims must be an even number")
    return rotary_dim


def _granite_scalars(raw: dict, path: Path) -> dict:
    """Granite's multipliers (GRANITE_MODEL_TYPES), defaulted as transformers defaults them (attention_multiplier too:
    1.0)."""
    if raw.get("model_type") not in GRANITE_MODEL_TYPES:
        return {}
    return {key: _positive_float(raw, key, 1.0, path)
            for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}


def _gemma_fields(raw: dict, num_layers: int, hidden: int, path: Path) -> dict:
    """Gemma 3's and Gemma 2's fields, read and defaulted as transformers reads them; {} for another model type."""
    model_type = raw.get("model_type")
    if model_type not in GEMMA_MODEL_TYPES:
        return {}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if model_type == "gemma3_text" and raw.get(key) is not None:
            raise UnsupportedModelError(f"{path}: {key} {raw[key]!r} is not supported (Gemma 3 checkpoints set it "
                                        f"to null; tanh softcapping is Gemma 2's)")
    if _flag(raw, "use_bidirectional_attention", False, path):
        raise UnsupportedModelError(f"{path}: use_bidirectional_attention true is not supported (the engine "
                                    f"decodes causally)")
    activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in GEMMA3_ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: hidden_activation {activation!r} is not supported "
                                    f"(supported: {', '.join(GEMMA3_ACTIVATIONS)})")
    gemma2 = model_type == "gemma2"   # every other layer sliding whatever sliding_window_pattern says
    local_layers = _gemma3_layer_types({**raw, "sliding_window_pattern": 2} if gemma2 else raw, num_layers, path)
    window = raw.get("sliding_window", GEMMA3_DEFAULTS["sliding_window"])   # null: the sliding layers see all
    window = None if window is None else _positive_int({"sliding_window": window}, ("sliding_window",), path)
    scalar = _positive_float(raw, "query_pre_attn_scalar", GEMMA3_DEFAULTS["query_pre_attn_scalar"], path)
    fields = {"hidden_act": activation, "norm_weight_offset": True, "sandwich_norms": True,
              "embedding_multiplier": hidden ** 0.5, "embedding_multiplier_in_dtype": True,
              "attention_multiplier": scalar ** -0.5,
              "sliding_windows": [window if local else None for local in local_layers]}
    if gemma2:   # one rope (parse_config's) for all layers; a cap of null: none
        return {**fields, **{key: _positive_float(raw, key, None, path)
                             for key in ("attn_logit_softcapping", "final_logit_softcapping")}}
    rope, local_rope = _gemma3_ropes(raw, path)
    return {**fields, "rope": rope, "local_rope": local_rope, "local_rope_layers": local_layers}


def _gemma3_layer_types(raw: dict, num_layers: int, path: Path) -> list[bool]:
    """Per layer: sliding attention (True) or full, from layer_types, else every sliding_window_pattern-th
    layer full (older configs)."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = _optional_int(raw, "sliding_window_pattern", GEMMA3_DEFAULTS["sliding_window_pattern"], path)
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or not all(kind in GEMMA3_LAYER_TYPES for kind in layer_types)):
        raise CheckpointError(f"{path}: layer_types must list one of {', '.join(GEMMA3_LAYER_TYPES)} per layer "
                              f"({num_layers}), got {layer_types!r}")
    return [kind == "sliding_attention" for kind in layer_types]


def _gemma3_ropes(raw: dict, path: Path) -> tuple[RopeConfig, RopeConfig]:
    """The full-attention layers' rope and the sliding ones': rope_parameters by layer type (newer configs),
    else rope_theta with rope_scaling and rope_local_base_freq unscaled (older ones)."""
    local_theta = _positive_float(raw, "rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_base_freq"], path)
    by_type = _mapping(raw, "rope_parameters", path)
    if not by_type.keys() & set(GEMMA3_LAYER_TYPES):
        return _parse_rope(raw, path), RopeConfig(theta=local_theta)
    full = _parse_rope({**raw, "rope_scaling": None,
                        "rope_parameters": _mapping(by_type, "full_attention", path)}, path)
    local = _parse_rope({**raw, "rope_scaling": None, "rope_theta": local_theta,
                         "rope_parameters": _mapping(by_type, "sliding_attention", path)}, path)
    return full, local


def _gpt_oss_defaulted(raw: dict) -> dict:
    """gpt-oss's config with transformers' defaults for the keys it omits (and its yarn rope for a null one)."""
    if raw.get("num_experts") is not None and raw.get("num_local_experts") is None:   # transformers' other name
        raw = {**raw, "num_local_experts": raw["num_experts"]}
    raw = {**GPT_OSS_DEFAULTS, **raw}
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw["rope_parameters"] = GPT_OSS_ROPE
    return raw


def _gpt_oss_mxfp4(raw: dict, path: Path) -> bool:
    """Whether the checkpoint is a gpt-oss one with MXFP4 experts (what the loader dequantizes); any other
    quantization_config is refused by the caller."""
    quantization = raw.get("quantization_config")
    return (raw.get("model_type") == "gpt_oss" and isinstance(quantization, dict)
            and quantization.get("quant_method") == GPT_OSS_QUANTIZATION)


def _gpt_oss_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """gpt-oss's fields: sinks, float32 norms, and sliding-window layers by layer_types (else every other layer,
    the first included, as transformers defaults them); {} for another model type."""
    if raw.get("model_type") != "gpt_oss":
        return {}
    window = None if raw.get("sliding_window") is None else _positive_int(raw, ("sliding_window",), path)
    local_layers = _gemma3_layer_types({**raw, "sliding_window_pattern": 2}, num_layers, path)
    return {"attention_sinks": True, "norms_in_float32": True,
            "sliding_windows": [window if local else None for local in local_layers]}


def _parse_gpt_oss_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """gpt-oss's experts: every layer sparse, biased router and experts, the clamped SwiGLU."""
    num_experts = _positive_int(raw, ("num_local_experts", "num_experts"), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    swiglu = (_positive_float(raw, "swiglu_alpha", 1.702, path), _positive_float(raw, "swiglu_limit", 7.0, path))
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True, [True] * num_layers,
                     scoring="softmax_topk", router_bias=True, expert_bias=True, swiglu=swiglu)


def _nope_layers(rotates, interval: int | None, num_layers: int, path: Path) -> list[bool]:
    """The layers that rotate nothing (SmolLM3, Llama 4): every interval-th one when an interval is given, else as
    no_rope_layers (`rotates`) lists them: 1 where a layer rotates, 0 where it does not, an entry per layer at least."""
    if interval is not None:
        rotates = [int((i + 1) % interval != 0) for i in range(num_layers)]
    elif not (isinstance(rotates, list) and len(rotates) >= num_layers and all(
            isinstance(flag, int) and not isinstance(flag, bool) and flag in (0, 1) for flag in rotates)):
        raise CheckpointError(f"{path}: no_rope_layers must list 1 (rotary) or 0 (no rotary) for each of the "
                              f"{num_layers} layers, got {rotates!r}")
    return [not rotates[i] for i in range(num_layers)]


def _smollm3_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """SmolLM3's NoPE layers, sliding-window layers and tied default, read as transformers reads them; {} for another
    model type. no_rope_layers holds 1 where a layer rotates and 0 where it does not (at least one entry per layer);
    without it every no_rope_layer_interval-th layer rotates nothing. With use_sliding_window, the layers layer_types
    marks slide, or without layer_types the NoPE ones (when sliding_window is set)."""
    if raw.get("model_type") != "smollm3":
        return {}
    rotates = raw.get("no_rope_layers")
    interval = _optional_int(raw, "no_rope_layer_interval", 4, path) if rotates is None else None
    nope = _nope_layers(rotates, interval, num_layers, path)
    window = None if raw.get("sliding_window") is None else _positive_int(raw, ("sliding_window",), path)
    use_window = _flag(raw, "use_sliding_window", False, path)
    if raw.get("layer_types") is None:
        sliding = [use_window and window is not None and layer for layer in nope]
    else:
        sliding = _gemma3_layer_types(raw, num_layers, path)
        if any(sliding) and window is None:
            raise CheckpointError(f"{path}: layer_types marks sliding_attention layers but sliding_window is null; "
                                  f"give the window's length")
        if any(sliding) and not use_window:
            raise UnsupportedModelError(f"{path}: layer_types marks sliding_attention layers but use_sliding_window "
                                        f"is false, on which transformers' attention implementations disagree (a "
                                        f"window or none); set use_sliding_window true or mark them full_attention")
    return {"nope_layers": nope, "sliding_windows": [window if layer else None for layer in sliding],
            "tie_word_embeddings": _flag(raw, "tie_word_embeddings", True, path)}


# OLMo 3's default window, for configs that omit sliding_window
OLMO3_SLIDING_WINDOW = 4096


def _olmo_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """OLMo 2's, OLMo 3's and FlexOlmo's norms: of each attention and MLP output only, q/k norms over the whole
    projections, weights multiplying the float32 row as transformers' norms multiply it. OLMo 3 adds sliding-window
    layers (by layer_types, else three in four) that rotate by a rope of their own: rope_parameters by layer type, or in
    the older spelling unscaled at 500000 whatever rope_theta says, as transformers reads it. {} for another model
    type."""
    model_type = raw.get("model_type")
    if model_type not in ("olmo2", "olmo3", "flex_olmo"):
        return {}
    fields = {"sandwich_norms": True, "input_norms": False, "qk_norm_over_heads": True, "norms_in_float32": True}
    if model_type != "olmo3":   # OLMo 2 and FlexOlmo: every layer attends all tokens
        return fields
    sliding = _gemma3_layer_types({**raw, "sliding_window_pattern": 4}, num_layers, path)
    window = raw.get("sliding_window", OLMO3_SLIDING_WINDOW)
    if window is None and any(sliding):
        raise CheckpointError(f"{path}: sliding_window is null but layer_types marks sliding_attention layers; give "
                              f"the window's length")
    window = None if window is None else _positive_int({"sliding_window": window}, ("sliding_window",), path)
    rope, local_rope = _gemma3_ropes({**raw, "rope_local_base_freq": DEFAULT_ROPE_THETA["olmo3"]}, path)
    return {**fields, "sliding_windows": [window if layer else None for layer in sliding], "rope": rope,
            "local_rope": local_rope, "local_rope_layers": sliding}


def _olmoe_fields(raw: dict, hidden: int, num_heads: int, head_dim: int, path: Path) -> dict:
    """OLMoE's fields, read as transformers reads them (defaulted by OLMOE_DEFAULTS); {} for another model type. Its
    q norm is hidden_size wide, so its heads must be hidden_size / num_attention_heads wide; clip_qkv (which clamps
    q, k and v) is not computed."""
    if raw.get("model_type") != "olmoe":
        return {}
    if head_dim * num_heads != hidden:
        raise CheckpointError(f"{path}: head_dim must be hidden_size / num_attention_heads ({hidden // num_heads}: "
                              f"OLMoE's q norm is hidden_size wide), got {head_dim}")
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{path}: clip_qkv {raw['clip_qkv']!r} is not supported for olmoe (only null: "
                                    f"OLMoE's published checkpoints clamp nothing)")
    return {"qk_norm_over_heads": True}


def _cwm_defaulted(raw: dict) -> dict:
    """CWM's config with transformers' defaults for the keys it omits (CWM_DEFAULTS, CWM_ROPE)."""
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw = {**raw, "rope_parameters": CWM_ROPE}
    return {**CWM_DEFAULTS, **raw}


def _cwm_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """CWM's windows, read as transformers reads them: layer_types' sliding_attention layers (without layer_types all
    but every CWM_FULL_ATTENTION_EVERY-th, the first included) attend the last sliding_window tokens, which must be a
    positive number as transformers requires; {} for another model type."""
    if raw.get("model_type") != "cwm":
        return {}
    window = _positive_int(raw, ("sliding_window",), path)
    if raw.get("layer_types") is None:
        sliding = [i % CWM_FULL_ATTENTION_EVERY != 0 for i in range(num_layers)]
    else:
        sliding = _gemma3_layer_types(raw, num_layers, path)
    return {"sliding_windows": [window if layer else None for layer in sliding]}


def _starcoder2_fields(raw: dict, path: Path) -> dict:
    """StarCoder2's fields, read as transformers reads them (defaulted by STARCODER2_DEFAULTS); {} for another model
    type. Its norms are LayerNorms with a bias (eps: norm_epsilon), its MLP one activated projection (c_fc) into c_proj,
    each biased with use_bias (as are q, k, v and o), its embeddings tied unless the config says otherwise."""
    if raw.get("model_type") != "starcoder2":
        return {}
    activation = raw.get("hidden_act") or STARCODER2_ACTIVATIONS[0]
    if activation not in STARCODER2_ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: hidden_act {activation!r} is not supported for starcoder2 (supported: "
                                    f"{', '.join(STARCODER2_ACTIVATIONS)})")
    return {"layer_norms": True, "norm_bias": True, "gated_mlp": False, "hidden_act": activation,
            "mlp_bias": _flag(raw, "use_bias", False, path),
            "rms_norm_eps": _positive_float(raw, "norm_epsilon", 1e-5, path),
            "tie_word_embeddings": _flag(raw, "tie_word_embeddings", True, path)}


def _apertus_defaulted(raw: dict, path: Path) -> dict:
    """Apertus's config with its rope when it gives none (APERTUS_ROPE), its variant keys checked: values other than the
    published ones (APERTUS_VARIANTS) describe a model transformers does not compute (it norms q and k, and norms no
    block's output, whatever they say)."""
    for key, value in APERTUS_VARIANTS.items():
        if key in raw and raw[key] != value:
            raise UnsupportedModelError(f"{path}: {key} {json.dumps(raw[key])} is not supported for apertus (only "
                                        f"{json.dumps(value)}, as Apertus's checkpoints say)")
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        return {**raw, "rope_parameters": APERTUS_ROPE}
    return raw


def _ungated_mlp_fields(raw: dict, head_dim: int, path: Path) -> dict:
    """Arcee's, Nemotron's, Apertus's and nanochat's fields (UNGATED_ACTIVATIONS), read as transformers reads them; {}
    for another model type. Their MLP activates one projection, no gate. Nemotron's norms are LayerNorms with a bias,
    each scaling by 1 + weight (eps: norm_eps; rms_norm_eps is not read). The others rotate every dim of each head
    (Llama's rotary), and compute nothing with a partial_rotary_factor below 1."""
    model_type = raw.get("model_type")
    if model_type not in UNGATED_ACTIVATIONS:
        return {}
    activation = raw.get("hidden_act")
    if activation not in UNGATED_ACTIVATIONS[model_type]:
        raise UnsupportedModelError(f"{path}: hidden_act {activation!r} is not supported for {model_type} (supported: "
                                    f"{', '.join(UNGATED_ACTIVATIONS[model_type])})")
    fields = {"gated_mlp": False, "hidden_act": activation}
    if model_type == "nemotron":
        return {**fields, "layer_norms": True, "norm_bias": True, "norm_weight_offset": True,
                "rms_norm_eps": _positive_float(raw, "norm_eps", 1e-5, path)}
    if _rotary_dim(raw, head_dim, path) is not None:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor below 1 is not supported for {model_type} (its "
                                    f"attention rotates all {head_dim} dims of each head)")
    return fields


def _nanochat_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """nanochat's fields, read as transformers reads them (defaulted by NANOCHAT_DEFAULTS; its MLP by
    _ungated_mlp_fields); {} for another model type. Its q and k are normed over each head after the rotary by an
    RMSNorm without a weight, as Llama 4's are on its rotary layers; its logits capped by final_logit_softcapping."""
    if raw.get("model_type") != "nanochat":
        return {}
    return {"norm_weights": False, "embedding_norm": True, "rope_reversed": True,
            "l2_qk_norm_layers": [True] * num_layers,
            "final_logit_softcapping": _positive_float(raw, "final_logit_softcapping", None, path)}


def _parse_granitemoe_moe(raw: dict, model_type: str, num_layers: int, path: Path) -> MoEConfig:
    """Granite MoE's experts, every layer sparse, each intermediate_size wide: a token's top-k router logits (computed
    in float32) weighted by a softmax over those k, which is the float32 softmax over all experts' top-k renormalized
    (the two differ in float rounding only); granitemoeshared's shared MLP beside them, shared_intermediate_size wide
    (0: none), its output added unweighted."""
    num_experts = _positive_int(raw, ("num_local_experts",), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts "
                              f"(num_local_experts)")
    moe = MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True, [True] * num_layers)
    shared = raw.get("shared_intermediate_size", 0) if model_type == "granitemoeshared" else 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise CheckpointError(f"{path}: shared_intermediate_size must be a non-negative integer (0: no shared MLP), "
                              f"got {shared!r}")
    if shared:
        moe.num_shared_experts, moe.shared_intermediate_size = 1, shared
    return moe


def _cohere_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """Cohere's fields, read and defaulted as transformers reads them; {} for another model type. Its norms multiply
    the float32 row by their weight, rounded after. Command R7B's and Command A's (cohere2) sliding-window layers (by
    layer_types, else all but every sliding_window_pattern-th) rotate, the full-attention ones rotate nothing
    (nope_layers); Command R's and R+'s (cohere) all rotate and attend in full."""
    model_type = raw.get("model_type")
    if model_type not in COHERE_MODEL_TYPES:
        return {}
    fields = {"parallel_block": True, "layer_norms": True, "rope_interleaved": True, "norms_in_float32": True,
              "qk_norm_weight_per_head": True, "rms_norm_eps": _positive_float(raw, "layer_norm_eps", 1e-5, path),
              "logit_scale": _positive_float(raw, "logit_scale", 0.0625, path),
              "tie_word_embeddings": _flag(raw, "tie_word_embeddings", True, path)}
    if model_type == "cohere":
        return fields
    sliding = _gemma3_layer_types({"sliding_window_pattern": 4, **raw}, num_layers, path)
    window = raw["sliding_window"]
    if window is None and any(sliding):   # transformers would neither window nor rotate those layers
        raise CheckpointError(f"{path}: sliding_window is null but layer_types marks sliding_attention layers; give "
                              f"the window's length")
    window = None if window is None else _positive_int(raw, ("sliding_window",), path)
    return {**fields, "sliding_windows": [window if layer else None for layer in sliding],
            "nope_layers": [not layer for layer in sliding]}


def _exaone4_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """EXAONE 4.0's fields, read as transformers reads them (defaulted by EXAONE4_DEFAULTS); {} for another model type.
    Its norms are OLMo 2's places (each attention and MLP output normed, neither input) with q and k normed over each
    head. With a sliding_window, layer_types' sliding_attention layers (without layer_types: all but every
    sliding_window_pattern-th, an integer) attend that window and rotate, and the full-attention ones rotate nothing;
    with a null one every layer rotates and attends in full (1.2B). K-EXAONE's (exaone_moe) alike, but in Llama's layer:
    the attention's and the MLP's inputs normed, not their outputs."""
    model_type = raw.get("model_type")
    if model_type not in ("exaone4", "exaone_moe"):
        return {}
    fields = {"sandwich_norms": True, "input_norms": False, "qk_norm": True} if model_type == "exaone4" else \
        {"qk_norm": True}
    window = raw["sliding_window"]
    if window is None and raw.get("layer_types") is None:   # transformers' pattern 0: no sliding layer
        return fields
    if raw.get("layer_types") is None:
        pattern = raw.get("sliding_window_pattern")
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise CheckpointError(f"{path}: sliding_window_pattern must be a positive integer (every how many layers "
                                  f"one attends in full) when layer_types is not given, got {pattern!r}")
    sliding = _gemma3_layer_types(raw, num_layers, path)
    if window is None:
        if any(sliding):   # transformers would have no window to give those layers
            raise CheckpointError(f"{path}: sliding_window is null but layer_types marks sliding_attention layers; "
                                  f"give the window's length")
        return fields
    window = _positive_int(raw, ("sliding_window",), path)
    return {**fields, "sliding_windows": [window if layer else None for layer in sliding],
            "nope_layers": [not layer for layer in sliding]}


def _llama4_fields(raw: dict, num_layers: int, path: Path) -> dict:
    """Llama 4's fields, read as transformers reads them (defaulted by LLAMA4_TEXT_DEFAULTS); {} for another model
    type. Its NoPE layers (0 in no_rope_layers; without it, or with it empty, every no_rope_layer_interval-th layer)
    rotate nothing and, with attn_temperature_tuning, scale their queries by position; the others (rotary) norm q and
    k with use_qk_norm. layer_types' chunked_attention layers (without layer_types: the rotary ones, unless
    attention_chunk_size is null) attend by chunks of attention_chunk_size. Its rotary dims are interleaved pairs, and
    its dense layers' MLP is intermediate_size_mlp wide (intermediate_size is an expert's)."""
    if raw.get("model_type") != "llama4_text":
        return {}
    rotates = raw.get("no_rope_layers")   # empty: by the interval, as transformers reads Llama 4's
    interval = _positive_int(raw, ("no_rope_layer_interval",), path) if not rotates else None
    nope = _nope_layers(rotates, interval, num_layers, path)
    chunk = None if raw.get("attention_chunk_size") is None else _positive_int(raw, ("attention_chunk_size",), path)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        chunked = [chunk is not None and not layer for layer in nope]
    elif (not isinstance(layer_types, list) or len(layer_types) != num_layers
          or not all(kind in LLAMA4_LAYER_TYPES for kind in layer_types)):
        raise CheckpointError(f"{path}: layer_types must list one of {', '.join(LLAMA4_LAYER_TYPES)} per layer "
                              f"({num_layers}), got {layer_types!r}")
    else:
        chunked = [kind == "chunked_attention" for kind in layer_types]
        if any(chunked) and chunk is None:
            raise CheckpointError(f"{path}: layer_types marks chunked_attention layers but attention_chunk_size is "
                                  f"null; give the chunks' length")
    temperature = None
    tuning = raw.get("attn_temperature_tuning")
    # Scout's and Maverick's published configs say 4, which transformers then read as a truth value: a number but 0 is
    # on (true, false and absent as _flag reads them)
    if tuning != 0 if _is_number(tuning) else _flag(raw, "attn_temperature_tuning", True, path):
        temperature = (_positive_float(raw, "floor_scale", 8192.0, path),
                       _nonnegative_float(raw, "attn_scale", 0.1, path))
    qk_norm = _flag(raw, "use_qk_norm", True, path)
    return {"nope_layers": nope, "sliding_windows": [-chunk if layer else None for layer in chunked],
            "rope_interleaved": True, "l2_qk_norm_layers": [qk_norm and not layer for layer in nope],
            "attn_temperature": temperature,
            "intermediate_size": _positive_int(raw, ("intermediate_size_mlp",), path)}


def _ministral3_defaulted(raw: dict) -> dict:
    """Ministral 3's config with transformers' defaults for the keys it omits (MINISTRAL3_DEFAULTS, MINISTRAL3_ROPE)."""
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw = {**raw, "rope_parameters": MINISTRAL3_ROPE}
    return {**MINISTRAL3_DEFAULTS, **raw}


def _mistral4_defaulted(raw: dict, path: Path) -> dict:
    """Mistral 4's config with transformers' defaults for the keys it omits (MISTRAL4_DEFAULTS, MISTRAL4_ROPE; no
    num_key_value_heads: its latent attention has one K/V per query head), its rope's partial_rotary_factor checked:
    transformers rotates int((qk_nope_head_dim + qk_rope_head_dim) * factor) dims, which must be qk_rope_head_dim."""
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw = {**raw, "rope_parameters": MISTRAL4_ROPE}
    raw = {**MISTRAL4_DEFAULTS, **raw}
    factor = {**_mapping(raw, "rope_scaling", path), **_mapping(raw, "rope_parameters", path)}.get(
        "partial_rotary_factor")
    rope_dims = _positive_int(raw, ("qk_rope_head_dim",), path)
    head_dim = _positive_int(raw, ("qk_nope_head_dim",), path) + rope_dims
    if factor is not None and (not _is_number(factor) or int(head_dim * factor) != rope_dims):
        raise CheckpointError(f"{path}: rope_parameters: partial_rotary_factor must rotate qk_rope_head_dim "
                              f"({rope_dims} of {head_dim} dims: {rope_dims / head_dim}), got {factor!r}")
    return raw


def _ministral3_fields(raw: dict, rope: RopeConfig, path: Path) -> dict:
    """Ministral 3's and Mistral 4's query scaling by position, read from the rope's parameters as transformers reads
    it: its beta (llama_4_scaling_beta) and the length of its steps (original_max_position_embeddings: a yarn or
    llama3 rope's own, a top-level one winning, as the rope reads it); transformers computes nothing without either.
    {} for another model type."""
    model_type = raw.get("model_type")
    if model_type not in ("ministral3", "mistral4"):
        return {}
    merged = {**_mapping(raw, "rope_scaling", path), **_mapping(raw, "rope_parameters", path)}
    rope_path = Path(f"{path}: rope_parameters")
    if merged.get("llama_4_scaling_beta") is None:
        raise CheckpointError(f"{rope_path}: llama_4_scaling_beta is missing; {model_type} scales its queries by "
                              f"1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))")
    beta = _nonnegative_float(merged, "llama_4_scaling_beta", 0.0, rope_path)
    if rope.rope_type in ("yarn", "llama3"):
        return {"position_query_scale": (rope.original_max_position_embeddings, beta)}
    return {"position_query_scale": (_positive_int(merged, ("original_max_position_embeddings",), rope_path), beta)}


def _seed_oss_fields(raw: dict, path: Path) -> dict:
    """Seed-OSS's o_proj bias, by its own key attention_out_bias (q, k and v follow attention_bias); {} for another
    model type. Its attention and residual dropouts apply in training only."""
    if raw.get("model_type") != "seed_oss":
        return {}
    return {"o_bias": _flag(raw, "attention_out_bias", False, path)}


def _ernie4_5_fields(raw: dict, path: Path) -> dict:
    """ERNIE 4.5's fields, read as transformers reads them; {} for another model type. Its rotary dims are interleaved
    pairs (the loader reorders q's and k's rows to the halves the engine rotates), its embeddings tied unless the
    config says otherwise, and use_bias puts a bias on every projection of the attention and the MLPs (the dense ones
    and, in the mixture of experts, the shared experts: refused there; the routed experts never have one)."""
    model_type = raw.get("model_type")
    if model_type not in ("ernie4_5", "ernie4_5_moe"):
        return {}
    use_bias = _flag(raw, "use_bias", False, path)
    if use_bias and model_type == "ernie4_5_moe":
        raise UnsupportedModelError(f"{path}: use_bias true is not supported for ernie4_5_moe (its shared experts "
                                    f"would carry biases; ERNIE 4.5's published checkpoints say false)")
    return {"rope_interleaved": True, "mlp_bias": use_bias,
            "tie_word_embeddings": _flag(raw, "tie_word_embeddings", True, path)}


def _parse_ernie4_5_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """ERNIE 4.5's experts (defaulted by ERNIE4_5_MOE_DEFAULTS): every moe_layer_interval-th layer from
    moe_layer_start_index to moe_layer_end_index (-1: the last) sparse, the others dense; DeepSeek's grouped routing
    with one group over softmax scores (in float32, by a float32 router), the top-k chosen by score plus a
    correction bias, weighted by their scores renormalized (the sum at least moe_norm_min), unscaled; beside
    moe_num_shared_experts shared experts."""
    num_experts = _positive_int(raw, ("moe_num_experts",), path)
    top_k = _positive_int(raw, ("moe_k",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: moe_k {top_k} exceeds the {num_experts} experts (moe_num_experts)")
    start, end, shared = (raw.get(key) for key in ("moe_layer_start_index", "moe_layer_end_index",
                                                   "moe_num_shared_experts"))
    for key, value in (("moe_layer_start_index", start), ("moe_num_shared_experts", shared)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{path}: {key} must be a non-negative integer, got {value!r}")
    if isinstance(end, bool) or not isinstance(end, int) or end < -1:
        raise CheckpointError(f"{path}: moe_layer_end_index must be a layer index or -1 (the last), got {end!r}")
    end = num_layers - 1 if end == -1 else end
    interval = _positive_int(raw, ("moe_layer_interval",), path)
    sparse = [(i + 1) % interval == 0 and start <= i <= end for i in range(num_layers)]
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("moe_intermediate_size",), path), True, sparse,
                     num_shared_experts=shared, grouped=True, group_score_experts=1, score_correction=True,
                     norm_min=_positive_float(raw, "moe_norm_min", 1e-12, path))


def _hunyuan_fields(raw: dict, head_dim: int, rope: RopeConfig, path: Path) -> dict:
    """Hunyuan's fields (HUNYUAN_MODEL_TYPES), read as transformers reads them; {} for another model type. Its q/k
    norms come after the rotary. Its published ropes say type "dynamic" with an alpha: a fixed NTK stretch of the base
    (rope_theta * alpha ** (head_dim / (head_dim - 2))), the same at every length, not dynamic NTK's (which with no
    alpha, or alpha 0, computes as the default rope within the context the engine serves)."""
    if raw.get("model_type") not in HUNYUAN_MODEL_TYPES:
        return {}
    fields: dict = {"qk_norm_after_rope": True}
    for key in ("rope_parameters", "rope_scaling"):
        scaling = _mapping(raw, key, path)
        if scaling.get("rope_type", scaling.get("type")) == "dynamic" and scaling.get("alpha"):
            alpha = _positive_float(scaling, "alpha", 1.0, Path(f"{path}: {key}"))
            if head_dim <= 2:
                raise CheckpointError(f"{path}: {key}: an alpha needs heads wider than 2 dims, got head_dim {head_dim}")
            fields["rope"] = RopeConfig(theta=rope.theta * alpha ** (head_dim / (head_dim - 2)))
            break
    return fields


def _parse_hunyuan_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """Hunyuan-A13B's experts, read as transformers reads them: every layer sparse, num_experts experts and one shared
    MLP, all intermediate_size wide (transformers reads neither moe_intermediate_size nor num_shared_expert); a
    float32 router (as transformers builds it) whose softmax's moe_topk best experts are weighted by their scores
    renormalized, unscaled: DeepSeek's grouped routing in one group, without a correction bias. moe_topk may list a
    top-k per layer, which the engine follows when they agree."""
    num_experts = _positive_int(raw, ("num_experts", "num_local_experts"), path)
    top_k = raw.get("moe_topk", 1)
    if isinstance(top_k, list) and len(top_k) == num_layers and len(set(map(repr, top_k))) == 1:
        top_k = top_k[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise CheckpointError(f"{path}: moe_topk must be a number of experts in [1, {num_experts}] (num_experts), or "
                              f"one such number per layer, all equal; got {top_k!r}")
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True, [True] * num_layers,
                     num_shared_experts=1, grouped=True, group_score_experts=1)


def _dots1_defaulted(raw: dict) -> dict:
    """dots.llm1's config (defaulted by DOTS1_DEFAULTS) with a null n_group or topk_group read as one group:
    transformers cannot route by a null count of groups, and its one-group default is how other runtimes read
    dots.llm1's published configs, reported to say null. A scoring_func of "noaux_tc" (the topk_method's name, which
    GGUF converters of the published checkpoints require there) is its sigmoid routing: transformers never reads the
    key and routes by sigmoid scores whatever it says."""
    groups = {key: 1 for key in ("n_group", "topk_group") if raw.get(key) is None}
    scoring = {"scoring_func": "sigmoid"} if raw.get("scoring_func") == "noaux_tc" else {}
    return {**raw, **groups, **scoring}


def _dots1_sliding_windows(raw: dict, num_layers: int, path: Path) -> list[int | None]:
    """dots.llm1's windows, read as transformers reads them whatever use_sliding_window says: layer_types'
    sliding_attention layers (without layer_types: those from max_window_layers on, when sliding_window is set) attend
    the last sliding_window tokens."""
    window = None if raw.get("sliding_window") is None else _positive_int(raw, ("sliding_window",), path)
    if raw.get("layer_types") is None:
        if window is None:
            return [None] * num_layers
        first = raw.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise CheckpointError(f"{path}: max_window_layers must be a non-negative integer, got {first!r}")
        return [window if i >= first else None for i in range(num_layers)]
    sliding = _gemma3_layer_types(raw, num_layers, path)
    if window is None and any(sliding):
        raise CheckpointError(f"{path}: sliding_window is null but layer_types marks sliding_attention layers; give "
                              f"the window's length")
    return [window if layer else None for layer in sliding]


def _solar_open_defaulted(raw: dict) -> dict:
    """Solar Open's config (defaulted by SOLAR_OPEN_DEFAULTS) with, where it gives no intermediate_size (transformers
    reads none: no layer is dense), an expert's width in its place, never used."""
    if raw.get("intermediate_size") is None:
        return {**raw, "intermediate_size": raw.get("moe_intermediate_size")}
    return raw


def _solar_open_fields(raw: dict, head_dim: int, path: Path) -> dict:
    """Solar Open's rotary checked: transformers rotates every dim of each head with Llama's attention, and computes
    nothing with a partial_rotary_factor below 1 (Solar-Open-100B's config says 1.0). {} always."""
    if raw.get("model_type") == "solar_open" and _rotary_dim(raw, head_dim, path) is not None:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor below 1 is not supported for solar_open (its "
                                    f"attention rotates all {head_dim} dims of each head)")
    return {}


def _glm4_fields(raw: dict, path: Path) -> dict:
    """GLM-4's fields (glm4), read as transformers reads them: its rotary dims interleaved pairs (the loader reorders
    each q and k head's rotary rows to the halves the engine rotates), gate and up one gate_up_proj, the attention's
    and the MLP's outputs normed before their residual adds. GLM-4.7-Flash's (glm4_moe_lite) checked: rope_interleave
    a flag, and the rope all of qk_rope_head_dim (transformers rotates no part of it alone). {} for another model
    type."""
    model_type = raw.get("model_type")
    if model_type == "glm4":
        return {"rope_interleaved": True, "fused_gate_up": True, "sandwich_norms": True}
    if model_type == "glm4_moe_lite":
        _flag(raw, "rope_interleave", True, path)
        rope_dims = _positive_int(raw, ("qk_rope_head_dim",), path)
        if _rotary_dim(raw, rope_dims, path) is not None:
            raise UnsupportedModelError(f"{path}: partial_rotary_factor below 1 is not supported for glm4_moe_lite "
                                        f"(its rope rotates all {rope_dims} qk_rope_head_dim dims)")
    return {}


def _mlp_layer_types(raw: dict, num_layers: int, path: Path, first_sparse: int) -> list[bool]:
    """GLM-4.7-Flash's and K-EXAONE's MoE layers: those mlp_layer_types marks sparse (the others dense), or without it
    all from first_sparse on, as transformers reads them."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        return [i >= first_sparse for i in range(num_layers)]
    if (not isinstance(kinds, list) or len(kinds) < num_layers
            or not all(kind in GLM4_MOE_LITE_MLP_TYPES for kind in kinds)):
        raise CheckpointError(f"{path}: mlp_layer_types must list one of {', '.join(GLM4_MOE_LITE_MLP_TYPES)} per "
                              f"layer ({num_layers}), got {kinds!r}")
    return [kind == "sparse" for kind in kinds[:num_layers]]


def _minimax_m2_defaulted(raw: dict, path: Path) -> dict:
    """MiniMax-M2's config with transformers' defaults for the keys it omits (num_experts: its other name for
    num_local_experts), its variant keys checked: values other than the published ones (MINIMAX_M2_VARIANTS), or
    linear-attention layers in attn_type_list, describe a model transformers does not compute."""
    for key, value in MINIMAX_M2_VARIANTS.items():
        if key in raw and raw[key] != value:
            raise UnsupportedModelError(f"{path}: {key} {json.dumps(raw[key])} is not supported for minimax_m2 "
                                        f"(only {json.dumps(value)}, as MiniMax-M2's checkpoints say)")
    kinds = raw.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(kind != 1 for kind in kinds)):
        raise UnsupportedModelError(f"{path}: attn_type_list must mark every layer 1 (full softmax attention, the "
                                    f"only kind minimax_m2 has), got {kinds!r}")
    if raw.get("num_experts") is not None and raw.get("num_local_experts") is None:
        raw = {**raw, "num_local_experts": raw["num_experts"]}
    return {**MINIMAX_M2_DEFAULTS, **raw}


def _minimax_m2_rotary_factor(raw: dict, head_dim: int, path: Path) -> float | None:
    """The partial_rotary_factor MiniMax-M2's rotary_dim stands for (rotary_dim / head_dim), which a
    partial_rotary_factor of the rope's parameters or the top level overrides, as transformers reads them; None
    without rotary_dim."""
    if raw.get("rotary_dim") is None:
        return None
    rotary_dim = _positive_int(raw, ("rotary_dim",), path)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise CheckpointError(f"{path}: rotary_dim must be an even number of dims at most head_dim {head_dim}, got "
                              f"{rotary_dim}")
    return rotary_dim / head_dim


def _minimax_m2_fields(raw: dict, path: Path) -> dict:
    """MiniMax-M2's q/k norms, over the whole q and k projections, and its multi-token-prediction modules
    (num_mtp_modules layers after the decoder's), which transformers does not load, nor does the engine; {} for
    another model type."""
    if raw.get("model_type") != "minimax_m2":
        return {}
    modules = raw.get("num_mtp_modules") or 0
    if isinstance(modules, bool) or not isinstance(modules, int) or modules < 0:
        raise CheckpointError(f"{path}: num_mtp_modules must be a non-negative integer, got {modules!r}")
    return {"qk_norm": True, "qk_norm_over_heads": True, "num_nextn_layers": modules}


def _parse_minimax_m2_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """MiniMax-M2's experts, every layer sparse: the top-k of the router's sigmoid scores plus a correction bias
    (DeepSeek's grouped routing with one group), weighted by their scores renormalized, unscaled; no shared expert.
    Its router multiplies in the model's dtype, as transformers' does."""
    num_experts = _positive_int(raw, ("num_local_experts",), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts "
                              f"(num_local_experts)")
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True, [True] * num_layers,
                     scoring="sigmoid", grouped=True, group_score_experts=1, router_in_model_dtype=True)


def _afmoe_checked(raw: dict, path: Path) -> dict:
    """Trinity's config (defaulted by AFMOE_DEFAULTS), its variant keys checked: values other than the published ones
    (AFMOE_VARIANTS) describe routing transformers does not compute (it reads none of those keys)."""
    for key, value in AFMOE_VARIANTS.items():
        if raw.get(key) is not None and raw[key] != value:
            raise UnsupportedModelError(f"{path}: {key} {json.dumps(raw[key])} is not supported for afmoe (only "
                                        f"{json.dumps(value)}, as Trinity's checkpoints say)")
    return raw


def _afmoe_fields(raw: dict, num_layers: int, hidden: int, path: Path) -> dict:
    """Trinity's fields, read as transformers reads them (AFMOE_DEFAULTS says what it describes); {} for another model
    type. Its sliding_attention layers (layer_types', or without it all but every global_attn_every_n_layers-th)
    attend the last sliding_window tokens and rotate, its full-attention ones rotate nothing."""
    if raw.get("model_type") != "afmoe":
        return {}
    fields = {"sandwich_norms": True, "norms_in_float32": True, "attn_output_gate": True}
    if _flag(raw, "mup_enabled", False, path):   # muP: the embeddings only (the logits are not scaled)
        fields["embedding_multiplier"] = hidden ** 0.5
    if raw.get("layer_types") is None:
        every = _positive_int(raw, ("global_attn_every_n_layers",), path)
        sliding = [(i + 1) % every != 0 for i in range(num_layers)]
    else:
        sliding = _gemma3_layer_types(raw, num_layers, path)
    window = None if raw.get("sliding_window") is None else _positive_int(raw, ("sliding_window",), path)
    if window is None and any(sliding):   # transformers would have no window to give those layers
        raise CheckpointError(f"{path}: sliding_window is null but sliding_attention layers attend a window; give the "
                              f"window's length")
    return {**fields, "sliding_windows": [window if layer else None for layer in sliding],
            "nope_layers": [not layer for layer in sliding]}


def _parse_afmoe_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """Trinity's experts: the first num_dense_layers layers dense, the others sparse; a token's top-k of the router's
    sigmoid scores plus expert_bias (MiniMax-M2's one-group routing, its logits in the model's dtype), weighted by
    their scores renormalized times route_scale, beside num_shared_experts shared experts as one MLP."""
    num_experts = _positive_int(raw, ("num_experts",), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts (num_experts)")
    counts = {key: raw.get(key) for key in ("num_dense_layers", "num_shared_experts")}
    for key, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CheckpointError(f"{path}: {key} must be a non-negative integer, got {count!r}")
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("moe_intermediate_size",), path), True,
                     [i >= counts["num_dense_layers"] for i in range(num_layers)], scoring="sigmoid",
                     routed_scaling_factor=_positive_float(raw, "route_scale", 1.0, path),
                     num_shared_experts=counts["num_shared_experts"], grouped=True, group_score_experts=1,
                     router_in_model_dtype=True)


def _parse_llama4_moe(raw: dict, num_layers: int, path: Path) -> MoEConfig:
    """Llama 4's experts: the layers moe_layers lists (without it every interleave_moe_layer_step-th) sparse, each
    with one shared expert of an expert's size; a token's top-k experts by the router's logits, each taking the
    token's hidden state times its logit's sigmoid ("sigmoid_topk")."""
    num_experts = _positive_int(raw, ("num_local_experts",), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        step = _positive_int(raw, ("interleave_moe_layer_step",), path)
        moe_layers = range(step - 1, num_layers, step)
    elif not isinstance(moe_layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in moe_layers):
        raise CheckpointError(f"{path}: moe_layers must list layer indices in [0, {num_layers}), got {moe_layers!r}")
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), False,
                     [i in moe_layers for i in range(num_layers)], scoring="sigmoid_topk", num_shared_experts=1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _qwen2_moe_sliding_windows(raw: dict, num_layers: int, path: Path) -> list[int | None]:
    """Qwen2-MoE's windows, read as transformers reads them: with use_sliding_window, layer_types' sliding_attention
    layers (without layer_types: every other layer from the first, below max_window_layers) attend the last
    sliding_window tokens; without it none does (its configs then say sliding_window 0)."""
    if not _flag(raw, "use_sliding_window", False, path):
        return [None] * num_layers
    window = _positive_int(raw, ("sliding_window",), path)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        below = raw.get("max_window_layers")
        if isinstance(below, bool) or not isinstance(below, int) or below < 0:
            raise CheckpointError(f"{path}: max_window_layers must be a non-negative integer, got {below!r}")
        return [window if i % 2 == 0 and i < below else None for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or \
            not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{path}: layer_types must list one attention type per layer ({num_layers}), "
                              f"sliding_attention or full_attention, got {layer_types!r}")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _parse_sliding_windows(raw: dict, model_type: str, num_layers: int, path: Path) -> list[int | None]:
    if model_type == "qwen2_moe":
        return _qwen2_moe_sliding_windows(raw, num_layers, path)
    if model_type == "dots1":
        return _dots1_sliding_windows(raw, num_layers, path)
    window = None if raw.get("sliding_window") is None else _positive_int(raw, ("sliding_window",), path)
    if model_type in ("mistral", "mixtral", "phi3", "ministral3", "starcoder2"):
        return [window] * num_layers
    # Qwen: sliding_window applies only with use_sliding_window (transformers drops it otherwise), to the
    # layers layer_types marks, or else to those from max_window_layers (default 28) on
    if model_type not in ("qwen2", "qwen3", "qwen3_moe") or not _flag(raw, "use_sliding_window", False, path):
        return [None] * num_layers
    if model_type == "qwen3_moe" or window is None:
        return [window] * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise CheckpointError(f"{path}: layer_types must list one attention type per layer ({num_layers}), "
                                  f"got {layer_types!r}")
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    first_windowed = raw.get("max_window_layers", 28)
    if isinstance(first_windowed, bool) or not isinstance(first_windowed, int) or first_windowed < 0:
        raise CheckpointError(f"{path}: max_window_layers must be a non-negative integer, got {first_windowed!r}")
    return [window if i >= first_windowed else None for i in range(num_layers)]


def token_ids(value, key: str, path: Path) -> list[int]:
    """A config's token id field (`eos_token_id`: one id or a list of them) as a list; [] when absent."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: {key} must be a token id or a list of token ids, got {value!r}")
    return ids


def _positive_int(raw: dict, keys: tuple[str, ...], path: Path) -> int:
    """The first of `keys` present in the config (checkpoints name some fields differently), as an int >= 1."""
    for key in keys:
        if raw.get(key) is not None:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{path}: {key} must be a positive integer, got {value!r}")
            return value
    raise CheckpointError(f"{path}: missing required field {keys[0]!r}")


def _parse_moe(raw: dict, model_type: str, num_layers: int, path: Path) -> MoEConfig | None:
    if model_type in ("deepseek_v3", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "mistral4", "dots1", "exaone_moe",
                      "solar_open"):
        return _parse_deepseek_moe(raw, model_type, num_layers, path)
    if model_type == "gpt_oss":
        return _parse_gpt_oss_moe(raw, num_layers, path)
    if model_type == "llama4_text":
        return _parse_llama4_moe(raw, num_layers, path)
    if model_type == "ernie4_5_moe":
        return _parse_ernie4_5_moe(raw, num_layers, path)
    if model_type == "minimax_m2":
        return _parse_minimax_m2_moe(raw, num_layers, path)
    if model_type == "afmoe":
        return _parse_afmoe_moe(raw, num_layers, path)
    if model_type == "hunyuan_v1_moe":
        return _parse_hunyuan_moe(raw, num_layers, path)
    if model_type in ("granitemoe", "granitemoeshared"):
        return _parse_granitemoe_moe(raw, model_type, num_layers, path)
    if model_type not in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo"):
        return None
    if model_type == "qwen2_moe" and raw.get("num_experts") == 0:   # transformers: every layer the dense MLP
        return None
    num_experts = _positive_int(raw, ("num_local_experts", "num_experts"), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True,
                         [True] * num_layers)
    if model_type in ("olmoe", "flex_olmo"):
        return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path),
                         _flag(raw, "norm_topk_prob", False, path), [True] * num_layers)
    # Qwen3-MoE and Qwen2-MoE: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise CheckpointError(f"{path}: mlp_only_layers must list layer indices in [0, {num_layers}), got {dense!r}")
    step = _positive_int(raw, ("decoder_sparse_step",), path) if "decoder_sparse_step" in raw else 1
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    moe = MoEConfig(num_experts, top_k, _positive_int(raw, ("moe_intermediate_size",), path),
                    _flag(raw, "norm_topk_prob", False, path), sparse)
    if model_type == "qwen2_moe":   # one shared expert, gated
        moe.num_shared_experts, moe.shared_expert_gate = 1, True
        moe.shared_intermediate_size = _positive_int(raw, ("shared_expert_intermediate_size",), path)
    return moe


# DeepSeek checkpoint fields that choose a variant: per model type, the values of the one implemented
DEEPSEEK_VARIANTS = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
                     "deepseek_v2": {"scoring_func": "softmax", "moe_layer_freq": 1},
                     "dots1": {"scoring_func": "sigmoid"},
                     "exaone_moe": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
DEEPSEEK_VARIANT_NAMES = {"deepseek_v3": "DeepSeek-V3's", "deepseek_v2": "DeepSeek-V2's", "dots1": "dots.llm1's",
                          "exaone_moe": "K-EXAONE's"}


def _parse_deepseek_moe(raw: dict, model_type: str, num_layers: int, path: Path) -> MoEConfig:
    """DeepSeek-V3's experts, and GLM-4.5's, dots.llm1's, K-EXAONE's and Solar Open's, routed alike (their configs
    defaulted: GLM4_MOE_DEFAULTS, ...), and DeepSeek-V2's (_deepseek_v2_routing): the first first_k_dense_replace layers
    dense, every later one sparse (GLM-4.7-Flash's and K-EXAONE's by mlp_layer_types; Solar Open's all sparse)."""
    for key, value in DEEPSEEK_VARIANTS.get(model_type, {}).items():
        if key in raw and raw[key] != value:
            raise UnsupportedModelError(f"{path}: {key} {raw[key]!r} is not supported "
                                        f"(only {DEEPSEEK_VARIANT_NAMES[model_type]} {value!r})")
    num_experts = _positive_int(raw, ("n_routed_experts", "num_local_experts", "num_experts"), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    v2 = model_type == "deepseek_v2"
    softmax = v2 or model_type == "mistral4"   # Mistral 4: softmax scores ranked in groups as V3's, no bias
    if v2 and _deepseek_v2_routing(raw, path) == "greedy":
        num_groups = topk_groups = 1   # transformers reads neither n_group nor topk_group then
    else:
        num_groups, topk_groups = _positive_int(raw, ("n_group",), path), _positive_int(raw, ("topk_group",), path)
    # V3 ranks a group by the sum of its best two scores, V2 by its best one
    group_score_experts = 1 if v2 else 2
    if num_experts % num_groups or num_experts // num_groups < group_score_experts:
        raise CheckpointError(f"{path}: n_group {num_groups} must split the {num_experts} routed experts into equal "
                              f"groups" + ("" if v2 else " of at least 2 (a group scores by its best two)"))
    if topk_groups > num_groups:
        raise CheckpointError(f"{path}: topk_group {topk_groups} exceeds n_group {num_groups}")
    usable = topk_groups * (num_experts // num_groups)
    if top_k > usable:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {usable} experts of the "
                              f"topk_group {topk_groups} groups a token may use")
    first_sparse = raw.get("first_k_dense_replace") or 0
    if model_type in ("glm4_moe_lite", "solar_open"):   # transformers reads mlp_layer_types, or all layers sparse
        first_sparse = 0
    if not isinstance(first_sparse, int) or first_sparse < 0:
        raise CheckpointError(f"{path}: first_k_dense_replace must be a non-negative integer, got {first_sparse!r}")
    shared_key = "num_shared_experts" if model_type == "exaone_moe" else "n_shared_experts"
    shared = raw.get(shared_key) or 0
    if not isinstance(shared, int) or shared < 0:
        raise CheckpointError(f"{path}: {shared_key} must be a non-negative integer, got {shared!r}")
    sparse = [i >= first_sparse for i in range(num_layers)]
    if model_type in ("glm4_moe_lite", "exaone_moe"):   # GLM-4.7-Flash's first layer dense unless they say otherwise
        sparse = _mlp_layer_types(raw, num_layers, path, 1 if model_type == "glm4_moe_lite" else first_sparse)
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("moe_intermediate_size",), path),
                     not v2 and bool(raw.get("norm_topk_prob", True)), sparse,
                     scoring="softmax" if softmax else "sigmoid", num_groups=num_groups, topk_groups=topk_groups,
                     routed_scaling_factor=_positive_float(raw, "routed_scaling_factor", 1.0 if softmax else 2.5,
                                                           path),
                     num_shared_experts=shared, grouped=True, group_score_experts=group_score_experts)


def _deepseek_v2_routing(raw: dict, path: Path) -> str:
    """DeepSeek-V2's topk_method (DEEPSEEK_V2_TOPK_METHODS), its fields checked as transformers reads them: its router
    scales the chosen softmax scores by routed_scaling_factor and never renormalizes them, and its MLPs (the dense
    ones and the shared experts) carry biases when mlp_bias is true."""
    method = raw.get("topk_method")
    if method not in DEEPSEEK_V2_TOPK_METHODS:
        raise UnsupportedModelError(f"{path}: topk_method {method!r} is not supported for deepseek_v2 (supported: "
                                    f"{', '.join(DEEPSEEK_V2_TOPK_METHODS)})")
    if _flag(raw, "norm_topk_prob", False, path):
        # DeepSeek's own code renormalizes instead of scaling; transformers ignores the key: the two disagree
        raise UnsupportedModelError(f"{path}: norm_topk_prob true is not supported for deepseek_v2 (DeepSeek-V2's "
                                    f"checkpoints say false: the chosen scores times routed_scaling_factor)")
    if _flag(raw, "mlp_bias", False, path):
        raise UnsupportedModelError(f"{path}: mlp_bias true is not supported for deepseek_v2 (its shared experts "
                                    f"would carry biases)")
    return method


def _parse_mla(raw: dict, model_type: str, num_heads: int, path: Path) -> MLAConfig:
    if raw.get("attention_bias"):
        raise UnsupportedModelError(f"{path}: attention_bias true is not supported for multi-head latent attention")
    num_kv_heads = raw.get("num_key_value_heads")
    if num_kv_heads is not None and num_kv_heads != num_heads:
        raise UnsupportedModelError(f"{path}: num_key_value_heads {num_kv_heads} differs from num_attention_heads "
                                    f"{num_heads}; multi-head latent attention decompresses one K/V per query head")
    q_lora_rank = raw.get("q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=None if q_lora_rank is None else _positive_int(raw, ("q_lora_rank",), path),
        kv_lora_rank=_positive_int(raw, ("kv_lora_rank",), path),
        qk_nope_head_dim=_positive_int(raw, ("qk_nope_head_dim",), path),
        qk_rope_head_dim=_positive_int(raw, ("qk_rope_head_dim",), path),
        v_head_dim=_positive_int(raw, ("v_head_dim",), path),
        # DeepSeek-V2 rotates its rotary dims as interleaved pairs always (transformers reads no key)
        rope_interleave=model_type == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise CheckpointError(f"{path}: qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    return mla


# model_type -> the defaults transformers gives the fields its configs may omit, under the keys config.json would give
MODEL_TYPE_DEFAULTS = {
    "gemma3_text": GEMMA3_TEXT_DEFAULTS, "gemma2": GEMMA2_DEFAULTS, "glm4_moe": GLM4_MOE_DEFAULTS,
    "deepseek_v2": DEEPSEEK_V2_DEFAULTS, "llama4_text": LLAMA4_TEXT_DEFAULTS, "cohere": COHERE_DEFAULTS,
    "cohere2": COHERE2_DEFAULTS, "seed_oss": SEED_OSS_DEFAULTS,
    "ernie4_5": {**ERNIE4_5_DEFAULTS, "head_dim": 128, "num_key_value_heads": 2},
    "ernie4_5_moe": ERNIE4_5_MOE_DEFAULTS, "glm4": GLM4_DEFAULTS, "glm4_moe_lite": GLM4_MOE_LITE_DEFAULTS,
    **dict.fromkeys(HUNYUAN_MODEL_TYPES, HUNYUAN_DEFAULTS), "exaone4": EXAONE4_DEFAULTS,
    "qwen2_moe": QWEN2_MOE_DEFAULTS, "olmoe": OLMOE_DEFAULTS, "flex_olmo": FLEX_OLMO_DEFAULTS,
    "nanochat": NANOCHAT_DEFAULTS, "cwm": CWM_DEFAULTS, "starcoder2": STARCODER2_DEFAULTS,
    **dict.fromkeys(("granitemoe", "granitemoeshared"), GRANITEMOE_DEFAULTS), "dots1": DOTS1_DEFAULTS,
    "exaone_moe": EXAONE_MOE_DEFAULTS, "solar_open": SOLAR_OPEN_DEFAULTS, "youtu": YOUTU_DEFAULTS,
    "arcee": ARCEE_DEFAULTS, "nemotron": NEMOTRON_DEFAULTS, "apertus": APERTUS_DEFAULTS, "afmoe": AFMOE_DEFAULTS}
# model_type -> (raw, path) -> raw with the defaults whose values depend on the config's other fields
DEFAULTED_MODEL_TYPES = {
    "gpt_oss": lambda raw, path: _gpt_oss_defaulted(raw), "ministral3": lambda raw, path: _ministral3_defaulted(raw),
    "mistral4": _mistral4_defaulted, "minimax_m2": _minimax_m2_defaulted, "cwm": lambda raw, path: _cwm_defaulted(raw),
    "dots1": lambda raw, path: _dots1_defaulted(raw), "solar_open": lambda raw, path: _solar_open_defaulted(raw),
    "apertus": _apertus_defaulted, "afmoe": _afmoe_checked}


def parse_config(raw: dict, path: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in IMAGE_TEXT_MODEL_TYPES:
        archs = raw.get("architectures")
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} (architectures {archs}) is not supported; "
            f"supported: {', '.join(sorted([*SUPPORTED_MODEL_TYPES, *IMAGE_TEXT_MODEL_TYPES]))}"
        )
    quantization = raw.get("quantization_config")
    if quantization is not None and not _gpt_oss_mxfp4(raw, path):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(f"{path}: quantized checkpoints are not supported (quantization_config names "
                                    f"{method!r}); use the model's float32, float16 or bfloat16 weights")
    if model_type in IMAGE_TEXT_MODEL_TYPES:
        return _parse_text_model(raw, path)
    raw = {**MODEL_TYPE_DEFAULTS.get(model_type, {}), **raw}
    if model_type in DEFAULTED_MODEL_TYPES:
        raw = DEFAULTED_MODEL_TYPES[model_type](raw, path)
    hidden = _positive_int(raw, ("hidden_size",), path)
    num_heads = _positive_int(raw, ("num_attention_heads",), path)
    num_layers = _positive_int(raw, ("num_hidden_layers",), path)
    num_kv_heads = _optional_int(raw, "num_key_value_heads", num_heads, path)
    head_dim = _optional_int(raw, "head_dim", GEMMA3_DEFAULTS["head_dim"] if model_type == "gemma3_text"
                             else hidden // num_heads, path)
    if head_dim < 1:
        raise CheckpointError(f"{path}: num_attention_heads {num_heads} exceeds hidden_size {hidden} and no head_dim "
                              f"is given")
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    if (model_type not in (*GEMMA_MODEL_TYPES, "starcoder2", *UNGATED_ACTIVATIONS)
            and raw.get("hidden_act", "silu") != "silu"):
        raise UnsupportedModelError(f"{path}: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    mla, rope_types = None, ROPE_TYPES
    attention_bias = SUPPORTED_MODEL_TYPES[model_type]
    if attention_bias in ("config", "config_qkv") and not _flag(raw, "attention_bias", False, path):
        attention_bias = "none"
    if attention_bias == "use_bias":
        attention_bias = "config" if _flag(raw, "use_bias", False, path) else "none"
    if attention_bias == "qkv_bias":
        attention_bias = "qkv" if _flag(raw, "qkv_bias", True, path) else "none"
    rotary_dim, gemma = None, model_type in GEMMA_MODEL_TYPES
    if model_type in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral4", "youtu"):
        mla = _parse_mla(raw, model_type, num_heads, path)
        rope_types = MISTRAL4_ROPE_TYPES if model_type == "mistral4" else MLA_ROPE_TYPES
        num_kv_heads, head_dim = 1, mla.kv_lora_rank + mla.qk_rope_head_dim   # the latent cache's geometry
    if model_type == "phi3":
        rope_types, rotary_dim = PHI3_ROPE_TYPES, _rotary_dim(raw, head_dim, path)
    if model_type in ("glm4_moe", "glm4"):
        rotary_dim = _rotary_dim(raw, head_dim, path, GLM4_MOE_PARTIAL_ROTARY)
    if model_type == "minimax_m2":
        rotary_dim = _rotary_dim(raw, head_dim, path, _minimax_m2_rotary_factor(raw, head_dim, path))
    if model_type == "nemotron":
        rotary_dim = _rotary_dim(raw, head_dim, path, NEMOTRON_PARTIAL_ROTARY)
    fields = dict(
        model_type=model_type,
        vocab_size=_positive_int(raw, ("vocab_size",), path),
        hidden_size=hidden,
        intermediate_size=_positive_int(raw, ("intermediate_size",), path),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_optional_int(raw, "max_position_embeddings",
                                              GEMMA3_DEFAULTS["max_position_embeddings"] if gemma else 4096, path),
        rms_norm_eps=_positive_float(raw, "rms_norm_eps", DEFAULT_RMS_NORM_EPS.get(model_type, 1e-6), path),
        rope=_parse_rope(raw, path, rope_types, rotary_dim or head_dim),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", gemma, path),   # Gemma's default: tied
        qkv_bias=attention_bias != "none",
        o_bias=attention_bias == "config",
        qk_norm=model_type in QK_NORM_MODEL_TYPES or (model_type in USE_QK_NORM_MODEL_TYPES
                                                       and _flag(raw, "use_qk_norm", False, path)),
        mlp_bias=model_type in MLP_BIAS_MODEL_TYPES and _flag(raw, "mlp_bias", False, path),
        sliding_windows=_parse_sliding_windows(raw, model_type, num_layers, path),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=token_ids(raw.get("eos_token_id"), "eos_token_id", path),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        moe=_parse_moe(raw, model_type, num_layers, path),
        mla=mla,
        num_nextn_layers=_nextn_layers(raw, model_type, path),
        rotary_dim=rotary_dim,
        fused_projections=model_type == "phi3",
        **_granite_scalars(raw, path),
    )
    fields.update(_gemma_fields(raw, num_layers, hidden, path))
    fields.update(_gpt_oss_fields(raw, num_layers, path))
    fields.update(_smollm3_fields(raw, num_layers, path))
    fields.update(_olmo_fields(raw, num_layers, path))
    fields.update(_cohere_fields(raw, num_layers, path))
    fields.update(_llama4_fields(raw, num_layers, path))
    fields.update(_ministral3_fields(raw, fields["rope"], path))
    fields.update(_seed_oss_fields(raw, path))
    fields.update(_ernie4_5_fields(raw, path))
    fields.update(_glm4_fields(raw, path))
    fields.update(_minimax_m2_fields(raw, path))
    fields.update(_hunyuan_fields(raw, head_dim, fields["rope"], path))
    fields.update(_exaone4_fields(raw, num_layers, path))
    fields.update(_solar_open_fields(raw, head_dim, path))
    fields.update(_olmoe_fields(raw, hidden, num_heads, head_dim, path))
    fields.update(_cwm_fields(raw, num_layers, path))
    fields.update(_starcoder2_fields(raw, path))
    fields.update(_ungated_mlp_fields(raw, head_dim, path))
    fields.update(_nanochat_fields(raw, num_layers, path))
    fields.update(_afmoe_fields(raw, num_layers, hidden, path))
    return ModelConfig(**fields)


def _parse_text_model(raw: dict, path: Path) -> ModelConfig:
    """An image-and-text checkpoint's text model, read as transformers reads it: text_config (or, in the older Qwen
    VL configs, the top level) defaulted as its text model's configs are, and from the top level what transformers
    takes from there: whether the embeddings are tied, the token ids generation stops and starts at, the stored
    dtype."""
    image_type = raw["model_type"]
    text_types = IMAGE_TEXT_MODEL_TYPES[image_type]
    flat = image_type in FLAT_TEXT_CONFIG_TYPES and raw.get("text_config") is None
    text = {key: value for key, value in raw.items() if key != "vision_config"} if flat else \
        dict(_mapping(raw, "text_config", path))
    text_path = path if flat else Path(f"{path}: text_config")
    text_type = next(iter(text_types)) if flat else text.get("model_type", next(iter(text_types)))
    if text_type not in text_types:
        raise UnsupportedModelError(f"{path}: text_config's model_type {text_type!r} is not supported for model_type "
                                    f"{image_type!r} (only {' or '.join(repr(t) for t in text_types)})")
    text = {**IMAGE_TEXT_DEFAULTS.get(text_type, {}), **text, "model_type": text_types[text_type]}
    if text_type in RENORMALIZED_TOPK_TEXT_TYPES:
        text["norm_topk_prob"] = True
    for key in ("bos_token_id", "eos_token_id"):
        if raw.get(key) is not None:
            text[key] = raw[key]
    if raw.get("tie_word_embeddings") is not None:
        tied = _flag(raw, "tie_word_embeddings", False, path)
        text["tie_word_embeddings"] = tied or (image_type in TIED_BY_EITHER_TYPES
                                               and _flag(text, "tie_word_embeddings", False, text_path))
    text["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    if text_type in ("glm4v_text", "glm4v_moe_text"):
        _glm4v_text(text, text_type, text_path)
    if image_type in MROPE_MODEL_TYPES:
        _mrope_as_rope(text, text_path)
    cfg = parse_config(text, text_path)
    cfg.image_text_checkpoint = True
    return cfg


def _glm4v_text(text: dict, text_type: str, path: Path) -> None:
    """GLM-4.1V's text model read as a GLM-4 (glm4), GLM-4.5V's as a GLM-4.5 (glm4_moe), where transformers reads them
    otherwise: GLM-4.1V's heads are hidden_size // num_attention_heads dims and carry q/k/v biases whatever head_dim
    and attention_bias say, its rotary all of each head unless partial_rotary_factor says less; GLM-4.5V has no q/k
    norms. Both rotate interleaved pairs (GLM-4.1V) or halves (GLM-4.5V) of each head's first rotary dims by M-RoPE,
    whose sections must count those dims' frequencies (transformers cannot split them otherwise)."""
    hidden = _positive_int(text, ("hidden_size",), path)
    num_heads = _positive_int(text, ("num_attention_heads",), path)
    if text_type == "glm4v_text":
        head_dim = hidden // num_heads
        if text.get("head_dim") is not None and text["head_dim"] != head_dim:
            raise UnsupportedModelError(f"{path}: head_dim {text['head_dim']!r} is not supported for glm4v_text (its "
                                        f"attention's heads are hidden_size // num_attention_heads = {head_dim} dims)")
        text.update(head_dim=head_dim, attention_bias=True)
        if _rotary_dim(text, head_dim, path) is None:
            text["partial_rotary_factor"] = 1.0   # transformers' default here, where GLM-4's is a half
    else:
        text["use_qk_norm"] = False
        if text.get("num_local_experts") is not None and text.get("n_routed_experts") is None:
            text["n_routed_experts"] = text["num_local_experts"]   # transformers' other name
        head_dim = _optional_int(text, "head_dim", hidden // num_heads, path)
    rotary_dim = _rotary_dim(text, head_dim, path, GLM4_MOE_PARTIAL_ROTARY if text_type == "glm4v_moe_text" else None)
    num_frequencies = (rotary_dim or head_dim) // 2
    rope = {**_mapping(text, "rope_scaling", path), **_mapping(text, "rope_parameters", path)}
    section = rope.get("mrope_section", GLM4V_MROPE_SECTION)
    if isinstance(section, list) and sum(n for n in section if isinstance(n, int)) != num_frequencies:
        raise CheckpointError(f"{path}: mrope_section {section!r} must count the {num_frequencies} rotary "
                              f"frequencies of each head ({rotary_dim or head_dim} rotary dims)")


def _mrope_as_rope(text: dict, path: Path) -> None:
    """Qwen VL's M-RoPE, read as the 1D rope it computes for text. It rotates each rotary frequency by one of three
    position components (time, height, width; mrope_section counts the frequencies each one takes, in blocks or, with
    mrope_interleaved, in turn), which differ only for image and video tokens. A text token's three components are
    all its position, so a text-only sequence rotates exactly as with the 1D rope of the same frequencies: that rope
    is what the engine runs, its type 'mrope' transformers' name for the default frequencies."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(_mapping(text, key, path))
        if not rope:
            continue
        section = rope.pop("mrope_section", None)
        if section is not None and not (isinstance(section, list) and len(section) == 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)):
            raise CheckpointError(f"{path}: {key}: mrope_section must list the rotary frequencies of the time, height "
                                  f"and width components (3 counts), got {section!r}")
        _flag(rope, "mrope_interleaved", False, Path(f"{path}: {key}"))
        rope.pop("mrope_interleaved", None)
        for name in ("type", "rope_type"):
            if rope.get(name) == "mrope":
                rope[name] = "default"
        text[key] = rope


def _nextn_layers(raw: dict, model_type: str, path: Path) -> int:
    if model_type not in ("deepseek_v3", "glm4_moe", "glm4_moe_lite") or not raw.get("num_nextn_predict_layers"):
        return 0
    return _positive_int(raw, ("num_nextn_predict_layers",), path)


def read_json(path: Path, required: bool = True, kind: type = dict, what: str = "a JSON object"):
    """A checkpoint's JSON file as an object (or the `kind` of value `what` names); None when absent and not
    required."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise CheckpointError(f"{path}: expected {what}")
    return value


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; is this a Hugging Face checkpoint directory?")
    return parse_config(read_json(path), path)
