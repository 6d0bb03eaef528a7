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
