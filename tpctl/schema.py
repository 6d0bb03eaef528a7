"""Typed configuration schema.

These dataclasses are registered in Hydra's ConfigStore (see ``tpctl.config``) so
that a misspelt key or a value of the wrong type is an error at composition
time, before any worker starts. The YAML files under ``configs/`` fill them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# Model architectures: tpctl's own, any importable builder, and (every
# other name) a Hugging Face model_type that transformers builds as a causal
# LM (models/hf.py checks it against transformers' own list).
BUILTIN_ARCHS = ("gpt", "mlp")
ARCHS = (*BUILTIN_ARCHS, "custom")


def is_hf_arch(arch: str) -> bool:
    """A Hugging Face family: any model.arch that is not tpctl's own or custom."""
    return arch not in ARCHS


@dataclass
class ModelConfig:
    """Keys of the built-in and Hugging Face models (a custom model's config,
    arch=custom, is free-form: its keys are its builder's arguments)."""

    # Built in: "gpt" (nanoGPT-style decoder), "mlp" (token MLP with an untied
    # head). Hugging Face (model=hf): any causal LM model_type ("gpt2",
    # "llama", "qwen2", "gpt_neox", ...).
    arch: str = "gpt"
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64  # maximum sequence length (position table size)
    mlp_ratio: int = 4
    dropout: float = 0.0
    # Hugging Face: null keeps the family's biases; true/false sets every
    # bias setting it has (attention_bias, mlp_bias, ...).
    bias: Optional[bool] = True
    tie_embeddings: bool = True
    # Key/value heads (grouped-query attention; null: n_head) and the MLP's
    # hidden size (null: mlp_ratio * n_embd) of a Hugging Face family.
    n_kv_head: Optional[int] = None
    intermediate_size: Optional[int] = None
    # Hugging Face: a local save_pretrained directory (config.json and
    # safetensors); its config replaces the size keys above.
    pretrained: Optional[str] = None
    # Hugging Face: the family's own config settings, passed through after
    # the size keys (+model.config.rope_theta=1e6).
    config: Dict[str, Any] = field(default_factory=dict)
    # Module-name patterns -> roles; null: the model's tp_plan, else traced.
    plan: Optional[Dict[str, str]] = None


@dataclass
class DataConfig:
    # "synthetic" (seeded random tokens) or "text" (byte-level corpus / .bin).
    name: str = "text"
    # None: the default corpus (Python standard library sources). Otherwise a
    # UTF-8 text file, a pre-tokenised nanoGPT .bin (uint16), or a directory
    # written by `tpctl prepare-data` (uint16/uint32 shards + index.json).
    path: Optional[str] = None
    # Where tokenised corpora are cached; None: ~/.cache/tpctl.
    cache_dir: Optional[str] = None
    # Byte-level tokens are < 256; a .bin file may hold GPT-2 ids (< 50257).
    vocab_size: int = 256
    # A local Hugging Face tokenizer directory for text data; null: bytes.
    tokenizer: Optional[str] = None
    val_fraction: float = 0.1
    # Size of the default corpus and of the synthetic token stream.
    max_bytes: int = 4_000_000
    synthetic_tokens: int = 1_000_000
    # "epoch": every window of a split once per epoch, in an order seeded by
    # (seed, epoch); "random": windows at random offsets (data/order.py).
    order: str = "epoch"
    # Several corpora with weights: a list of {path: P, weight: W} or "P:W"
    # (data/mix.py); null: the one corpus of `path`.
    mix: Any = None
    # true: a prepared corpus's documents kept apart (no attention across
    # a boundary, positions restarting per document; data/documents.py).
    documents: bool = False


