"""Hugging Face causal LMs of the families users train, as `model=custom`
targets: tiny configs, random weights from their own initialisation,
nothing downloaded.

    tpctl train model=custom model._target_=tests.hf_families.build model.family=gpt_neox

Each family is built as `transformers` writes it, with its own fused
projections, norms, embeddings and position schemes; tpctl must shard it from
the outside or refuse it with the reason (tests/test_families.py).
"""

from __future__ import annotations

# family -> (config class, its size keys). Every family has 4 query heads
# of 8 features; the key/value head counts are the family's own pattern.
FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", dict(num_attention_heads=4, intermediate_size=64, rotary_pct=0.5)),
    "bloom": ("BloomConfig", dict(n_head=4)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_head=4, n_inner=64, multi_query=True)),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", dict(n_head=4, n_inner=64, multi_query=False)),
    "falcon": ("FalconConfig", dict(num_attention_heads=4, multi_query=True, new_decoder_architecture=False)),
    "falcon_gqa": ("FalconConfig", dict(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)),
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)),
    "gemma": ("GemmaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64)),
    "opt": ("OPTConfig", dict(num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64)),
    # LayerNorms without weight or bias.
    "olmo": ("OlmoConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)),
    # One key/value head, fewer than any split: shared by the ranks whose query heads read it.
    "qwen2_kv1": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=64)),
    # One RMSNorm over all heads' q, another over all heads' k.
    "olmo2": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)),
    # Mixture of experts: a router, 4 experts (top 2) as 3-d weights, a gated shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2)),
    # transformers 5's MoE block of a router holding a raw (experts x hidden) weight beside an experts
    # module of 3-d gate_up_proj / down_proj parameters, no shared expert (Mixtral, OLMoE, Qwen3-MoE).
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
                                      num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=16,
                                  num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
    # A router holding, beside its (experts x hidden) weight, a module of score-correction statistics
    # (Ernie 4.5-MoE); a dense first layer, shared experts.
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                moe_intermediate_size=16, moe_num_experts=4, moe_k=2,
                                                moe_num_shared_experts=1, moe_layer_start_index=1)),
    # Latent attention (low-rank q and key/value projections with their norms, a rotary part shared by
    # every head) and a mixture of experts with a shared expert after one dense layer.
    "deepseek_v3": ("DeepseekV3Config", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                                             moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                             n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)),
    # Latent attention with DeepSeek's sparse-attention indexer (its own heads scoring keys; top-k
    # positions, under no_grad): every layer dense; 3 keys of the 8 positions a query attends.
    "deepseek_v32": ("DeepseekV32Config", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                                               first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24,
                                               qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=4,
                                               index_head_dim=8, index_topk=3, n_routed_experts=4,
                                               num_experts_per_tok=2, n_group=1, topk_group=1)),
    # Latent attention alone: every layer dense (1d + sequence parallelism refuses experts).
    "deepseek_v3_dense": ("DeepseekV3Config", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                                                   first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24,
                                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)),
    # Experts as (experts x inner, hidden) matrices in a module of the family's own, run by its forward.
    "dbrx": ("DbrxConfig", dict(n_heads=4, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))),
    # Learned per-head attention sinks, sliding-window layers beside global ones, experts stored
    # transposed with biases, gate and up interleaved.
    "gpt_oss": ("GptOssConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
    # A learned activation (xIELU: two scalars) in a non-gated MLP.
    "apertus": ("ApertusConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)),
    # RMSNorms without parameters (nor a stored width) on the stream and over each head of q and k,
    # after their rotation (NanoChat).
    "nanochat": ("NanoChatConfig", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64)),
    # ---- recurrent and hybrid token mixers: each runs whole (parallel/roles/whole.py) ----
    # Mamba-1 alone: an input projection to [x, z], a depthwise causal convolution, a selective
    # scan with its own dt/B/C projection and a dt rank; no attention at all.
    "mamba": ("MambaConfig", dict(state_size=4, expand=2, conv_kernel=4, time_step_rank=4, intermediate_size=64)),
    # Mamba-2 (one fused input projection to [z, x, B, C, dt], heads and groups, per-head A_log,
    # D, dt_bias, a gated norm) beside a mixture of experts with a shared expert.
    "nemotron_h": ("NemotronHConfig", dict(layers_block_type=["mamba", "moe"], num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                           mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                                           expand=2, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                           use_mamba_kernels=False, use_cache=False)),
    # Mamba-1 layers beside attention layers, experts every other layer.
    "jamba": ("JambaConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=4,
                                  mamba_dt_rank=4, use_mamba_kernels=False)),
    # A Mamba-2 mixer in parallel with attention in every block, scalar multipliers on both.
    "falcon_h1": ("FalconH1Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                                         mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4)),
    # The same with its gated RMSNorm over the mixer's whole inner width (one group), normalising before the
    # gate; and Bamba's mixer with one group (its norm gating before it, biases on in_proj and out_proj):
    # split by heads, B and C whole on every rank, the norm's moments summed (parallel/roles/mixers.py).
    "falcon_h1_norm": ("FalconH1Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                                              mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4,
                                              mamba_rms_norm=True, mamba_norm_before_gate=True)),
    "bamba_one_group": ("BambaConfig", dict(attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
                                            mamba_d_state=8, mamba_expand=2, mamba_chunk_size=4,
                                            mamba_proj_bias=True)),
    # Mamba-2 layers (two groups of heads, biases on in_proj and out_proj) beside attention:
    # split by heads in 1d (parallel/roles/mixers.py).
    "bamba": ("BambaConfig", dict(attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                                  mamba_d_state=8, mamba_expand=2, mamba_chunk_size=4, mamba_proj_bias=True)),
    # Gated delta-rule linear attention (per-head short convolutions, beta and decay gates, a gated
    # output norm) beside gated softmax attention, experts with a gated shared expert.
    "qwen3_next": ("Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                           linear_num_value_heads=4, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=16, num_experts=4,
                                           num_experts_per_tok=2)),
    # Qwen3.5: Qwen3-Next's gated delta rule with [q|k|v], z, b and a each its own Linear, a dense MLP.
    "qwen3_5": ("Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                          linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                          linear_num_value_heads=4)),
    # Lightning attention (linear, per-head decay) beside softmax attention, experts.
    "minimax": ("MiniMaxConfig", dict(layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
                                      num_experts_per_tok=2, block_size=4)),
    # Chunked attention, layers without rotary positions (NoPE), L2-normalised q/k, and a mixture of
    # experts whose experts module is fed every row scaled by its routing score (no routing indices,
    # E rows per row): split by each expert's inner features as measured, like any own-forward experts.
    "llama4": ("Llama4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                                        intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=1, no_rope_layer_interval=2,
                                        attention_chunk_size=4, use_qk_norm=True)),
    # The same with experts of an odd inner width, which no split measures: the MoE block runs
    # whole, its output the rows flattened ([rows * seq, hidden]).
    "llama4_odd": ("Llama4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            intermediate_size=15, intermediate_size_mlp=64, num_local_experts=4,
                                            num_experts_per_tok=1, interleave_moe_layer_step=1)),
    # A real-gated linear recurrence (per-channel gates, a learned decay) after a short
    # convolution, beside local attention.
    "recurrent_gemma": ("RecurrentGemmaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                     intermediate_size=64, lru_width=32, attention_window_size=4,
                                                     block_types=["recurrent", "attention"])),
}
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")


