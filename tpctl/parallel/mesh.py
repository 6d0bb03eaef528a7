"""The process mesh: each rank's coordinates and process groups for a mode.

World ranks are laid out data-parallel outermost, tensor-parallel innermost
(rank = dp_rank * size + tp_rank), so a tensor-parallel group is a run of
consecutive ranks (one node, fast links). Inside the tensor-parallel group the
rank is decomposed into the mode's grid coordinates, last axis fastest:

    1d    (p,)          p < size
    2d    (i, j)        row i, column j of a q x q grid
    2.5d  (h, i, j)     depth layer h of d, then a q x q grid
    3d    (i, j, l)     a q x q x q cube

Groups are created once here and passed to layers explicitly; nothing is kept
in module-level state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .geometry import Geometry, geometry
from tpctl.seeding import derive_seed

# Grid axes of each mode, slowest first.
AXES = {
    "none": ("p",),
    "1d": ("p",),
    "2d": ("i", "j"),
    "2.5d": ("h", "i", "j"),
    "3d": ("i", "j", "l"),
}

# Named groups of each mode: name -> the grid axes its ranks differ in.
# (All other axes, and the data-parallel rank, are equal inside a group.)
GROUPS = {
    "none": {},
    "1d": {},
    # row_group: ranks that hold the same activation rows (one grid row);
    # col_group: ranks that hold the same hidden block (one grid column).
    "2d": {"row": ("j",), "col": ("i",)},
    # depth: the replicas of one weight block; hidden_replica: every rank
    # holding the same hidden block (a grid column through all layers).
    "2.5d": {"row": ("j",), "col": ("i",), "depth": ("h",), "hidden_replica": ("h", "i")},
    # Lines along each cube axis, and the two planes over which a
    # hidden-split parameter is replicated in each 3d layout.
    "3d": {"i": ("i",), "j": ("j",), "l": ("l",), "ij": ("i", "j"), "il": ("i", "l")},
}


def _grid_shape(geo: Geometry) -> tuple[int, ...]:
    if geo.mode in ("none", "1d"):
        return (geo.size,)
    if geo.mode == "2d":
        return (geo.q, geo.q)
    if geo.mode == "2.5d":
        return (geo.depth, geo.q, geo.q)
    return (geo.q, geo.q, geo.q)


def _new_groups(world: int, tp_size: int, shape: tuple[int, ...], varying: tuple[int, ...]) -> list[list[int]]:
    """Rank lists of all groups whose members differ only in the grid axes
    `varying` (positions into `shape`); the dp rank is fixed inside a group."""
    fixed = [a for a in range(len(shape)) if a not in varying]
    groups = []
    for dp_rank in range(world // tp_size):
        for fixed_coords in itertools.product(*(range(shape[a]) for a in fixed)):
            members = []
            for var_coords in itertools.product(*(range(shape[a]) for a in varying)):
                coords = [0] * len(shape)
                for a, c in zip(fixed, fixed_coords):
                    coords[a] = c
                for a, c in zip(varying, var_coords):
                    coords[a] = c
                tp_index = 0
                for a, c in enumerate(coords):
                    tp_index = tp_index * shape[a] + c
                members.append(dp_rank * tp_size + tp_index)
            groups.append(members)
    return groups


def group_members(geo: Geometry, dp: int, group: str) -> list[list[int]]:
    """Global ranks of every group named `group` (a GROUPS name, "tp", "dp"
    or "world") in a world of geo.size x dp ranks, without a process group."""
    size, world = geo.size, geo.size * dp
    if group == "world":
        return [list(range(world))]
    if group == "dp":
        return [[r * size + t for r in range(dp)] for t in range(size)]
    if group == "tp":
        return [[r * size + t for t in range(size)] for r in range(dp)]
    axes, shape = AXES[geo.mode], _grid_shape(geo)
    varying = tuple(axes.index(a) for a in GROUPS[geo.mode][group])
    return _new_groups(world, size, shape, varying)


def _subgroup(rank_lists: list[list[int]], rank: int) -> tuple[Optional[dist.ProcessGroup], list[int]]:
    """Create every group in `rank_lists` (all ranks must call this in the
    same order) and return the one holding `rank`, with its member ranks."""
    if len(rank_lists[0]) == dist.get_world_size():
        return dist.group.WORLD, rank_lists[0]
    mine, members = None, None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine, members = group, ranks
    return mine, members


@dataclass
class Mesh:
    """Where this rank sits and whom it talks to."""

    geo: Geometry
    rank: int
    world_size: int
    dp_size: int
    dp_rank: int
    tp_rank: int
    coords: dict[str, int]
    device: torch.device
    dp_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    # Global ranks of each group's members, in group-rank order.
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    # Dropout generators: `shared` draws the same numbers on every rank of the
    # tensor-parallel group (for replicated activations), `local` differs on
    # every rank (for sharded activations). See docs/DESIGN.md, "Dropout".
    rng_shared: Optional[torch.Generator] = None
    rng_local: Optional[torch.Generator] = None
    # Groups of other sets of tensor-parallel ranks (the holders of a shared
    # key/value head), made on first use: positions in the group -> (group, global ranks).
    subgroups: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return self.geo.mode

    @property
    def tp_size(self) -> int:
        return self.geo.size

    def group(self, name: str) -> dist.ProcessGroup:
        return self.groups[name]

    def tp_subgroups(self, sets: list[tuple[int, ...]]) -> dict[tuple, tuple]:
        """{tp ranks: (process group, global ranks)} of this rank's
        data-parallel replica for each set of positions in the
        tensor-parallel group (the group is None where this rank is not a
        member). Collective: every rank passes the same sets in the same
        order, and each is made for every replica alike, once per mesh."""
        for tp_ranks in sets:
            if tp_ranks not in self.subgroups:
                lists = [[d * self.tp_size + t for t in tp_ranks] for d in range(self.dp_size)]
                if len(tp_ranks) == 1:  # no group to make: a rank alone
                    self.subgroups[tp_ranks] = (None, [self.dp_rank * self.tp_size + tp_ranks[0]])
                else:
                    group, members = _subgroup(lists, self.rank)
                    self.subgroups[tp_ranks] = (group, members or lists[self.dp_rank])
        return {s: self.subgroups[s] for s in sets}

    def src_rank(self, name: str, index: int) -> int:
        """Global rank of the member at position `index` of group `name`."""
        return self.group_ranks[name][index]


def _coords(geo: Geometry, tp_rank: int) -> dict[str, int]:
    axes, shape = AXES[geo.mode], _grid_shape(geo)
    coords, rest = {}, tp_rank
    for name, extent in reversed(list(zip(axes, shape))):
        coords[name] = rest % extent
        rest //= extent
    return {a: coords[a] for a in axes}


def layout_mesh(mode: str, size: int, depth: int = 1, dp: int = 1, rank: int = 0) -> Mesh:
    """The mesh rank `rank` would have, without any process group (groups
    are None, member ranks are real): for tools that look at layouts and
    shapes -- inspect, the planner -- and never communicate."""
    geo = geometry(mode, size, depth)
    world, shape = size * dp, _grid_shape(geo)
    mesh = Mesh(geo=geo, rank=rank, world_size=world, dp_size=dp, dp_rank=rank // size,
                tp_rank=rank % size, coords=_coords(geo, rank % size), device=torch.device("cpu"))
    mesh.group_ranks["dp"] = [d * size + mesh.tp_rank for d in range(dp)]
    mesh.group_ranks["tp"] = [mesh.dp_rank * size + t for t in range(size)]
    mesh.groups.update(tp=None, dp=None)
    for name, var_axes in GROUPS[mode].items():
        varying = tuple(AXES[mode].index(a) for a in var_axes)
        mesh.group_ranks[name] = next(g for g in _new_groups(world, size, shape, varying) if rank in g)
        mesh.groups[name] = None
    return mesh


def init_mesh(mode: str, size: int, depth: int = 1, dp: int = 1, seed: int = 0,
              device: str | torch.device = "cpu") -> Mesh:
    """Build the mesh for `mode` on an initialised default process group."""
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed to be initialised (see tpctl.launch.worker.init_distributed)")
    geo = geometry(mode, size, depth)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != size * dp:
        raise ValueError(f"world size {world} != size {size} x dp {dp}")
    shape = _grid_shape(geo)
    axes = AXES[mode]
    tp_rank = rank % size
    coords = _coords(geo, tp_rank)

    mesh = Mesh(geo=geo, rank=rank, world_size=world, dp_size=dp, dp_rank=rank // size,
                tp_rank=tp_rank, coords=coords, device=torch.device(device))
    # Data-parallel groups: same tp_rank, different dp rank.
    dp_lists = [[d * size + t for d in range(dp)] for t in range(size)]
    mesh.dp_group, mesh.group_ranks["dp"] = _subgroup(dp_lists, rank)
    tp_lists = [[d * size + t for t in range(size)] for d in range(dp)]
    mesh.tp_group, mesh.group_ranks["tp"] = _subgroup(tp_lists, rank)
    mesh.groups["tp"], mesh.groups["dp"] = mesh.tp_group, mesh.dp_group
    for name, var_axes in GROUPS[mode].items():
        varying = tuple(axes.index(a) for a in var_axes)
        mesh.groups[name], mesh.group_ranks[name] = _subgroup(_new_groups(world, size, shape, varying), rank)

    mesh.rng_shared = torch.Generator(device=mesh.device).manual_seed(derive_seed(seed, "dropout-shared", mesh.dp_rank))
    mesh.rng_local = torch.Generator(device=mesh.device).manual_seed(derive_seed(seed, "dropout-local", rank))
    return mesh

