"""Documents inside a window (`data.documents=true`): no attention across a
document boundary and positions that restart at each document
(docs/DESIGN.md, "Documents").

A prepared corpus ends every document with its separator (`eos_id` of its
index.json), so the documents of a window are a function of its token ids
alone: a position's document is the number of separators before it (a
separator ends the document it closes), its position in the document the
distance from that document's first token in the window (a window that
starts inside a document starts that document's positions at 0, as
Megatron's reset_position_ids does). Every rank and layout computes them
from the ids it is fed, which are the rows of (seed, split, step).

`install(model, mode, cp, eos)` gives a model that reads documents (tpctl's
GPT) its `DocumentSetup`; the model's forward asks it for the `Documents`
of its ids and runs its blocks inside them (`with documents:`), where the
attention finds them (`current()`): the mask of the rows it holds, or,
across cp ranks, each pair of chunks' mask (context/attention.py). The
setup knows what the layout does to a window: the cp ranks' positions
(the ids are gathered over cp, a few bytes per token, once per forward),
the rows the residual stream and the attention hold (3d splits rows inside
the model), the sequence shard of 1d's sequence parallelism.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm

# The documents of the forward running now (a stack: a forward may run
# inside another, e.g. cp's start-up proof).
_ACTIVE: list = []

# The model attribute that holds a DocumentSetup (a model without it reads no documents).
SETUP = "tpctl_documents"


def current() -> Optional["Documents"]:
    """The documents of the forward running now (None: none, plain causal attention)."""
    return _ACTIVE[-1] if _ACTIVE else None


def document_ids(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """[rows, T] ids -> the document of each position (0 for the first of
    the window): the separators strictly before it."""
    sep = (ids == eos).long()
    return sep.cumsum(-1) - sep


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """[rows, T] document ids -> each position's index in its document."""
    t = torch.arange(doc.shape[-1], device=doc.device).expand_as(doc)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return t - torch.where(first, t, torch.zeros_like(t)).cummax(-1).values


