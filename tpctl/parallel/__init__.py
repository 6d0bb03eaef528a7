"""The parallel machinery, independent of any model or command: the layout
of a run (layout.py), its process mesh (mesh.py), the tensor-parallel modes
(one module each, registry.py), data parallelism (data_parallel.py), and
their composition on one rank (parallelism.py)."""

from __future__ import annotations


def init_parallel(layout=None, *, seed: int = 0, device: str = "cpu", **dims):
    """The parallel machinery of an initialised process group: a
    `Layout`, or its fields as keywords (mode=..., size=..., dp=...)."""
    from .layout import Layout
    from .parallelism import parallelism

    return parallelism(layout or Layout(**dims), seed, device)