FUSED_SETTINGS = ("auto", "true", "false")  # optim.fused (training/step.py fused_update)


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
    fused: str = "auto"  # AdamW's one-kernel update: auto = on a GPU


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
    # null: start fresh; auto: the newest valid checkpoint of the run dir
    # (none: start fresh); or the path of a checkpoint (step_<N> dir).
    resume: Optional[str] = None
    # Recompute each block's forward in the backward instead of keeping its
    # activations (torch.utils.checkpoint, non-reentrant).
    activation_checkpointing: bool = False
    # The memory each rank may use, GiB (null: the device's; on CPU this
    # machine's RAM split by its ranks): `tpctl train` refuses a
    # run whose predicted peak per rank is above it (cost/memory_check.py).
    memory_limit_gib: Optional[float] = None
    # A step whose loss or gradient norm is NaN or infinite: "stop" (the run
    # fails naming the step; its weights and checkpoints are kept) or "skip"
    # (no update for that step; a warning, and null in metrics.jsonl).
    on_nonfinite: str = "stop"
    # torch.compile the model's forward: false | true | auto (compile where
    # the compiler works, else run eager and say so).
    compile: Any = False
    # precision=fp32 on a GPU: matmuls and convolutions in TensorFloat32
    # (10-bit mantissa inputs, fp32 accumulation), faster and not exact.
    # false keeps fp32 exact; a CPU ignores it.
    tf32: Any = False
    # Collectives issued asynchronously beside the compute that does not
    # depend on them (1d's input-gradient all-reduce during the weight
    # gradient's product, 2d's next broadcasts, ...); false waits for each at
    # once. Either way the same bits (docs/DESIGN.md, "Overlap").
    overlap: bool = True
    # Before step 1, check the rewritten model against the original, module
    # by module and block by block (parallel/verify/proof.py): refuse to train if
    # they differ beyond fp32 round-off.
    verify_rewrite: bool = True
    # Every N steps (0: never) all ranks decode a short greedy sample of
    # sample_prompt (sample_tokens new tokens, the run's tokenizer); rank 0
    # writes it into the log and as `sample` on that step's metrics record.
    sample_every: int = 0
    sample_prompt: str = "\n"
    sample_tokens: int = 32


