"""What the training pass of hf_all_families.py sets for a family beyond
the size keys (issue 46), each for the reason beside it, and shown in the
family's row. Only what the size keys do not reach: a family setting sized
for the real model whatever the width (a linear attention's own heads, a
chunk the sequence is padded to, towers the causal LM's forward never
calls, hundreds of experts), which made a tiny model run past the time
limit, or a family rule the size keys' defaults break."""

from __future__ import annotations

SEQ = 8  # the training pass's sequence length (hf_all_families reads it here)

# A vision or audio tower at the size keys' sizes: width 32, 4 heads, 2 layers.
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}

# 2d runs every expert on every row a rank holds, dense (parallel/roles/
# experts.py: the ranks' collectives in lockstep over rows that route
# differently), at experts/top-k times the routed compute. Its collectives
# no longer grow with the experts (all experts in one product each for
# gate/up and down: a qwen3_next 2d-4 step issues 140 with 16 experts or
# 256), but its compute does: that step takes 1.3 s with 16, 3.1 s with 256
# (load 17 on 2 cores). At the families' own counts (2026-11-29, tpctl
# 4e356e9, two families at a time, load 5 to 14) the three runs took 92 s
# for dots3_note_text (256; its 2d run 53 s) and 93 s for qwen3_next (512;
# 2d 65 s), and mimo_v2_flash (256) ran past the family's 120 s in 2d; with
# 16 experts, 38 to 39 s each (2d 18 to 27 s). 16 experts keep the mechanism
# (a router, its top-k of them, shared experts) at a sixteenth or less of
# the experts' compute, inside the limit on a loaded machine.
EXPERTS = 16

FAMILY_KEYS: dict[str, dict] = {
    # Its sliding-window layers hold twice the key/value heads of its full
    # layers: with n_kv_head left at the 4 query heads they hold 8, and
    # 4 // 8 = 0 query heads per key/value head fails the forward ("The size
    # of tensor a (4) must match the size of tensor b (0)"). And 256 experts.
    "mimo_v2_flash": {"n_kv_head": 2, "config": {"n_routed_experts": EXPERTS}},
    # Hundreds of experts (EXPERTS): 256, 384, 256 and 512.
    "dots3_note_text": {"config": {"n_routed_experts": EXPERTS}},
    "kolibri1": {"config": {"num_experts": EXPERTS}},
    "qwen3_5_moe_text": {"config": {"num_experts": EXPERTS}},
    "qwen3_next": {"config": {"num_experts": EXPERTS}},
    # Its Mamba-2 mixer's torch path pads the sequence to a whole chunk (256
    # by default): 8 tokens padded to 256 cost 16 CPU-s a forward and
    # backward, 0.4 at a chunk of 8 (mode=none ran past 300 s).
    "falcon_h1": {"config": {"mamba_chunk_size": SEQ}},
    # Its delta-rule linear attention has heads of its own (32 of 128 wide,
    # whatever the width; n_head sets only the softmax attention's): 17
    # CPU-s a forward and backward at width 32 (mode=none over 120 s); the
    # size keys' 4 heads of 8 take 0.3. And 256 experts.
    "kimi_linear": {"config": {"linear_num_heads": 4, "linear_head_dim": 8, "num_local_experts": EXPERTS}},
    # A vision tower (27 layers, 1152 wide) and an audio encoder (24 blocks,
    # 1024 wide) that the causal LM's forward never calls: 870M parameters,
    # 34 s to build (at load 6 on 2 cores) on each rank of each run; at the size keys' sizes, 0.2M.
    "phi4_multimodal": {"config": {"vision_config": {**TOWER, "num_hidden_layers": 2},
                                   "audio_config": {**TOWER, "num_blocks": 2, "ext_pw_out_channel": 32,
                                                    "depthwise_separable_out_channel": 32,
                                                    "nemo_conv_channels": 32}}},
}


def model_keys(family: str) -> dict:
    """The family's settings as model config keys (a `config` dict: its own
    settings, `+model.config.*`)."""
    return FAMILY_KEYS.get(family, {})


def note(family: str) -> str:
    """The settings as override lines ("" for none): a sub-config by its
    name only."""
    keys = FAMILY_KEYS.get(family, {})
    lines = [f"model.{k}={v}" for k, v in keys.items() if k != "config"]
    lines += [f"+model.config.{k}={'{...}' if isinstance(v, dict) else v}" for k, v in keys.get("config", {}).items()]
    return f"set: {' '.join(lines)}" if lines else ""
