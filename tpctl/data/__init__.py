"""Data: text to token ids and token ids to the batches of a run.

`tokenizer` (the one tokenizer: bytes or a tokenizer directory), `sources`
and `prepare` (`tpctl prepare-data`: documents in, token shards out),
`shards` (a prepared corpus read back as one stream), `corpora` (the token
stream of a run's `cfg.data`, tokenised and cached), `token_ids` (ids a
model cannot embed, refused) and `batches` (the global batch of each step,
of which a rank reads its rows).

`DataError` is defined here because every module of the package raises it.
"""

from __future__ import annotations

from tpctl.errors import EXIT_USAGE, TpctlError


class DataError(TpctlError, ValueError):
    """Bad input (a file, a line, a row): one line for the user, exit 2."""

    exit_code = EXIT_USAGE
