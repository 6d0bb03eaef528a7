"""The parallel machinery, independent of any model or command: the layout
of a run (layout.py), its process mesh (mesh.py), the tensor-parallel modes
(one module each, registry.py), data parallelism (data_parallel.py), and
their composition on one rank (parallelism.py; `tpctl.init_parallel` builds
one)."""

from __future__ import annotations
