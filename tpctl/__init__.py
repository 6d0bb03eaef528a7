"""tpctl: tensor-parallel training (1D, 2D, 2.5D, 3D) for plain PyTorch models."""
