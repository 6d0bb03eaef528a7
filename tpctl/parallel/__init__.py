"""Tensor-parallel modes, one module each, behind `base.ParallelMode`."""

from __future__ import annotations


def get_mode(mesh, seq_parallel: bool = False):
    """The ParallelMode object for `mesh.mode`."""
    if mesh.mode == "none":
        from .none import NoParallel
        return NoParallel(mesh)
    if mesh.mode == "1d":
        from .one_d import OneD
        return OneD(mesh, seq_parallel=seq_parallel)
    if mesh.mode == "2d":
        from .two_d import TwoD
        return TwoD(mesh)
    if mesh.mode == "2.5d":
        from .two_p5_d import TwoPointFiveD
        return TwoPointFiveD(mesh)
    if mesh.mode == "3d":
        from .three_d import ThreeD
        return ThreeD(mesh)
    raise ValueError(f"unknown mode {mesh.mode!r}")


def init_parallel(mode: str = "none", size: int = 1, depth: int = 1, dp: int = 1, seed: int = 0,
                  seq_parallel: bool = False, device: str = "cpu"):
    """The mesh of an initialised process group, and the mode acting on it."""
    from .mesh import init_mesh

    return get_mode(init_mesh(mode, size, depth, dp, seed, device), seq_parallel=seq_parallel)
