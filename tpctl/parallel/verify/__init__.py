"""The start-up proof of a rewrite: the rewritten model run beside the original, piece by piece
(proof.py), on captured inputs (capture.py), compared (compare.py)."""
