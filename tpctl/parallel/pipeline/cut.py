"""Cutting a model into this rank's pipeline stage (pp > 1), without knowing
the model (docs/DESIGN.md, "Pipeline parallelism"): `StageCut` acts on a
model by the record of where its pieces go (stage_map.py's `StageMap`,
read once per model); running the stages is schedule.py's.

  * The repeated blocks (`roles.repeated_blocks`, the stack activation
    checkpointing and the start-up check use) are cut into contiguous chunks
    (`stages.PipelineSpec.cut`, balanced by a weight per block: its
    training FLOPs with attention's scores, parameters breaking ties, unless
    told otherwise; what runs before and after the blocks weighed alike: an
    embedding costs nothing, the LM head and its loss about five GPT-2
    blocks). A rank keeps only its chunks'
    blocks, under their whole-model indices (`StageStack`), so every
    parameter keeps its name: checkpoints and exports reshard.
  * The modules beside the stack are placed by one traced forward: what runs
    before the first block (embeddings) goes to the first chunk, what runs
    after the last (final norm, LM head) to the last. Elsewhere each is a
    parameter-free `StandIn`. Modules without parameters (rotary tables,
    masks) run on every stage: what a model computes outside its stack is
    there for every stage.
  * Every stage runs the model's own forward, so positions, masks and rotary
    tables are computed as the model computes them: a stage that does not
    hold the embedding gets zeros shaped like the stream from its StandIn,
    its first block takes the stream the previous stage sent (a pre-hook),
    and after its last block the forward stops (`StageOutput`) unless it is
    the last stage, which goes on to the logits.
  * An embedding tied to the LM head (GPT-2) is held by the first and the
    last stage. Both copies are recorded on the weight's ShardSpec
    (`stage_ranks`, the `pp_ends` group): the gradient finalisation sums
    them (Parallelism.finish_grads), as Megatron does, so both apply the
    same update; the first stage's copy alone is counted by the gradient
    norm and written to checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.mesh import Mesh
from tpctl.parallel.pipeline.stage_map import (LOSS_FLOPS_PER_LOGIT, Chunk, PipelineRefused, StageMap, compute_weight,
                                               first_tensor, parameter_count, read, training_flops)
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.roles.plan import RolePlan
from tpctl.parallel.shard import spec_of

__all__ = ["StageCut", "StageOutput", "StageStack", "StandIn", "Chunk", "PipelineRefused", "StageMap",
           "compute_weight", "training_flops", "parameter_count", "LOSS_FLOPS_PER_LOGIT"]


class StageOutput(Exception):
    """Raised by the hook on a stage's last block: the stream to send on
    (the rest of the model's forward belongs to later stages)."""

    def __init__(self, stream: torch.Tensor):
        super().__init__("the end of a pipeline stage")
        self.stream = stream


@dataclass
class _Run:
    """What the chunk running now needs: the chunk, and the stream it got."""

    chunk: Optional[Chunk] = None
    received: Optional[torch.Tensor] = None

    def stand_in(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """A StandIn's output: its floating input as it is (a norm, a
        dropout), or for ids (an embedding, a position table) zeros shaped
        like the stream this chunk received: the model's own code after
        the embedding reads only its shape, dtype and device, and the first
        block of the chunk takes the received stream instead."""
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_floating_point():
            return first
        if self.received is None:
            raise RuntimeError("a pipeline stage's stand-in ran outside a stage's forward")
        return self.received.new_zeros(self.received.shape)


class StageStack(nn.ModuleList):
    """The repeated blocks a rank holds, registered under their indices in
    the whole model (`blocks.4` stays `blocks.4`); iterating, indexing and
    len() see the blocks of the chunk running now (the model's own loop
    `for block in self.blocks` runs exactly those). `children()` and the
    parameter walks see every block the rank holds."""

    tpctl_stage_stack = True

    def __init__(self, blocks: dict[int, nn.Module], kinds: Optional["StageKinds"] = None):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)
        object.__setattr__(self, "_kinds", kinds)  # (not a submodule, not state)
        self.show(list(blocks))

    def show(self, indices: list[int]) -> None:
        self.active = [self._modules[str(i)] for i in indices]
        if self._kinds is not None:
            self._kinds.show(indices)

    def __iter__(self):
        return iter(self.active)

    def __len__(self) -> int:
        return len(self.active)

    def __getitem__(self, idx):
        return self.active[idx]


class StageKinds:
    """A model whose forward picks each block's mask by the loop's position
    (Hugging Face's `config.layer_types[i]` in `for i, layer in
    enumerate(self.layers)`) sees, on a stage, its config's layer types in
    the order of the blocks running now: the stage's own copy of the config
    (every module of the stage that held the model's now holds it) lists
    them, so position i of the stage's loop reads its block's type."""

    def __init__(self, model: nn.Module, kinds: list):
        config = model.config
        own = copy.copy(config)
        # The list may be a key, a property derived from others, or another
        # key's alias (attribute_map): each reads the stage's list here.
        cls = type(config)
        names = {"layer_types", getattr(cls, "attribute_map", {}).get("layer_types", "layer_types")}
        read = property(lambda self: self.__dict__["_tpctl_layer_types"])
        own.__class__ = type(cls.__name__, (cls,), {**{n: read for n in names}, "attribute_map": {
            k: v for k, v in getattr(cls, "attribute_map", {}).items() if k not in names}})
        for module in model.modules():
            if getattr(module, "config", None) is config:
                module.__dict__["config"] = own
        self.config, self.kinds = own, list(kinds)

    def show(self, indices: list[int]) -> None:
        self.config.__dict__["_tpctl_layer_types"] = [self.kinds[i] for i in indices]

    @staticmethod
    def of(model: nn.Module) -> Optional[list]:
        """The model's layer types, if they differ between blocks."""
        kinds = getattr(getattr(model, "config", None), "layer_types", None)
        return list(kinds) if isinstance(kinds, (list, tuple)) and len(set(map(str, kinds))) > 1 else None


class StandIn(nn.Module):
    """A module beside the stack on a stage that does not run it: no
    parameters (but a tied one the stage holds elsewhere, registered under
    its own name so names stay those of the whole model; the others' names
    hold empty tensors of their dtype, on the stage's device)."""

    def __init__(self, name: str, run: _Run):
        super().__init__()
        self.tpctl_stand_in_for = name
        object.__setattr__(self, "_run", run)  # not a submodule, not state

    def forward(self, *args, **kwargs):
        return self._run.stand_in(args, kwargs)

    def extra_repr(self) -> str:
        return f"stand-in for {self.tpctl_stand_in_for} (another pipeline stage runs it)"


class StageCut:
    """Which chunks of the pp axis of `mesh` (with `spec`) this rank runs
    and what they hold. Built before the rewrite: `assign` reads the whole
    model once (a frozen `StageMap`), `cut` trims it to this rank's stage,
    `install` wires the rewritten stage. `weigh` gives each repeated block
    its weight in the balance of the stages (the default, compute_weight,
    also costs each block's attention at the spec's seq_len and the loss
    over the logits)."""

    def __init__(self, mesh: Mesh, spec: PipelineSpec, weigh: Callable[[nn.Module], float] = compute_weight):
        self.mesh, self.spec = mesh, spec
        self.size, self.rank = spec.stages, mesh.pp_rank
        self.weigh = weigh
        self.run = _Run()
        self.stage_map: Optional[StageMap] = None  # what assign read (or adopt took)
        self.chunks: list[Chunk] = []  # this rank's
        self.model: Optional[nn.Module] = None
        self.stack: Optional[StageStack] = None
        self._tied: list[tuple[str, str]] = []  # (stand-in's parameter, the holder's parameter) names

    @property
    def first(self) -> bool:
        return any(c.first for c in self.chunks)

    @property
    def last(self) -> bool:
        return any(c.last for c in self.chunks)

    @property
    def blocks_of(self) -> list[range]:
        """Every chunk's blocks (positions in the stack); [] before assign."""
        return list(self.stage_map.blocks_of) if self.stage_map is not None else []

    @property
    def weights(self) -> Optional[tuple]:
        """(per block, before, after): what the stages are balanced by (tests compare it with the plan's FLOPs)."""
        return self.stage_map.weights if self.stage_map is not None else None

    # ---- where everything goes ------------------------------------------------
    def assign(self, model: nn.Module) -> StageMap:
        """Read the whole model (on any device, meta included) once: its
        stack, what runs before and after it, and which blocks each chunk
        holds; returns that record. PipelineRefused (one line) for a model
        that cannot be cut."""
        if self.stage_map is not None:
            return self.stage_map
        return self.adopt(read(model, self.spec, self.weigh))

    def adopt(self, stage_map: StageMap) -> StageMap:
        """Take the record another cut read of the same model, at the same
        seq_len and with the same `weigh` (cost/dry_run.py keeps one per
        model): as it is when placed under this cut's spec, else its blocks
        placed again (no trace; PipelineRefused as assign). Returns it, as
        placed."""
        self.stage_map = stage_map.placed(self.spec)
        self.chunks = list(self.stage_map.chunks(self.rank))
        return self.stage_map

    def stage_of(self, name: str) -> Optional[int]:
        """The pipeline rank that holds module `name` of the whole model
        (None: every stage, or a name above the stack)."""
        return self.stage_map.stage_of(name)

    def holds(self, name: str) -> bool:
        """Whether this rank holds module `name` of the whole model."""
        stage = self.stage_of(name)
        return stage is None or stage == self.rank

    # ---- before the rewrite: keep this rank's stage --------------------------------
    def cut(self, model: nn.Module, plan: RolePlan) -> RolePlan:
        """Trim the whole (meta) model to this rank's stage, in place, and
        return the role plan of what is left."""
        found = self.assign(model)
        stack = model.get_submodule(found.stack_name)
        mine = {i: stack._modules[str(i)] for c in self.chunks for i in c.blocks}
        kinds = StageKinds.of(model)
        if kinds is not None and len(kinds) != len(stack):
            raise PipelineRefused(f"{type(model).__name__}'s config lists {len(kinds)} layer types for "
                                  f"{len(stack)} blocks: a stage cannot tell its blocks' types; use pp=1", "pp")
        self.stack = StageStack(mine, StageKinds(model, kinds) if kinds is not None else None)
        _set(model, found.stack_name, self.stack)
        # Parameters this rank keeps, beside the stack: the tied ones among
        # them are held by both end stages.
        held = {first for b in found.beside if self.holds(b.name) for _, first in b.params}
        self._tied = []
        for b in found.beside:
            if self.holds(b.name) or b.where == "every":
                continue
            stand_in = StandIn(b.name, self.run)
            original = model.get_submodule(b.name)
            for pn, first in b.params:
                if first in held:
                    holder = next(f"{o.name}.{on}" for o in found.beside if self.holds(o.name)
                                  for on, o_first in o.params if o_first == first)
                    self._tied.append((f"{b.name}.{pn}", holder))
                elif "." not in pn:  # (a model may read it for its device or dtype: Llama 4's embed_tokens.weight.device)
                    stand_in.register_buffer(pn, torch.empty(0, dtype=getattr(original, pn).dtype), persistent=False)
            _set(model, b.name, stand_in)
        # What is still in the cut model, and not a stand-in (every path, as get_submodule finds them).
        present = {n for n, m in model.named_modules(remove_duplicate=False) if not isinstance(m, StandIn)}
        # Every record of the plan keyed by module name, this stage's entries
        # of it: one the cut forgot (a proj_norm's source projection, a per-head
        # norm's rows) would leave the stage's modules of that kind unplaced.
        return dataclasses.replace(plan, **{f.name: {k: v for k, v in getattr(plan, f.name).items() if k in present}
                                            for f in dataclasses.fields(plan)
                                            if isinstance(getattr(plan, f.name), dict)})

    # ---- after the rewrite: wire the stage ----------------------------------------
    def install(self, model: nn.Module) -> None:
        """Hooks and stand-ins of the rewritten stage; tied parameters
        registered where the whole model has them."""
        self.model = model
        for stand_in_param, holder in self._tied:
            owner, _, attr = stand_in_param.rpartition(".")
            param = model.get_parameter(holder)
            _ensure_path(model, owner).register_parameter(attr, param)
            if not (self.first and self.last):  # (one rank holding both ends has nothing to sum)
                # The end stages' copies, recorded where every question about
                # the weight is asked: the first stage's counts and writes it.
                param.tpctl_spec = dataclasses.replace(spec_of(param), stage_ranks=tuple(self.mesh.group_ranks["pp_ends"]),
                                                       stage_group=self.mesh.groups.get("pp_ends"))
        beside = self.stage_map.beside
        if len(self.chunks) > 1:  # a rank with the first or last chunk runs others too: gate those modules
            for b in beside:
                if b.where != "every" and self.holds(b.name) and not isinstance(model.get_submodule(b.name), StandIn):
                    _gate(model.get_submodule(b.name), self.run, b.where)
        stack = model.get_submodule(self.stage_map.stack_name)
        for chunk in self.chunks:
            if not chunk.first:
                stack._modules[str(chunk.blocks[0])].register_forward_pre_hook(
                    _TakeStream(self.run, chunk), with_kwargs=True, prepend=True)
            if not chunk.last:
                stack._modules[str(chunk.blocks[-1])].register_forward_hook(_EndStage(self.run, chunk))

    # ---- running a chunk --------------------------------------------------------
    @contextlib.contextmanager
    def running(self, chunk: Chunk, received: Optional[torch.Tensor]):
        """Chunk `chunk` is the one running, fed `received` (None: the first)."""
        self.run.chunk, self.run.received = chunk, received
        self.stack.show(chunk.blocks)
        try:
            yield
        finally:
            self.run.chunk, self.run.received = None, None
            self.stack.show([i for c in self.chunks for i in c.blocks])


class _TakeStream:
    """Pre-hook of a chunk's first block: its first tensor argument (the
    stream the model's own forward computed from stand-ins) becomes the
    stream the previous stage sent."""

    def __init__(self, run: _Run, chunk: Chunk):
        self.run, self.chunk = run, chunk

    def __call__(self, module, args, kwargs):
        if self.run.chunk is not self.chunk:
            return None
        stream = self.run.received
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return (*args[:i], stream, *args[i + 1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": stream}
        raise RuntimeError(f"block {type(module).__name__} has no tensor argument to take the stage's stream")


class _EndStage:
    """Hook of a chunk's last block: its output is the stage's."""

    def __init__(self, run: _Run, chunk: Chunk):
        self.run, self.chunk = run, chunk

    def __call__(self, module, args, out):
        if self.run.chunk is self.chunk:
            raise StageOutput(first_tensor(((out,), {})))
        return None


def _gate(module: nn.Module, run: _Run, where: str) -> None:
    """A module beside the stack on a rank that also runs chunks where it
    does not belong: there it acts as a StandIn (the instance's forward is
    wrapped; names and parameters stay)."""
    original = module.forward

    def forward(*args, **kwargs):
        chunk = run.chunk
        if chunk is None or (chunk.first if where == "before" else chunk.last):
            return original(*args, **kwargs)
        return run.stand_in(args, kwargs)

    module.forward = forward


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _ensure_path(model: nn.Module, name: str) -> nn.Module:
    """The module at `name`, made empty where a stand-in holds a tied parameter deeper than itself."""
    node = model
    for part in name.split(".") if name else []:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node