@dataclass
class LauncherConfig:
    # Seconds a collective may wait before the run fails (a hung rank).
    collective_timeout_s: int = 300
    # Process-group backend: auto (nccl for device=cuda, gloo for cpu),
    # nccl, or gloo (with device=cuda: ranks may share a GPU; for testing).
    backend: str = "auto"
    # Rendezvous host for single-node runs.
    master_addr: str = "127.0.0.1"
    # 0 picks a free port.
    master_port: int = 0
    # Seconds between the launcher's health checks of the workers.
    monitor_interval_s: float = 0.1
    # How workers start: forkserver (fork from one process that has imported
    # torch and tpctl once: seconds faster per rank), spawn (a fresh
    # interpreter each), or auto (forkserver on CPU, spawn on CUDA).
    start_method: str = "auto"
    # Restarts of all workers after one fails (torchrun's elastic agent);
    # they resume from the newest checkpoint of the run dir.
    max_restarts: int = 0
    # Multi-node: run `tpctl train` once per node with the same config and
    # launcher.nnodes=N launcher.node_rank=K launcher.rdzv_endpoint=HOST:PORT;
    # each node starts size*dp/nnodes workers and torchrun's c10d rendezvous
    # at HOST:PORT (hosted by node_rank 0) joins them into one job.
    nnodes: int = 1
    node_rank: int = 0
    # HOST:PORT of node 0, reachable from every node; None on one node
    # (master_addr:master_port, a free port).
    rdzv_endpoint: Optional[str] = None
    # One id per job, the same on every node; None: one derived from the
    # endpoint (multi-node) or a fresh one (single node).
    rdzv_id: Optional[str] = None
    # Seconds a node waits for the others to join before the run fails.
    rdzv_timeout_s: int = 600
    # "local": start the workers here (one node, or this machine's share of
    # several). "slurm": submit the job through submitit (tpctl/slurm.py);
    # each of its nnodes Slurm tasks then launches its node's share.
    name: str = "local"
    partition: Optional[str] = None
    gpus_per_node: int = 0
    cpus_per_task: Optional[int] = None
    time_min: int = 60
    account: Optional[str] = None
    qos: Optional[str] = None
    # Shell lines the sbatch script runs first (module load ..., source venv).
    setup: List[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    # Save every N steps under <run dir>/checkpoints/step_<N>/ (0: never
    # periodically), and after the last step when at_end.
    every: int = 100
    at_end: bool = True
    # Keep the newest N checkpoints (0: keep all).
    keep: int = 2


@dataclass
class RecipeConfig:
    """What a recipe (recipes/NAME.yaml, `tpctl train recipe=NAME`) must
    reach; `tpctl check-recipes` checks it. Empty for a plain run."""

    name: Optional[str] = None
    description: str = ""
    # [low, high]: the final training loss must land inside.
    final_loss: Optional[List[float]] = None
    # Another recipe whose loss curve this one must equal, step by step,
    # within rel_tol (e.g. gpt-tiny-3d equals gpt-tiny-none).
    equals: Optional[str] = None
    rel_tol: float = 1.0e-4
    # The short form that `tpctl check-recipes --fast` runs (CI): overrides
    # applied after the recipe, and the band the short run must reach.
    fast: List[str] = field(default_factory=list)
    fast_final_loss: Optional[List[float]] = None
    # [low, high] MiB: the measured peak resident memory of the largest rank
    # (summary.json's peak_rss_bytes_max_rank) must land inside, in both
    # forms (a step's peak does not grow with the steps). A memory budget a
    # layout must fit under, or (low) one a layout must not, to show why
    # another is needed (recipes/gpt-tiny-long-*.yaml).
    peak_mib: Optional[List[float]] = None


# What a run with pp > 1 does without pipeline.schedule (the stages read it too).
DEFAULT_SCHEDULE = "1f1b"


@dataclass
class PipelineConfig:
    """How a run with pp > 1 pipelines its stages (parallel/pipeline/stages.py)."""

    # gpipe (every forward, then every backward), 1f1b (one forward, one
    # backward in the steady state: at most pp micro-batches in flight) or
    # interleaved (1f1b over virtual_stages chunks per rank: a smaller bubble).
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 2  # chunks per rank with schedule=interleaved
    # Micro-batches per step; null: the fewest that keep the planned bubble
    # at or below 25% (and divide the batch).
    microbatches: Optional[int] = None
    # Blocks per stage (per chunk with interleaved), first stage first;
    # null: balanced by parameters.
    split: Optional[List[int]] = None


@dataclass
class ContextConfig:
    """How attention runs across the cp ranks that split each sequence
    (parallel/context/split.py)."""

    # ring: key/value blocks passed around the cp ranks, each keeping its
    # queries (zigzag chunks balance the causal work); ulysses: an
    # all-to-all from the sequence split to a head split and back.
    impl: str = "ring"


@dataclass
class TrainConfig:
    # The layout (parallel/layout.py): the tensor-parallel mode (a name in
    # parallel/registry.py), its grid, and the replicas.
    mode: str = "none"
    # A module defined outside tpctl that registers the mode named by `mode`
    # (`mypkg.mymode`, on PYTHONPATH); the launcher and every worker import it.
    mode_module: Optional[str] = None
    size: int = 1  # tensor-parallel ranks
    depth: int = 1  # 2.5d depth
    dp: int = 1  # data-parallel replicas; world = size * pp * dp
    pp: int = 1  # pipeline stages (cut at the model's repeated blocks)
    zero: int = 0  # ZeRO stage over the dp replicas: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters
    cp: int = 1  # context parallelism: ranks splitting each sequence; world = size * cp * pp * dp
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl)
    seq_parallel: bool = False  # 1d only
    # layout=auto (with world=N): `tpctl train` sets the layout keys above to
    # the fastest predicted choice that fits (tpctl/cost/auto.py) before any
    # worker starts, on the profile `hardware` (null: cpu), and records its
    # prediction in `auto` for the summary.
    layout: Optional[str] = None
    world: Optional[int] = None
    hardware: Optional[str] = None
    auto: Dict[str, Any] = field(default_factory=dict)
    # "fp32" or "bf16" (autocast; fp32 master weights and optimizer state).
    precision: str = "fp32"
    # Where metrics go besides metrics.jsonl (always written): "jsonl" (only
    # there), "tensorboard", "mlflow", "wandb", or a list of them
    # ([jsonl,mlflow,wandb]); untyped here so a list is accepted.
    logger: Any = "jsonl"
    # A ModelConfig, or for arch=custom any keys (see config.typed_model):
    # untyped here so that a custom model's arguments can be added.
    model: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
