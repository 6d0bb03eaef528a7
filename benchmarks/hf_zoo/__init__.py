"""Helpers of benchmarks/hf_all_families.py (a package, not a script: the
benchmarks' own test starts every benchmarks/*.py)."""