def config(family: str, vocab_size: int = 256, width: int = 32, depth: int = 2, max_len: int = 64):
    import transformers

    name, sizes = FAMILIES[family]
    cls = getattr(transformers, name)
    keys = set(cls().to_dict())
    kwargs = dict(sizes, vocab_size=vocab_size)
    for group, value in ((WIDTH_KEYS, width), (DEPTH_KEYS, depth), (POSITION_KEYS, max_len)):
        key = next((k for k in group if k in keys), None)
        if key is not None:  # BLOOM has no position table (alibi)
            kwargs[key] = value
    defaults = cls()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a default id outside a byte vocabulary
        if isinstance(getattr(defaults, key, None), int) and getattr(defaults, key) >= vocab_size:
            kwargs[key] = None
    for key in ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout"):
        if key in keys:
            kwargs[key] = 0.0
    return cls(**kwargs)


def build(family: str, vocab_size: int = 256, width: int = 32, depth: int = 2, max_len: int = 64):
    from transformers import AutoModelForCausalLM

    if family in COMPOSED:
        return COMPOSED[family](vocab_size, width, depth, max_len)
    return AutoModelForCausalLM.from_config(config(family, vocab_size, width, depth, max_len))


def oss_experts(vocab_size: int, width: int, depth: int, max_len: int):
    """Qwen3 whose MLPs are GPT-OSS's mixture of experts:
    a router with a bias, experts as 3-d parameters stored transposed with
    biases, gate and up interleaved feature by feature, a clamped gated
    activation -- the experts' mechanism without GPT-OSS's attention sinks."""
    import torch
    import torch.nn as nn
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    model = build("qwen3", vocab_size, width, depth, max_len)
    cfg = transformers.GptOssConfig(hidden_size=width, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = GptOssMLP(cfg)

        def forward(self, x):
            return self.inner(x)[0]  # (GptOssMLP also returns its routing scores)

    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = Moe()
        for p in layer.mlp.parameters():  # (transformers leaves them uninitialised outside a GptOss model)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def bert_head(vocab_size: int, width: int, depth: int, max_len: int):
    """Qwen3 whose LM head is BERT's (BertLMPredictionHead: a dense, GELU,
    LayerNorm transform, then the decoder), its `bias` tied to the
    decoder's as transformers' tied-weights keys tie them: the head's
    mechanism on a stack sequence parallelism splits (BERT's own MLP,
    halves in two modules, it refuses)."""
    import torch
    import torch.nn as nn
    import transformers
    from transformers.models.bert.modeling_bert import BertLMPredictionHead

    model = build("qwen3", vocab_size, width, depth, max_len)
    head = BertLMPredictionHead(transformers.BertConfig(vocab_size=vocab_size, hidden_size=width))
    head.decoder.bias = head.bias
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # (its own initialisation belongs to a BERT model: a bias of zeros, ...)
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        head.transform.LayerNorm.weight.add_(1.0)
    model.lm_head = head
    assert isinstance(model.lm_head.transform.dense, nn.Linear)
    return model


# Families composed of transformers' classes (a mechanism beside a family it does not come with).
COMPOSED = {"oss_experts": oss_experts, "bert_head": bert_head}

# Gated delta-rule linear attention with separate projections (issue 46): Kimi Linear's (q, k and v
# each its own Linear and short convolution, per-channel decay from a low-rank forget gate, a low-rank
# output gate; 4 heads of 8) beside its latent attention, and OLMo Hybrid's (q, k, v, a, b, g Linears;
# 4 value heads of 2 key heads) beside attention with q/k norms; dense MLPs.
FAMILIES["kimi_linear"] = ("KimiLinearConfig", dict(
    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"], num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=64, linear_num_heads=4, linear_head_dim=8, kv_lora_rank=16,
    q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8))
FAMILIES["olmo_hybrid"] = ("OlmoHybridConfig", dict(
    layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8))
# A dynamic attention mask (issue 46): Doge's dt_proj makes one rate per value head from all value heads,
# scaled by a per-head A (split by heads: tensor/head_reduce.py); per-feature residual rates on the blocks.
FAMILIES["doge"] = ("DogeConfig", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64))
# An LM head with a learned per-token logit scale (Dory's logit_scale: held as the vocabulary is,
# tensor/output_params.py), nGPT-style attention with per-feature query and gate scales.
FAMILIES["dory"] = ("DoryConfig", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                       intermediate_size=64))
# Mamba-1 with weightless RMSNorms over dt, B and C (buffers): split by inner channels like Mamba's.
FAMILIES["falcon_mamba"] = ("FalconMambaConfig", dict(state_size=4, expand=2, conv_kernel=4, time_step_rank=4,
                                                       intermediate_size=64))
# BERT-style LM heads (transformers' causal-LM BERT and RoBERTa): a transform (dense hidden -> hidden,
# GELU, LayerNorm) after the stack, run whole (roles/whole.py), then a decoder Linear whose bias the head
# also registers as its own `bias`: the same tensor where tied (BERT's default), a parameter the forward
# never reads where transformers leaves it untied (tie_word_embeddings=False, as RoBERTa's here).
FAMILIES["bert"] = ("BertConfig", dict(num_attention_heads=4, intermediate_size=64, is_decoder=True))
FAMILIES["roberta"] = ("RobertaConfig", dict(num_attention_heads=4, intermediate_size=64, is_decoder=True,
                                             tie_word_embeddings=False))
# RoFormer: BERT's head, its self-attention's head counts stored below the attention module that holds
# its output projection too, and a frozen sinusoidal rotary table one head wide (no role: whole on every rank).
FAMILIES["roformer"] = ("RoFormerConfig", dict(num_attention_heads=4, intermediate_size=64, is_decoder=True))
