"""Activation checkpointing (`train.activation_checkpointing=true`): each
block of the model's repeated stack keeps only its input during the forward
and recomputes its activations in the backward (torch.utils.checkpoint,
non-reentrant).

The blocks are found without knowing the model: the largest nn.ModuleList
whose children are all of one class (GPT's `blocks`, GPT-2's `h`, Llama's
`layers`). Each block's `forward` is wrapped on the instance, so module and
parameter names do not change (checkpoints, plans and ShardSpecs still match).

Dropout: torch.utils.checkpoint restores the global and CUDA RNG states
before recomputing, but tpctl's ParallelDropout draws from explicit
generators (the mesh's rng_shared / rng_local). Their states are recorded
when a block's forward starts and replayed for its recomputation, then put
back where the rest of training left them, so the recomputed forward draws
the same masks and the generators' sequence is the same as without
checkpointing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tpctl.parallel.roles.plan import repeated_blocks


def _generators(block: nn.Module) -> list[torch.Generator]:
    """The explicit generators the block's dropout layers draw from, once each."""
    from tpctl.parallel.dropout import ParallelDropout

    found: dict[int, torch.Generator] = {}
    for module in block.modules():
        if isinstance(module, ParallelDropout):
            found.setdefault(id(module.generator), module.generator)
    return list(found.values())


class _ReplayGenerators:
    """The two contexts checkpoint's `context_fn` asks for: the first
    records the generators' states as the block's forward starts; the
    second sets them back for the recomputation and, after it, restores the
    states the generators had reached. Both are objects, not generator
    functions, because torch recomputes a block once for every backward
    that unpacks its tensors (a model's own autograd function that asks
    for one gradient at a time starts one each; tpctl's layers write their
    products out and start none) and enters the same context each time:
    each entry replays the same masks."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators
        self.start_states: list[torch.Tensor] = []
        self.forward, self.recompute = _Record(self), _Replay(self)


class _Record:
    def __init__(self, replay: _ReplayGenerators):
        self.replay = replay

    def __enter__(self):
        self.replay.start_states = [g.get_state() for g in self.replay.generators]

    def __exit__(self, *exc) -> None:
        return None


class _Replay:
    def __init__(self, replay: _ReplayGenerators):
        self.replay, self.reached = replay, []

    def __enter__(self):
        self.reached = [g.get_state() for g in self.replay.generators]
        for g, state in zip(self.replay.generators, self.replay.start_states):
            g.set_state(state)

    def __exit__(self, *exc) -> None:
        for g, state in zip(self.replay.generators, self.reached):
            g.set_state(state)


def _checkpointed_forward(original, generators, *args, **kwargs):
    if not torch.is_grad_enabled():  # eval: nothing is saved anyway
        return original(*args, **kwargs)
    replay = _ReplayGenerators(generators)
    return checkpoint(original, *args, use_reentrant=False,
                      context_fn=lambda: (replay.forward, replay.recompute), **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint each block of the model's repeated stack (see
    `repeated_blocks`); returns how many blocks. Call it after
    the rewrite (Parallelism.rewrite), so the dropout layers found are the parallel ones."""
    blocks = repeated_blocks(model)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to checkpoint")
    for block in blocks.children():  # (a pipeline stage's stack iterates one chunk; children() are all its blocks)
        if getattr(block, "tpctl_checkpointed", False):
            continue
        # The class's forward, bound: wrapping the instance attribute leaves
        # the module's name, hooks and parameters as they were.
        original = block.forward
        block.forward = functools.partial(_checkpointed_forward, original, _generators(block))
        block.tpctl_checkpointed = True
    return len(list(blocks.children()))
