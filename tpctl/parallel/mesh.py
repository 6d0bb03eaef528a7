"""The process mesh: where this rank sits in its run's `Layout` and the
process groups it talks over, named by purpose.

`build_mesh` is the one constructor. With process groups (an initialised
default group) it is what a worker trains on; without (`groups=False`) it
is the same mesh with every group None and the member ranks real: what
`inspect` and the planner lay out shapes and replicas with, never
communicating.

Groups: the purposes of `layout.GROUP_AXES` (`tp`, `dp`, `pp`, `world`,
`batch`, `grad_norm`) and the mode's own grid groups (2d's `row`/`col`, 3d's
cube lines and planes, ...). A group of one rank is None (comm.py treats it
as free); groups with the same members are one process group. They are
created once here and passed to layers explicitly; nothing is kept in
module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from tpctl.parallel.geometry import Geometry
from tpctl.parallel.layout import GROUP_AXES, Layout
from tpctl.seeding import derive_seed


@dataclass
class Mesh:
    """Where this rank sits and whom it talks to."""

    layout: Layout
    rank: int
    device: torch.device
    # This rank's coordinate on each of the tensor grid's axes (the mode's).
    coords: dict[str, int]
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    # Global ranks of each group's members, in group-rank order.
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    # Dropout generators: `shared` draws the same numbers on every rank of the
    # tensor-parallel group (for replicated activations), `local` differs on
    # every rank (for sharded activations). See docs/DESIGN.md, "Dropout".
    rng_shared: Optional[torch.Generator] = None
    rng_local: Optional[torch.Generator] = None
    seed: int = 0
    # Which draws the dropout layers make now: the step and micro-batch the
    # forward runs (set by the training step and the pipeline's stages).
    draw_step: int = 0
    draw_micro: int = 0
    # Groups of other sets of tensor-parallel ranks (the holders of a shared
    # key/value head), made on first use: positions in the group -> (group, global ranks).
    subgroups: dict = field(default_factory=dict)

    @property
    def geo(self) -> Geometry:
        return self.layout.geo

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def tp_size(self) -> int:
        return self.layout.size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_index(self.rank)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.groups["tp"]

    def reseed_dropout(self, block: int) -> None:
        """Start the dropout generators of block `block` (-1: before the
        blocks) of the micro-batch running now: seeded by (replica, grid
        position, step, micro-batch, block), never by what ran before on
        this rank, so a pipeline stage draws the masks one process draws
        whichever blocks it holds, and a resumed run draws what the
        uninterrupted one did."""
        key = (self.draw_step, self.draw_micro, block)
        self.rng_shared.manual_seed(derive_seed(self.seed, "dropout-shared", self.dp_rank, *key))
        self.rng_local.manual_seed(derive_seed(self.seed, "dropout-local", self.dp_rank, self.tp_rank, *key))

    def tp_subgroups(self, sets: list[tuple[int, ...]]) -> dict[tuple, tuple]:
        """{positions: (process group, global ranks)}: for each set of
        positions in the tensor-parallel grid, the group of those positions
        in this rank's grid (None where this rank is not a member, or the
        set is one rank). Collective: every rank passes the same sets in the
        same order; each set's group is made for every grid (every dp
        replica and stage) alike, once per mesh."""
        grids = self.layout.group_members("tp")
        mine = next(g for g in grids if self.rank in g)
        for positions in sets:
            if positions not in self.subgroups:
                lists = [[grid[t] for t in positions] for grid in grids]
                group = None
                if len(positions) > 1 and self.groups["tp"] is not None:
                    for members in lists:
                        made = dist.new_group(members)
                        if self.rank in members:
                            group = made
                self.subgroups[positions] = (group, [mine[t] for t in positions])
        return {s: self.subgroups[s] for s in sets}


def build_mesh(layout: Layout, rank: Optional[int] = None, device: str | torch.device = "cpu", seed: int = 0,
               groups: bool = True) -> Mesh:
    """The mesh of `rank` (default: this process's) in `layout`; with
    `groups`, every group's process group is created (all ranks must call
    this alike, as torch.distributed.new_group requires)."""
    if groups:
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs torch.distributed to be initialised "
                               "(see tpctl.launch.worker.init_distributed), or groups=False")
        if dist.get_world_size() != layout.world:
            raise ValueError(f"world size {dist.get_world_size()} != {layout.label()} ({layout.world} ranks)")
        rank = dist.get_rank() if rank is None else rank
    rank = rank or 0
    layout.validate()
    coords = layout.coords(rank)
    grid = dict(layout.grid_axes)
    mesh = Mesh(layout=layout, rank=rank, device=torch.device(device),
                coords={a: c for a, c in coords.items() if a in grid}, dp_rank=coords["dp"], pp_rank=coords["pp"],
                cp_rank=coords["cp"], seed=seed)
    made: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}
    for name in (*GROUP_AXES, *layout.mode_class.grid_groups, "pp_ends"):
        members = layout.group_of(name, rank)
        mesh.group_ranks[name] = members
        mesh.groups[name] = _process_group(layout, name, made) if groups else None
    mesh.rng_shared = torch.Generator(device=mesh.device).manual_seed(derive_seed(seed, "dropout-shared", mesh.dp_rank))
    mesh.rng_local = torch.Generator(device=mesh.device).manual_seed(derive_seed(seed, "dropout-local", rank))
    return mesh


def _process_group(layout: Layout, name: str, made: dict) -> Optional[dist.ProcessGroup]:
    """This rank's process group among every group named `name` (created
    on every rank in the same order; members equal to an earlier group's
    reuse it; the whole world is WORLD; one rank is None)."""
    mine = None
    rank = dist.get_rank()
    for members in layout.group_members(name):
        key = tuple(sorted(members))
        if key not in made:
            if len(key) == 1:
                made[key] = None
            elif len(key) == layout.world:
                made[key] = dist.group.WORLD
            else:
                made[key] = dist.new_group(list(key))
        if rank in key:
            mine = made[key]
    return mine
