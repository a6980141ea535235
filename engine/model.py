"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma 2, Gemma 3, SmolLM3, OLMo 2 and 3, Cohere,
GLM-4, Ministral 3, CWM, StarCoder2, Nemotron, Arcee, Apertus, Youtu-LLM, nanochat, and the MoE Mixtral, Qwen3-MoE,
Qwen2-MoE, OLMoE, FlexOlmo, Granite MoE, DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, dots.llm1, K-EXAONE, Solar Open, gpt-oss,
Llama 4, Mistral 4 and Trinity) over a flat batch of tokens and a paged KV cache.

Weights are plain tensors; q/k/v and gate/up projections are fused at load time (Phi-3's checkpoints
store them fused) so a dense layer is four matmuls. A mixture-of-experts layer replaces the MLP with
engine.moe's block; DeepSeek-V3's multi-head latent attention replaces the attention with engine.mla's,
whose cache holds one latent per token (GLM-4.7-Flash's too). Phi-3, GLM-4.5 and GLM-4 may rotate only each head's
first dims (partial rotary: the rope tables are that narrow; GLM-4's interleaved pairs made rotate-half by the
loader), and Phi-3 scales its rope by longrope (engine.config.RopeConfig says which factors). GLM-4 norms each
attention and MLP output too before its residual add, as Gemma 3 does but by the weights themselves. Granite (and
Granite MoE) scales the embeddings, the softmax, each block's output before its residual add and the logits by scalars
of its config. StarCoder2's LayerNorms add a bias, and its MLP activates one projection (no gate) by GELU-tanh;
Nemotron's and Arcee's by ReLU squared (Nemotron's LayerNorms, biased, scale by 1 + weight; its rotary is partial),
Apertus's by xIELU, whose parameters each layer learns (its q and k normed per head, as Qwen3's). Trinity multiplies
each attention output by the sigmoid of a gate projection of the layer's input (gate rows fused after q, k and v's)
before o_proj, and norms its four places as GLM-4 does.
Gemma 3 norms each attention and MLP output too before its residual add (four norms a layer, each scaling by
1 + weight: engine.ops.rms_norm's float32 weights),
scales the embeddings by sqrt(hidden_size), activates its MLP by GELU (tanh approximation), and alternates
sliding-window layers, which rotate by a rope of their own (local_rope), with full-attention ones. gpt-oss
adds a learned sink per head to each attention softmax (engine.ops.paged_attention's sinks) and alternates
sliding-window and full-attention layers; its experts are engine.moe's with biases. Gemma 2 computes as Gemma 3
does, with one rope for all layers and no q/k norms, and soft-caps its attention scores (engine.ops.paged_attention's
softcap) and its logits by tanh. SmolLM3's NoPE layers rotate nothing. OLMo 2 norms only each attention and MLP
output (the blocks take the residual stream unnormed) and norms q and k over their whole projections, all heads
together (under TP the ranks' sums of squares are all-reduced; OLMoE's q and k likewise, in Llama's layer; FlexOlmo is
OLMo 2's layer with OLMoE's experts); OLMo 3 adds Gemma 3's sliding layers with their own rope. nanochat's norms have
no weight (float32 ones), norm the embeddings too, and q and k after the rotary (Llama 4's), which turns the other way
(its sin tables negated); its ungated MLP squares a ReLU and its logits are capped as Gemma 2's. Llama 4 (its
interleaved rotary made rotate-half by the loader)
norms q and k without weight after the rotary and attends by chunks on its rotary layers (a negative window:
engine.ops.window_start), and scales the queries of
its NoPE layers by a temperature that grows with the position; Ministral 3 scales the queries of every layer by a
factor of its own that grows with the position, as Mistral 4 (DeepSeek-V3's latent attention) does. Cohere's models
(Command R, R+, R7B, A) run a parallel block: one LayerNorm (engine.ops.layer_norm: the row's mean subtracted) of
the residual stream feeds both the attention and the MLP, both outputs join the stream; their interleaved rotary is
made rotate-half by the loader, and Command R7B and A rotate only on their sliding-window layers. Every op goes
through engine.ops so kernels can replace them.

Under tensor/pipeline/expert parallelism (engine.parallel) one CausalLM is one rank's part: its
stage's layers and its share of the heads, MLP, experts and vocabulary (a RankShard). A TP rank's
o_proj and down produce partial sums, all-reduced across its stage; a mixture-of-experts layer
whose experts are split sends each token to their owners and gets the whole block's output back
(engine.expert_parallel); a stage other than the first continues from the residual stream the
previous stage returned. With one rank, none of that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import ops
from engine.config import ModelConfig, yarn_mscale
from engine.expert_parallel import ExpertGroup, moe_forward_parallel
from engine.mla import MLAWeights, mla_attention
from engine.moe import MoEWeights, moe_forward
from engine.parallel.groups import all_reduce
from engine.parallel.layout import RankShard, whole_model

# Rope positions a model's tables cover until CausalLM.serve_context sizes them to the context served
ROPE_POSITIONS_UNSERVED = 32768


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor | None   # None: OLMo 2 (config.input_norms), as is post_norm
    # [(H + 2 Hkv) * D, hidden] (Trinity's: H * D gate rows after v's); None under multi-head latent attention
    qkv: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    # Qwen3: RMSNorm over head_dim before rotary; OLMo 2: over H * D (whole q); Command R+: LayerNorm over head_dim,
    # weights [H, D] (a row per head)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor | None
    post_norm: torch.Tensor | None
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: torch.Tensor | None
    moe: MoEWeights | None = None   # under expert parallelism: this rank's experts only
    mla: MLAWeights | None = None   # DeepSeek-V3's attention, in place of qkv and o_proj
    # Biases some checkpoints carry (attention_bias: o_proj's; Llama's mlp_bias: gate/up's and down's).
    # Under TP gate_up_bias is this rank's rows; o_bias and down_bias are whole, added after the all-reduce.
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None   # [2 * intermediate]
    down_bias: torch.Tensor | None = None
    # Gemma 3's norms of the attention and MLP outputs, before each residual add (post_norm is then the
    # norm before the MLP: pre_feedforward_layernorm)
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    # gpt-oss's attention sinks: per query head (under TP this rank's), float32
    sinks: torch.Tensor | None = None
    # StarCoder2's LayerNorms' biases, beside input_norm's and post_norm's weights
    input_norm_bias: torch.Tensor | None = None
    post_norm_bias: torch.Tensor | None = None
    # Apertus's xIELU parameters, learned per layer: engine.ops.xielu's params, in the model's dtype
    act_params: torch.Tensor | None = None


@dataclass(slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor | None  # first stage only; under TP this rank's vocab rows
    layers: list[LayerWeights]         # this stage's; or engine.compression.streamed.StreamedLayers (compressed_in_memory)
    norm: torch.Tensor | None          # last stage only
    lm_head: torch.Tensor | None       # last stage only, this rank's vocab rows; the embedding itself when tied
    norm_bias: torch.Tensor | None = None   # StarCoder2's final LayerNorm's bias


class CausalLM:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 shard: RankShard | None = None, tp_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.shard = shard = shard or whole_model(config)
        self.tp_group = tp_group if shard.tp_size > 1 else None
        self.experts = None   # the ranks sharing this stage's experts (expert parallelism)
        if shard.ep_size > 1:
            self.experts = ExpertGroup(expert_group, shard.ep_rank, shard.ep_size, config.moe.num_experts)
        self.num_heads, self.num_kv_heads = len(shard.heads), len(shard.kv_heads)
        self.sliding_windows = config.sliding_windows[shard.layers.start:shard.layers.stop]
        self.scale = config.attention_multiplier or config.head_dim ** -0.5
        self.rotary_dim = config.rotary_dim or config.head_dim
        if config.mla is not None:
            self.rotary_dim, self.scale = config.mla.qk_rope_head_dim, mla_softmax_scale(config)
        self._build_rope(min(config.max_position_embeddings, ROPE_POSITIONS_UNSERVED), config.max_position_embeddings)
        # Llama 4's q/k norms without weight, per layer of this stage: a float32 weight of ones (rms_norm then
        # multiplies in float32 and rounds after, as transformers' norm rounds), or None
        unit = torch.ones(config.head_dim, device=device) if any(config.l2_qk_norm_layers) else None
        self.l2_qk_norms = [unit if config.l2_qk_norm_layers and config.l2_qk_norm_layers[i] else None
                            for i in shard.layers]
        # nanochat norms the embeddings (without a weight) before the first layer
        self.embedding_norm = torch.ones(config.hidden_size, device=device) if config.embedding_norm else None
        self.embedding_multiplier = config.embedding_multiplier
        if config.embedding_multiplier_in_dtype:
            self.embedding_multiplier = torch.tensor(config.embedding_multiplier, dtype=dtype).item()
        self.ops = ops.for_device(device)  # Triton kernels on CUDA, engine.ops elsewhere
        # the op's name, looked up in self.ops per call (StarCoder2's activates its ungated projection alone)
        self.act_and_mul = ops.ACT_AND_MUL[config.hidden_act] if config.gated_mlp else ops.ACT[config.hidden_act]
        # the norms' ops, by name likewise: Cohere's LayerNorms subtract the row's mean, the others' RMSNorms do not
        self.norm_op, self.add_norm_op = "rms_norm", "add_rms_norm"
        if config.layer_norms:
            self.norm_op, self.add_norm_op = "layer_norm", "add_layer_norm"

    def serve_context(self, max_model_len: int) -> None:
        """Rotate by the rope of an engine whose sequences hold at most max_model_len tokens, known only once the KV
        pool is sized, after the weights are loaded (and before graphs are captured from the tables): the tables
        cover those positions, not every position the checkpoint could reach (Llama 4 Scout's config says
        10,485,760: 10.7 GB of tables, taken from the KV pool), and longrope's factors depend on it
        (RopeConfig.uses_long_factor)."""
        self._build_rope(max_model_len, max_model_len)

    def _build_rope(self, num_positions: int, max_model_len: int) -> None:
        """The cos/sin tables of positions 0..num_positions-1 (longrope's factors chosen for max_model_len), and each
        of this stage's layers' (cos, sin) in rope_tables: Gemma 3's sliding-window layers rotate by local_rope,
        SmolLM3's and Llama 4's NoPE layers (None) by nothing."""
        config, layers = self.config, self.shard.layers
        self.cos_table, self.sin_table = ops.rope_cos_sin(self.rotary_dim, config.rope, num_positions, self.device,
                                                          max_model_len)
        if config.rope_reversed:   # nanochat: each pair turned by -angle (rotate-half's signs flipped)
            self.sin_table = -self.sin_table
        self.rope_tables = [(self.cos_table, self.sin_table)] * len(self.sliding_windows)
        if config.local_rope is not None:
            local = ops.rope_cos_sin(self.rotary_dim, config.local_rope, num_positions, self.device, max_model_len)
            self.rope_tables = [local if config.local_rope_layers[i] else self.rope_tables[0] for i in layers]
        if config.nope_layers:
            self.rope_tables = [None if config.nope_layers[i] else table for i, table in zip(layers, self.rope_tables)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ops.AttentionBatch,
                kv_cache: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_cache is [layers, kv_parts, blocks, block_size,
        Hkv, D] (this stage's layers and this rank's KV heads; kv_parts 2: keys and values, 1: latents).
        A pipeline stage after the first starts from `hidden`, the residual stream the stage before it
        returned; a stage before the last returns its own."""
        cfg = self.config
        if hidden is None:
            hidden = self._embed(input_ids)
            if self.embedding_norm is not None:
                hidden = self.ops.rms_norm(hidden, self.embedding_norm, cfg.rms_norm_eps)
        residual = None
        for index, layer in enumerate(self.weights.layers):
            normed, residual = self._add_norm(hidden, residual, layer.input_norm, layer.input_norm_bias)
            if layer.mla is not None:
                attn = mla_attention(layer.mla, cfg.mla, normed, positions, batch, kv_cache[index], self.cos_table,
                                     self.sin_table, self.scale, self.ops, self._position_scales(positions))
                if self.tp_group is not None:   # this rank's heads' part of o_proj
                    all_reduce(self.tp_group, attn)
            else:
                attn = self._attention(index, layer, normed, positions, batch, kv_cache[index])
            if cfg.residual_multiplier != 1:
                attn = attn * cfg.residual_multiplier
            if layer.attn_out_norm is not None:
                attn = self.ops.rms_norm(attn, layer.attn_out_norm, cfg.rms_norm_eps)
            if cfg.parallel_block:   # Cohere: the MLP takes the attention's input too, both outputs join the stream
                residual = residual + attn
            else:
                normed, residual = self._add_norm(attn, residual, layer.post_norm, layer.post_norm_bias)
            if layer.moe is None:
                hidden = self._mlp(layer, normed)
            elif self.experts is not None:
                hidden = moe_forward_parallel(layer.moe, normed, self.experts, self.ops)
            else:
                hidden = moe_forward(layer.moe, normed, self.ops)
            if cfg.residual_multiplier != 1:
                hidden = hidden * cfg.residual_multiplier
            if layer.mlp_out_norm is not None:
                hidden = self.ops.rms_norm(hidden, layer.mlp_out_norm, cfg.rms_norm_eps)
        if self.weights.norm is None:
            return residual + hidden  # what add_rms_norm's sum would be: the next stage's input
        normed, _ = self._add_norm(hidden, residual, self.weights.norm, self.weights.norm_bias)
        return normed

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding x (x itself at a stage's first layer) and its norm by weight (and bias:
        StarCoder2's LayerNorms), the next block's input; OLMo 2's blocks take the stream unnormed (weight None)."""
        eps = self.config.rms_norm_eps
        if bias is not None:
            residual = x if residual is None else residual + x
            return self.ops.biased_layer_norm(residual, weight, bias, eps), residual
        if residual is not None and weight is not None:
            return getattr(self.ops, self.add_norm_op)(x, residual, weight, eps)
        residual = x if residual is None else residual + x
        return (residual if weight is None else getattr(self.ops, self.norm_op)(residual, weight, eps)), residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        multiplier = self.embedding_multiplier
        if self.tp_group is None:
            hidden = self.weights.embed_tokens[input_ids]
            return hidden if multiplier == 1 else hidden * multiplier
        # vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is exact
        vocab = self.shard.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= len(vocab))
        hidden = self.weights.embed_tokens[local.clamp(0, len(vocab) - 1)].masked_fill_(outside[:, None], 0)
        all_reduce(self.tp_group, hidden)
        return hidden if multiplier == 1 else hidden * multiplier

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, layer.gate_up, layer.gate_up_bias)
        activate = getattr(self.ops, self.act_and_mul)
        activated = activate(gate_up) if layer.act_params is None else activate(gate_up, layer.act_params)
        return self._row_parallel_linear(activated, layer.down, layer.down_bias)

    def _row_parallel_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """o_proj's and down's x @ weight.T + bias. Alone the bias joins the product before its rounding, as
        transformers' F.linear adds it; under TP each rank's product is a part, so the whole bias is added once,
        after the all-reduce."""
        if self.tp_group is None:
            return self.ops.linear(x, weight, bias)
        out = self.ops.linear(x, weight)
        all_reduce(self.tp_group, out)
        return out if bias is None else out + bias

    def _attention(self, index: int, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor,
                   batch: ops.AttentionBatch, layer_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = self.ops.linear(x, layer.qkv, layer.qkv_bias)
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        q_size, kv_size = num_heads * cfg.head_dim, num_kv_heads * cfg.head_dim
        gate = None
        if cfg.attn_output_gate:
            q, k, v, gate = qkv.split([q_size, kv_size, kv_size, q_size], dim=-1)
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if cfg.qk_norm_over_heads:   # OLMo 2: each norm over its whole projection, before the heads are apart
            q, k = self._qk_norm_over_heads(q, k, layer)
        q = q.reshape(num_tokens, num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, num_kv_heads, cfg.head_dim)
        per_head_norms = layer.q_norm is not None and not cfg.qk_norm_over_heads
        if per_head_norms and not cfg.qk_norm_after_rope:   # Command R+'s: LayerNorms, a weight row per head
            q = getattr(self.ops, self.norm_op)(q, layer.q_norm, cfg.rms_norm_eps)
            k = getattr(self.ops, self.norm_op)(k, layer.k_norm, cfg.rms_norm_eps)
        if self.rope_tables[index] is not None:   # None: a NoPE layer (SmolLM3)
            q, k = self.ops.apply_rotary(q, k, positions, *self.rope_tables[index])
        if per_head_norms and cfg.qk_norm_after_rope:   # Hunyuan: over each rotated head
            q = getattr(self.ops, self.norm_op)(q, layer.q_norm, cfg.rms_norm_eps)
            k = getattr(self.ops, self.norm_op)(k, layer.k_norm, cfg.rms_norm_eps)
        if self.l2_qk_norms[index] is not None:   # Llama 4: after the rotary, over each head
            q = self.ops.rms_norm(q, self.l2_qk_norms[index], cfg.rms_norm_eps)
            k = self.ops.rms_norm(k, self.l2_qk_norms[index], cfg.rms_norm_eps)
        if cfg.attn_temperature is not None and self.rope_tables[index] is None:
            q = self._tuned_temperature(q, positions)
        if cfg.position_query_scale is not None:   # Ministral 3: on every layer
            q = q * self._position_scales(positions).to(q.dtype)[:, None, None]
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        self.ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = self.ops.paged_attention(q, k_cache, v_cache, batch, self.scale, self.sliding_windows[index], layer.sinks,
                                       cfg.attn_logit_softcapping)
        out = out.reshape(num_tokens, q_size)
        if gate is not None:   # Trinity: after either decode path's attention (the C loop's output too)
            out = out * torch.sigmoid(gate)
        return self._row_parallel_linear(out, layer.o_proj, layer.o_bias)

    def _tuned_temperature(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's attention temperature tuning on a NoPE layer: each query times 1 + attn_scale * log(1 +
        floor((position + 1) / floor_scale)), computed in float32 and rounded after, as transformers computes it."""
        floor_scale, attn_scale = self.config.attn_temperature
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales[:, None, None]).to(q.dtype)

    def _position_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's and Mistral 4's query scaling: each token's query times 1 + beta * log(1 + floor(position /
        original)), computed in float32 (rounded to q's dtype before it multiplies, as transformers computes it);
        None for other models."""
        if self.config.position_query_scale is None:
            return None
        original, beta = self.config.position_query_scale
        return 1.0 + beta * torch.log(1.0 + torch.floor(positions.float() / original))

    def _qk_norm_over_heads(self, q: torch.Tensor, k: torch.Tensor,
                            layer: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H * D] and k [T, Hkv * D] each RMS-normed over the whole projection (OLMo 2). A TP rank holds only
        its heads' columns: the ranks' sums of squares are all-reduced (q's and k's in one call) and each divided by
        all ranks' columns, so a KV head replicated on several ranks counts as often in the count as in the sum.
        The weight's dtype says where the rounding falls, as in ops.rms_norm: OLMo 2's float32 weight multiplies the
        float32 row, MiniMax-M2's (in the model's dtype) the row rounded, as transformers' norms compute them."""
        eps = self.config.rms_norm_eps
        if self.tp_group is None:
            return self.ops.rms_norm(q, layer.q_norm, eps), self.ops.rms_norm(k, layer.k_norm, eps)
        q32, k32 = q.float(), k.float()
        sums = torch.stack((q32.pow(2).sum(-1), k32.pow(2).sum(-1)), dim=-1)
        all_reduce(self.tp_group, sums)
        tp = self.shard.tp_size
        q_rstd = torch.rsqrt(sums[:, :1] / (tp * q.shape[-1]) + eps)
        k_rstd = torch.rsqrt(sums[:, 1:] / (tp * k.shape[-1]) + eps)
        if layer.q_norm.dtype != torch.float32:
            return layer.q_norm * (q32 * q_rstd).to(q.dtype), layer.k_norm * (k32 * k_rstd).to(k.dtype)
        return (q32 * q_rstd * layer.q_norm).to(q.dtype), (k32 * k_rstd * layer.k_norm).to(k.dtype)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head output in the model's dtype (under TP: this rank's vocab columns), divided by Granite's
        logits_scaling or multiplied by Cohere's logit_scale, or soft-capped as Gemma 2's are (cap * tanh(logits / cap),
        in the model's dtype as in transformers)."""
        logits = self.ops.linear(hidden, self.weights.lm_head)
        scaling, cap = self.config.logits_scaling, self.config.final_logit_softcapping
        if scaling != 1:
            logits = logits / scaling
        if self.config.logit_scale != 1:   # Cohere's multiplier
            logits = logits * self.config.logit_scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(hidden).float()


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim) squared when the rope is scaled."""
    scale = cfg.mla.qk_head_dim ** -0.5
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
    return scale
