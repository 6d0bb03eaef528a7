"""Context parallelism: the cp ranks that split each sequence (split.py) and the attention over
the split sequence (attention.py)."""
