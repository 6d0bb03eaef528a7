"""The layout of a run: how its world of ranks is split into data-parallel
replicas, pipeline stages and one tensor-parallel grid per stage, as one
frozen object (torchtitan's `ParallelDims`).

    world = dp x pp x cp x size   rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * size + tp_index

Data parallelism is the outermost axis and the tensor grid the innermost, so
a tensor-parallel group is a run of consecutive ranks (one node, the fastest
links) and pipeline stages and replicas are what cross nodes. Inside the grid
the mode's axes follow, last axis fastest (`ParallelMode.axes`).

Everything here is arithmetic: no process group, no tensor. The launcher
validates a config with it before any worker starts, the planner and
`inspect` lay out ranks with it, and `mesh.build_mesh` turns it into process
groups named by purpose (`GROUP_AXES`).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from tpctl.errors import ConfigError
from tpctl.parallel.geometry import Geometry

# Stages of ZeRO (docs/DESIGN.md, "Data parallelism"): 0 none, 1 optimizer
# state, 2 + gradients, 3 + parameters sharded over the dp group.
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    """One run's parallel dimensions. `mode`, `size` and `depth` shape the
    tensor grid (the mode's geometry); `pp` and `dp` repeat it."""

    mode: str = "none"
    size: int = 1
    depth: int = 1
    dp: int = 1
    pp: int = 1
    zero: int = 0
    seq_parallel: bool = False
    # Context parallelism: ranks that split each sequence (parallel/context/split.py).
    cp: int = 1

    # ---- from and to configs -----------------------------------------------
    @classmethod
    def from_config(cls, cfg: Any) -> "Layout":
        """The layout of a run config (or of any mapping with its top-level
        keys; `pp` and `zero` default to 1 and 0 where a config predates them)."""
        get = cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
        # Values pass as written, never coerced (`int(pp or 1)` once turned
        # pp=0 into one stage behind validation's back): `validate` refuses them.
        fields = {key: get(key, default) for key, default in asdict(cls()).items()}
        return cls(**{key: getattr(cls, key) if value is None else value for key, value in fields.items()})

    @classmethod
    def parse(cls, name: str) -> "Layout":
        """The layout of a short name (`name`): the mode, then its size and
        the other fields that differ from the defaults, joined by '-':
        `none-dp8`, `1d-2-sp-dp4`, `2.5d-8-d2`, `3d-8-pp2-dp2-z1`, `1d-2-cp2-dp2`."""
        mode, *parts = name.split("-")
        fields: dict[str, Any] = {"mode": mode}
        for part in parts:
            for prefix, key in (("dp", "dp"), ("pp", "pp"), ("cp", "cp"), ("d", "depth"), ("z", "zero"), ("", "size")):
                if part.startswith(prefix) and part[len(prefix):].isdigit():
                    fields[key] = int(part[len(prefix):])
                    break
            else:
                if part != "sp":
                    raise ValueError(f"layout name {name!r}: {part!r} is not a size, d<depth>, sp, pp<N>, cp<N>, dp<N> "
                                     "or z<stage>")
                fields["seq_parallel"] = True
        return cls(**fields)

    # The one rendering of a layout, in two spellings: `name` (what `parse`
    # reads back, `Layout.parse(layout.name) == layout`) and `label` (the
    # same fields for people). Both show the mode, then each field that
    # differs from its default, in this order.
    _SHOWN = ("size", "depth", "seq_parallel", "pp", "cp", "dp", "zero")
    _SHORT = {"size": "", "depth": "d", "pp": "pp", "cp": "cp", "dp": "dp", "zero": "z"}

    def _shown(self, size: bool = False) -> list[tuple[str, Any]]:
        """(key, value) of each field that differs from its default (and
        with `size`, the size always), in the order names and labels show them."""
        return [(key, getattr(self, key)) for key in self._SHOWN
                if getattr(self, key) != _DEFAULTS[key] or (size and key == "size")]

    @property
    def name(self) -> str:
        """The short name `parse` reads: `2d-4-dp2`, `1d-2-sp-cp2`, `2.5d-8-d2-pp2-z1`."""
        return "-".join([self.mode] + ["sp" if key == "seq_parallel" else f"{self._SHORT[key]}{value}"
                                       for key, value in self._shown()])

    def label(self) -> str:
        """The name spelled out for people, its fields by their config keys
        and the size always: `2d size=4`, `2.5d size=8 depth=2 dp=2`,
        `1d size=2 sp cp=2`, `3d size=8 pp=2 dp=2 zero=1` (any values, a
        config's refused ones too)."""
        return " ".join([str(self.mode)] + ["sp" if key == "seq_parallel" else f"{key}={value}"
                                            for key, value in self._shown(size=True)])

    def to_dict(self) -> dict:
        return asdict(self)

    def write_to(self, cfg: Any) -> Any:
        """Set a run config's layout keys to this layout; returns `cfg`."""
        for key, value in self.to_dict().items():
            cfg[key] = value
        return cfg

    def overrides(self) -> list[str]:
        """The `tpctl train` overrides that select this layout (defaults left out)."""
        default = Layout()
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.to_dict().items()
                if k == "mode" or v != getattr(default, k)]

    def replace(self, **changes: Any) -> "Layout":
        from dataclasses import replace

        return replace(self, **changes)

    # ---- what it is ----------------------------------------------------------
    @property
    def world(self) -> int:
        """Ranks of the whole run: the one place this product is formed."""
        return self.dp * self.pp * self.cp * self.size

    @cached_property
    def mode_class(self) -> type:
        from tpctl.parallel.registry import mode_class

        return mode_class(self.mode)

    @cached_property
    def geo(self) -> Geometry:
        """The tensor grid's geometry (ConfigError if `size`/`depth` do not fit the mode)."""
        if self.size < 1:
            raise ConfigError("size", self.size, "expected a positive number of tensor-parallel ranks")
        return self.mode_class.geometry(self.size, self.depth)

    @property
    def grid_axes(self) -> tuple[tuple[str, int], ...]:
        """The tensor grid's (axis, extent), slowest first."""
        return tuple(zip(self.mode_class.axes, self.mode_class.grid_shape(self.geo)))

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """Every axis of the world, slowest first: dp, pp, cp, then the
        grid's (a cp group's ranks lie one grid apart: the tensor group
        stays the run of consecutive ranks)."""
        return (("dp", self.dp), ("pp", self.pp), ("cp", self.cp), *self.grid_axes)

    # ---- validation ------------------------------------------------------------
    def validate(self) -> Geometry:
        """Check the layout itself (a config's sizes against it:
        `tpctl.config.check_layout`); ConfigError names the first bad key.
        Returns the geometry."""
        for key, value in self.to_dict().items():
            wanted = str if key == "mode" else bool if key == "seq_parallel" else int
            if type(value) is not wanted:  # bool is an int to isinstance: True is no size
                raise ConfigError(key, value, f"expected {'a string' if wanted is str else 'true or false' if wanted is bool else 'an integer'}")
        geo = self.geo
        cls = self.mode_class
        if not cls.uses_depth and self.depth != 1:
            raise ConfigError("depth", self.depth, f"depth is only used by mode=2.5d; expected depth=1 with mode={self.mode}")
        for key in ("dp", "pp", "cp"):
            if getattr(self, key) < 1:
                what = {"dp": "data-parallel replicas", "pp": "pipeline stages", "cp": "ranks splitting each sequence"}[key]
                raise ConfigError(key, getattr(self, key), f"expected a positive number of {what}")
        if self.zero not in ZERO_STAGES:
            raise ConfigError("zero", self.zero, "expected 0, 1, 2 or 3 (the ZeRO stage)")
        if self.zero >= 2 and self.pp > 1:
            # A stage accumulates its gradients over every micro-batch of the
            # schedule, so stage 2's reduce-scatter (and stage 3's gathers)
            # could not free anything between micro-batches; DeepSpeed and
            # ColossalAI cap ZeRO at stage 1 under a pipeline too.
            raise ConfigError("zero", self.zero, "with pp>1 a pipeline stage keeps its gradients whole across the "
                              "schedule's micro-batches, so stages 2 and 3 save nothing: expected zero=0 or zero=1")
        if self.seq_parallel and not cls.sequence_parallel:
            raise ConfigError("seq_parallel", True, f"sequence parallelism is for mode=1d; expected seq_parallel=false with mode={self.mode}")
        return geo

    # ---- ranks -------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Every axis's coordinate of global rank `rank`."""
        out, rest = {}, rank
        for name, extent in reversed(self.axes):
            out[name] = rest % extent
            rest //= extent
        return {name: out[name] for name, _ in self.axes}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, extent in self.axes:
            rank = rank * extent + coords.get(name, 0)
        return rank

    def tp_index(self, rank: int) -> int:
        """The rank's position inside its tensor-parallel grid."""
        return rank % self.size

    def groups_over(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only in the axes `varying` (all
        other axes fixed), each in order of its members' coordinates."""
        names = [name for name, _ in self.axes]
        unknown = set(varying) - set(names)
        if unknown:
            raise ValueError(f"{self.mode} has no axes {sorted(unknown)} (axes: {names})")
        extent = dict(self.axes)
        fixed = [n for n in names if n not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(extent[n]) for n in fixed)):
            base = dict(zip(fixed, fixed_coords))
            groups.append([self.rank_of({**base, **dict(zip(varying, var))})
                           for var in itertools.product(*(range(extent[n]) for n in varying))])
        return groups

    def group_axes(self, name: str) -> tuple[str, ...]:
        """The axes the members of group `name` differ in: a purpose
        (GROUP_AXES) or one of the mode's own grid groups."""
        grid = self.mode_class.axes
        if name in self.mode_class.grid_groups:
            return self.mode_class.grid_groups[name]
        if name not in GROUP_AXES:
            valid = sorted({*GROUP_AXES, *self.mode_class.grid_groups})
            raise ValueError(f"no group {name!r} in mode {self.mode} (groups: {', '.join(valid)})")
        return GROUP_AXES[name](self, grid)

    def group_members(self, name: str) -> list[list[int]]:
        """The member ranks of every group named `name`."""
        if name == "pp_ends":  # the first and the last stage at each grid position of each replica
            return [sorted({g[0], g[-1]}) for g in self.groups_over(("pp",))]
        return self.groups_over(self.group_axes(name))

    def group_of(self, name: str, rank: int) -> list[int]:
        """The members of the group `name` that holds `rank`."""
        if name == "pp_ends":
            return next((g for g in self.group_members(name) if rank in g and len(g) > 1), [rank])
        coords, varying, extent = self.coords(rank), self.group_axes(name), dict(self.axes)
        return [self.rank_of({**coords, **dict(zip(varying, var))})
                for var in itertools.product(*(range(extent[n]) for n in varying))]


