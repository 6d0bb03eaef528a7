"""One module per tensor-parallel mode, each registering one ParallelMode subclass
(tpctl.parallel.registry)."""
