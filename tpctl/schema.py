"""Typed configuration schema.

These dataclasses are registered in Hydra's ConfigStore (see ``tpctl.config``) so
that a misspelt key or a value of the wrong type is an error at composition
time, before any worker starts. The YAML files under ``configs/`` fill them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MODES = ("none", "1d", "2d", "2.5d", "3d")


@dataclass
class ModelConfig:
    # "gpt" (nanoGPT-style decoder) or "mlp" (token MLP with an untied head).
    arch: str = "gpt"
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64  # maximum sequence length (position table size)
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True


@dataclass
class DataConfig:
    # "synthetic" (seeded random tokens) or "text" (byte-level corpus / .bin).
    name: str = "text"
    # None: the default corpus (Python standard library sources). Otherwise a
    # UTF-8 text file or a pre-tokenised nanoGPT .bin (uint16).
    path: Optional[str] = None
    # Where tokenised corpora are cached; None: ~/.cache/tpctl.
    cache_dir: Optional[str] = None
    # Byte-level tokens are < 256; a .bin file may hold GPT-2 ids (< 50257).
    vocab_size: int = 256
    val_fraction: float = 0.1
    # Size of the default corpus and of the synthetic token stream.
    max_bytes: int = 4_000_000
    synthetic_tokens: int = 1_000_000


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TrainLoopConfig:
    steps: int = 200
    batch_size: int = 16  # global sequences per optimizer step
    seq_len: int = 64
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic eval
    eval_batches: int = 4
    label_smoothing: float = 0.0
    progress: bool = True  # rich progress bar on rank 0
    # Recompute each block's forward in the backward instead of keeping its
    # activations (torch.utils.checkpoint, non-reentrant).
    activation_checkpointing: bool = False


@dataclass
class LauncherConfig:
    # Seconds a collective may wait before the run fails (a hung rank).
    collective_timeout_s: int = 300
    # Rendezvous host for single-node runs.
    master_addr: str = "127.0.0.1"
    # 0 picks a free port.
    master_port: int = 0
    # Seconds between the launcher's health checks of the workers.
    monitor_interval_s: float = 0.1


@dataclass
class TrainConfig:
    mode: str = "none"
    size: int = 1  # tensor-parallel ranks
    depth: int = 1  # 2.5d depth
    dp: int = 1  # data-parallel replicas; world = size * dp
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl)
    seq_parallel: bool = False  # 1d only
    # "fp32" or "bf16" (autocast; fp32 master weights and optimizer state).
    precision: str = "fp32"
    # "jsonl" (metrics.jsonl only) or "tensorboard" (also TensorBoard events).
    logger: str = "jsonl"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