_DEFAULTS = asdict(Layout())

# Groups named by purpose -> the axes their members differ in.
GROUP_AXES = {
    "world": lambda layout, grid: ("dp", "pp", "cp", *grid),
    # The tensor-parallel grid of one stage of one replica.
    "tp": lambda layout, grid: grid,
    "dp": lambda layout, grid: ("dp",),
    "pp": lambda layout, grid: ("pp",),
    # The ranks splitting each sequence of the same rows (ring attention's
    # ring, Ulysses' all-to-all).
    "cp": lambda layout, grid: ("cp",),
    # Every rank holding the same parameters with other tokens of the
    # batch: the gradient reduction's (and ZeRO's) replicas.
    "dp_cp": lambda layout, grid: ("dp", "cp"),
    # The mean over the global batch: every rank holding other rows of it (or
    # a replica of them; the mode divides by its replicas) -- the last
    # stage's ranks of every replica.
    "batch": lambda layout, grid: ("dp", "cp", *grid),
    # The global gradient norm sums each distinct shard once: over the grid
    # and the stages, and over dp once ZeRO shards gradients between replicas.
    "grad_norm": lambda layout, grid: (("dp", "cp") if layout.zero else ()) + ("pp", *grid),
}


def geometry(mode: str, size: int, depth: int = 1) -> Geometry:
    """The geometry of a tensor grid (ConfigError naming the bad key)."""
    return Layout(mode, size, depth).geo


def layouts_of(world: int, pp: int = 1) -> list[Layout]:
    """Every layout of `world` ranks with `pp` stages that the registered
    modes offer (for the planner): each divisor as the grid size, the rest
    data-parallel replicas; invalid grids (a non-square 2d) left out."""
    from tpctl.parallel.registry import mode_classes

    out = []
    for size in range(1, world // pp + 1):
        if (world // pp) % size:
            continue
        dp = world // (pp * size)
        for cls in mode_classes():
            for variant in cls.variants(size):
                layout = Layout(cls.name, size, dp=dp, pp=pp, **variant)
                try:
                    layout.geo
                except ConfigError:
                    continue
                out.append(layout)
    return out
