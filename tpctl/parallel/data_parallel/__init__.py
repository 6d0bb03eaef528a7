"""Data parallelism: replicas that read other rows and agree on one gradient (ddp.py), and ZeRO,
which shares optimizer state, gradients and parameters between them (zero.py, zero_plan.py)."""