def same_document(doc_q: torch.Tensor, doc_k: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
    """[rows, 1, queries, keys] bool: key visible to query (same document,
    not later), from the queries' and keys' document ids [rows, n] and
    global positions [n]."""
    causal = pos_q[:, None] >= pos_k[None, :]
    return ((doc_q[:, :, None] == doc_k[:, None, :]) & causal)[:, None]


class Documents:
    """The documents of one forward's rows.

    doc: [rows the attention holds, T] document ids of the whole sequence,
    in global order; held: [L] the global positions this rank holds (all T
    without cp), in the order its activations hold them; positions: [rows
    read, L] each held position's index in its document."""

    def __init__(self, doc: torch.Tensor, held: torch.Tensor, positions: torch.Tensor, stream_rows: Optional[torch.Tensor]):
        self.doc, self.held, self.positions = doc, held, positions
        self.stream_rows = stream_rows  # the rows read the residual stream holds (None: all)
        self._mask: Optional[torch.Tensor] = None

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def mask(self) -> torch.Tensor:
        """[rows, 1, L, L] bool of this rank's held positions against each
        other: what torch's attention takes as attn_mask (computed once per
        forward, every layer's). Across cp ranks context parallelism
        recognises it (`is_mask`) and masks each pair of chunks itself."""
        if self._mask is None:
            mine = self.doc[:, self.held]
            self._mask = same_document(mine, mine, self.held, self.held)
        return self._mask

    def is_mask(self, tensor) -> bool:
        return tensor is not None and tensor is self._mask

    def check(self, q: torch.Tensor, name: str = "attention") -> None:
        """The attention's queries [rows, heads, L, head_dim] are the rows
        and positions these documents place (never a silently wrong mask)."""
        if q.shape[0] != self.doc.shape[0] or q.shape[-2] != self.held.numel():
            raise RuntimeError(f"data.documents: {name} holds {q.shape[0]} rows of {q.shape[-2]} positions, "
                               f"the documents {self.doc.shape[0]} rows of {self.held.numel()}")

    def embed_positions(self, table: nn.Module) -> torch.Tensor:
        """The position table's rows of each held position's index in its
        document, as the residual stream holds them: [rows, L, width].
        Fed positions-major ([L, rows]), as a mode's position table is fed
        positions ([L]): 1d's sequence parallelism keeps its shard of dim 0,
        2d and 3d look up their hidden block; 3d's rows are then the
        stream's. A pipeline stage that does not hold the table runs a
        stand-in, whose output is already the stream's shape."""
        if hasattr(table, "tpctl_stand_in_for"):
            return table(self.positions)
        with self:  # active: cp's position hook leaves these positions as they are (they are global already)
            out = table(self.positions.transpose(0, 1)).transpose(0, 1)
        return out if self.stream_rows is None else out[self.stream_rows.to(out.device)]


class DocumentSetup:
    """What a layout does to a window, for the documents of a forward:
    `mode` (the tensor mode: the rows its stream and attention hold; None:
    a model not rewritten), `cp` (the ranks splitting the sequence, or
    None) and the separator `eos`."""

    def __init__(self, mode, cp, eos: int, width: int):
        self.mode, self.cp, self.eos, self.width = mode, cp, int(eos), width
        self._rows: dict = {}

    def _split(self) -> bool:
        return self.cp is not None and self.cp.size > 1 and self.cp.active

    def whole(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the whole rows' ids [rows, T] in global order, the positions
        this rank holds [L])."""
        if not self._split():
            return ids, torch.arange(ids.shape[1], device=ids.device)
        cp, length = self.cp, ids.shape[1] * self.cp.size
        gathered = comm.all_gather(ids.contiguous(), cp.group, dim=1)
        at = torch.cat([cp.positions(length, r) for r in range(cp.size)]).to(ids.device)
        whole = torch.empty_like(gathered)
        whole[:, at] = gathered
        return whole, cp.positions(length).to(ids.device)

    def rows(self, batch: int, length: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(the rows read the residual stream holds, None: all; the rows the
        attention holds), for a forward of `batch` rows of `length` held
        positions: the mode's own splits of a probe of row indices (the
        stream: `shard_hidden`; the attention, fed what the logits hold:
        `split_target`, rows block (i, l) in 3d, all rows elsewhere)."""
        key = (batch, length)
        if self.mode is None:  # one process's model: every row, whole
            return None, torch.arange(batch)
        if key not in self._rows:
            probe = torch.arange(batch).view(batch, 1, 1).expand(batch, length, self.width)
            stream = self.mode.shard_hidden(probe)[:, 0, 0]
            att = self.mode.split_target(torch.arange(batch).view(batch, 1).expand(batch, length))[:, 0]
            self._rows[key] = (None if stream.numel() == batch else stream.contiguous(), att.contiguous())
        return self._rows[key]

    def of(self, ids: torch.Tensor) -> Documents:
        """The documents of a forward fed `ids` [rows read, L]."""
        whole, held = self.whole(ids)
        doc = document_ids(whole, self.eos)
        positions = document_positions(doc)[:, held]
        stream_rows, att_rows = self.rows(ids.shape[0], ids.shape[1])
        return Documents(doc[att_rows.to(doc.device)], held, positions, stream_rows)


def install(model: nn.Module, mode, cp, eos: Optional[int]) -> None:
    """Documents read by `model` (a model with `tpctl_reads_documents`),
    separated by `eos`, on this rank's layout (None: none; the attribute
    removed)."""
    if eos is None:
        if hasattr(model, SETUP):
            delattr(model, SETUP)
        return
    if not getattr(model, "tpctl_reads_documents", False):
        raise ValueError(f"data.documents=true: {type(model).__name__} does not read documents (tpctl's GPT does)")
    width = getattr(getattr(model, "cfg", None), "n_embd", 1)
    object.__setattr__(model, SETUP, DocumentSetup(mode, cp, eos, width))
