"""The tensor-parallel modes: the interface a mode implements (mode.py), the rewrite that applies one
to a model's layers (rewrite.py), the layers and the loss the modes share, and the modes themselves (modes/)."""
