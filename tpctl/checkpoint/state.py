"""What each rank holds and writes of a run's state, as entries of named
global tensors: the state dict of a layout, which DCP saves and loads.

What a checkpoint holds (all tensors):
  model.<name>                 parameters (tied parameters once)
  optim.<name>.exp_avg|exp_avg_sq  AdamW moments, boxed like their parameter
  optim.<name>.step            AdamW's step count
  train.step, train.first_loss the loop position (the LR schedule and the
                               data are functions of the step)
  rng.shared.dp<d>, rng.local.rank<r>, rng.torch.rank<r>[, rng.cuda.rank<r>]
                               dropout and global generators

Why it reshards: every parameter carries a ShardSpec, the per-dim ranges of
the full tensor that this rank holds. The cartesian product of those ranges,
clipped at full_shape (past it lies zero padding, never saved), is a set of
boxes of the global tensor, each with its global offsets. Saving, each box is
one DCP chunk; loading, each local box asks DCP for its region. So nothing
here knows about modes: 2d size 4 loads into 3d size 8 or `none` alike.

The write rules live here together (`shard_boxes`, `_skipped`, the origin
and padding rules of `state_entries`): only one rank writes each box, the
first of its replicas (ShardSpec .replica_ranks[0], or for rows with
replicas of their own .row_replicas) in data-parallel replica 0; under ZeRO
each replica writes the chunk it owns (a sub-box of the shard), so every
byte is written once, by whichever replica holds it (DataParallel.held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tpctl.parallel.shard import ShardSpec


# --------------------------------------------------------------------------
# Boxes: a shard as regions of the global tensor
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]
    local: tuple[int, ...]  # where the box starts in this rank's shard


def shard_boxes(spec: Optional[ShardSpec], local_shape: tuple[int, ...]) -> list[Box]:
    """The boxes of the global tensor a shard holds (padding clipped away),
    as its record says (ShardSpec.boxes). No spec: the tensor is whole."""
    if spec is None:
        return [Box((0,) * len(local_shape), tuple(local_shape), (0,) * len(local_shape))]
    return [Box(*box) for box in spec.boxes(local_shape)]


@dataclass
class Entry:
    """One named global tensor as this rank sees it: its local storage, the
    boxes of the global tensor that storage holds, and whether this rank is
    the one that writes them."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    boxes: list[Box]
    write: bool
    # Boxes (positions in `boxes`) another replica writes: rows of a fused
    # projection that hold a key/value head several ranks share.
    skip: frozenset = frozenset()

    def written(self) -> list[Box]:
        return [b for i, b in enumerate(self.boxes) if i not in self.skip] if self.write else []

    def view(self, box: Box) -> torch.Tensor:
        out = self.tensor
        for dim, (start, size) in enumerate(zip(box.local, box.sizes)):
            out = out.narrow(dim, start, size)
        return out

    def box_at(self, offsets) -> Box:
        offsets = tuple(offsets)
        for box in self.boxes:
            if box.offsets == offsets:
                return box
        raise KeyError(offsets)


def whole(tensor: torch.Tensor, write: bool) -> Entry:
    return Entry(tensor, tuple(tensor.shape), shard_boxes(None, tuple(tensor.shape)), write)


# --------------------------------------------------------------------------
# What a training run's state is, as entries
# --------------------------------------------------------------------------


def _skipped(spec: Optional[ShardSpec], boxes: list[Box], rank: int) -> frozenset:
    """The boxes of a shard whose rows another holder writes (the record's
    answer, ShardSpec.writes, box by box)."""
    if spec is None:
        return frozenset()
    return frozenset(i for i, b in enumerate(boxes) if not spec.writes(rank, b.local[0]))

def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """AdamW's state of `p`, created as AdamW would create it (zeros, step 0)
    when the parameter has not been stepped yet, so it can be loaded into."""
    state = optimizer.state[p]
    if not state:
        from torch.optim.optimizer import _get_scalar_dtype

        # The fused (and capturable) kernels keep the step on the weight's
        # device in fp32; a CPU step there fails in the first step after loading.
        on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(is_fused=on_device),
                                     device=p.device if on_device else None)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _rng_keys(mesh) -> dict[str, Any]:
    """{key: generator or device name} of the generators this rank owns."""
    keys = {f"rng.local.rank{mesh.rank}": mesh.rng_local, f"rng.torch.rank{mesh.rank}": "cpu"}
    if mesh.device.type == "cuda":
        keys[f"rng.cuda.rank{mesh.rank}"] = "cuda"
    keys[f"rng.shared.dp{mesh.dp_rank}"] = mesh.rng_shared
    return keys


def _get_rng(gen) -> torch.Tensor:
    if gen == "cpu":
        return torch.get_rng_state()
    if gen == "cuda":
        return torch.cuda.get_rng_state()
    return gen.get_state()


def _set_rng(gen, state: torch.Tensor) -> None:
    if gen == "cpu":
        torch.set_rng_state(state)
    elif gen == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        gen.set_state(state)


def state_entries(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], par,
                  step: int, first_loss: float) -> dict[str, Entry]:
    """A run's state as entries: the model's parameters and AdamW's moments
    (boxes of the full tensors, as the data-parallel component says this
    rank holds and writes them), the step, and the generators."""
    mesh = par.mesh
    entries: dict[str, Entry] = {}
    for name, p, values, spec, write in par.dp.held(model):
        boxes = shard_boxes(spec, tuple(values.shape))
        full = tuple(spec.full_shape) if spec is not None else tuple(values.shape)
        skip = _skipped(spec, boxes, mesh.rank)
        entries[f"model.{name}"] = Entry(values, full, boxes, write, skip)
        if optimizer is None or not p.requires_grad:  # (a frozen parameter: AdamW holds no state of it)
            continue
        state = _adam_state(optimizer, p)
        held = spec.local_shape() if spec is not None else tuple(values.shape)
        for moment in ("exp_avg", "exp_avg_sq"):
            # (under ZeRO a chunk's padding rows, past what its record holds, are never saved)
            entries[f"optim.{name}.{moment}"] = Entry(state[moment][:held[0]] if values.dim() else state[moment],
                                                      full, boxes, write, skip)
        # One writer among the shards: the one writing the global origin.
        origin = write if spec is None else spec.writes_origin(mesh.rank)
        entries[f"optim.{name}.step"] = whole(state["step"].detach().reshape(1).double().cpu(), origin)
    is_first = mesh.rank == 0
    entries["train.step"] = whole(torch.tensor([step], dtype=torch.int64), is_first)
    entries["train.first_loss"] = whole(torch.tensor([first_loss], dtype=torch.float64), is_first)
    for key, gen in _rng_keys(mesh).items():
        # The shared generator is the same on every rank of a tp group.
        writes = mesh.tp_rank == 0 if key.startswith("rng.shared") else True
        entries[key] = whole(_get_rng(gen).clone(), writes)
    return entries

