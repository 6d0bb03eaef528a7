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
across cp ranks, each pair of chunks' mask (context/attention.py). A
Hugging Face causal LM, whose forward is transformers', gets the same from
outside (`install_hf`): its forward wrapped, its rotary table fed the
documents' positions, its attention modules' causal torch attention
answered with the documents' mask. The
setup knows what the layout does to a window: the cp ranks' positions
(the ids are gathered over cp, a few bytes per token, once per forward),
the rows the residual stream and the attention hold (3d splits rows inside
the model), the sequence shard of 1d's sequence parallelism.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpctl.parallel import comm
from tpctl.parallel.context.masks import band_window, plain_causal

# The documents of the forward running now (a stack: a forward may run
# inside another, e.g. cp's start-up proof).
_ACTIVE: list = []

# The model attribute that holds a DocumentSetup (a model without it reads no documents).
SETUP = "tpctl_documents"


def current() -> Optional["Documents"]:
    """The documents of the forward running now (None: none, plain causal attention)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def answering(documents: Optional["Documents"]):
    """While context parallelism computes a call these documents took (None:
    no documents): the attention calls of its own computation pass the
    documents' handler (_Masks) unchanged."""
    if documents is None:
        yield
        return
    was, documents.answered = documents.answered, True
    try:
        yield
    finally:
        documents.answered = was


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


def same_document(doc_q: torch.Tensor, doc_k: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor,
                  window: Optional[int] = None) -> torch.Tensor:
    """[rows, 1, queries, keys] bool: key visible to query (same document,
    not later, and with a sliding `window` fewer than `window` positions
    back), from the queries' and keys' document ids [rows, n] and global
    positions [n]."""
    gap = pos_q[:, None] - pos_k[None, :]
    # transformers' sliding_window_overlay: kv_idx > q_idx - window, i.e. a
    # query sees itself and the window - 1 keys before it.
    seen = gap >= 0 if window is None else (gap >= 0) & (gap < window)
    return ((doc_q[:, :, None] == doc_k[:, None, :]) & seen)[:, None]


class Documents:
    """The documents of one forward's rows.

    doc: [rows the attention holds, T] document ids of the whole sequence,
    in global order; held: [L] the global positions this rank holds (all T
    without cp), in the order its activations hold them; positions: [rows
    read, L] each held position's index in its document."""

    def __init__(self, doc: torch.Tensor, held: torch.Tensor, positions: torch.Tensor, stream_rows: Optional[torch.Tensor],
                 attention_positions: Optional[torch.Tensor] = None):
        self.doc, self.held, self.positions = doc, held, positions
        self.stream_rows = stream_rows  # the rows read the residual stream holds (None: all)
        # [rows the attention holds, L]: what a rotary table is fed (its
        # cos/sin multiply the attention's q and k, row for row).
        self.attention_positions = positions if attention_positions is None else attention_positions
        self._mask: Optional[torch.Tensor] = None
        self._windowed: dict = {}  # window -> its mask (a family's sliding layers: mask(window))
        # A Hugging Face model's forward (install_hf): its causal attention
        # calls are these documents' (`takes`), counted for the guards.
        self.replaces_causal = False
        self.attended = self.rotated = 0
        self.answered = False  # cp is computing the call it took: its own attention calls pass (`answering`)

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[rows, 1, L, L] bool of this rank's held positions against each
        other: what torch's attention takes as attn_mask (computed once per
        forward, every layer's; with a sliding `window`, once per window).
        Across cp ranks context parallelism recognises it (`is_mask`) and
        masks each pair of chunks itself, the family's window with them."""
        if window is not None:
            if window not in self._windowed:
                mine = self.doc[:, self.held]
                self._windowed[window] = same_document(mine, mine, self.held, self.held, window)
            return self._windowed[window]
        if self._mask is None:
            mine = self.doc[:, self.held]
            self._mask = same_document(mine, mine, self.held, self.held)
        return self._mask

    def is_mask(self, tensor) -> bool:
        return tensor is not None and tensor is self._mask

    def takes(self, name: str, attn_mask, is_causal: bool) -> bool:
        """Whether an attention call inside module `name` is causal
        attention these documents mask: their own mask (tpctl's GPT), or in
        a Hugging Face model's forward is_causal=True without a mask, or a
        mask of plain causal attention (the family's own, made where it
        does not leave it to is_causal). Any other mask (padding, a sliding
        window that cuts) raises naming the module: never combined silently."""
        if self.is_mask(attn_mask):
            self.attended += 1
            return True
        if not self.replaces_causal:
            return False
        if attn_mask is None and not is_causal:
            raise RuntimeError(f"data.documents: {name} calls attention with is_causal=False and no mask "
                               "(bidirectional), which documents cannot mask as causal attention")
        if attn_mask is not None and not plain_causal(attn_mask):
            raise RuntimeError(f"data.documents: {name} calls attention with a mask of its own "
                               f"{tuple(attn_mask.shape)} that is not plain causal (padding, a sliding window): "
                               "documents replace plain causal attention only")
        self.attended += 1
        return True

    def window(self, attn_mask) -> Optional[int]:
        """The sliding window of a Hugging Face attention call's own mask
        (None: not a sliding causal mask that cuts; `takes` judges it). Its
        window, not the config's, is what the family computes: the
        documents' mask cut to it is that attention within each document.
        Only outside cp: across cp ranks cp's handler answers first, with
        the window it surveyed on the whole sequence (context/split.py)."""
        if not self.replaces_causal or attn_mask is None:
            return None
        window = band_window(attn_mask)
        if window is not None:
            self.attended += 1
        return window

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
        att_rows = att_rows.to(doc.device)
        return Documents(doc[att_rows], held, positions, stream_rows, positions[att_rows])


def install(model: nn.Module, mode, cp, eos: Optional[int]) -> None:
    """Documents read by `model` (tpctl's GPT, which has
    `tpctl_reads_documents`, or a Hugging Face causal LM: `install_hf`),
    separated by `eos`, on this rank's layout (None: none; the setup and
    what install_hf added removed)."""
    if eos is None:
        if hasattr(model, SETUP):
            delattr(model, SETUP)
        _uninstall_hf(model)
        return
    hf = not getattr(model, "tpctl_reads_documents", False)
    if hf and getattr(model, "config", None) is None:
        raise ValueError(f"data.documents=true: {type(model).__name__} does not read documents "
                         "(tpctl's GPT and Hugging Face causal LMs do)")
    width = model.config.hidden_size if hf else getattr(getattr(model, "cfg", None), "n_embd", 1)
    setup = DocumentSetup(mode, cp, eos, width)
    object.__setattr__(model, SETUP, setup)
    if hf and not hasattr(model, _HF):
        object.__setattr__(model, _HF, install_hf(model))


# The model attribute holding what install_hf added (a function removing it).
_HF = "tpctl_documents_hf"


def _uninstall_hf(model: nn.Module) -> None:
    remove = getattr(model, _HF, None)
    if remove is not None:
        remove()
        delattr(model, _HF)


# ---- Hugging Face causal LMs ---------------------------------------------------
# Their forward is theirs: the documents enter from outside. The rotary
# table (computed once at the top, from position_ids) is fed the documents'
# positions by a pre-hook, and inside each attention module torch's
# scaled_dot_product_attention, which transformers' sdpa attention calls
# with is_causal=True (its causal mask skipped), is answered with the
# documents' mask; across cp ranks cp's own handler (context/split.py)
# takes the call first and masks each chunk pair by the documents.


def install_hf(model: nn.Module):
    """The hooks keeping documents apart in Hugging Face causal LM `model`
    (its setup at SETUP); returns the function removing them."""
    attention = [(n, m) for n, m in model.named_modules()
                 if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    rotary = [m for _, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not attention or not rotary:
        raise ValueError(f"data.documents=true: {type(model).__name__} has no "
                         f"{'attention module calling torch attention' if not attention else 'rotary embedding module'}"
                         ", through which documents are kept apart")
    handles = [m.register_forward_pre_hook(_rotary_positions, with_kwargs=True) for m in rotary]
    wrapped = [(m, m.forward) for _, m in attention]
    for name, m in attention:
        m.forward = _masking(m.forward, name, type(m).__name__)
    original = model.forward
    model.forward = _hf_forward(model, original)

    def remove():
        for h in handles:
            h.remove()
        for m, forward in wrapped:
            m.forward = forward
        model.forward = original
    return remove


def _hf_forward(model: nn.Module, forward):
    @functools.wraps(forward)
    def run(input_ids=None, *args, **kwargs):
        setup = getattr(model, SETUP, None)
        # A call of its own masks, positions or cache (decoding) is the family's, unchanged.
        own = args or any(kwargs.get(k) is not None for k in ("attention_mask", "position_ids", "past_key_values",
                                                               "cache", "inputs_embeds"))
        if setup is None or own or input_ids is None:
            return forward(input_ids, *args, **kwargs)
        documents = setup.of(input_ids)
        documents.replaces_causal = True
        with documents:
            out = forward(input_ids, **kwargs)
        if documents.rotated == 0:  # the positions came from elsewhere: never silently the window's
            raise RuntimeError(f"data.documents: {type(model).__name__}'s forward computed its positions without "
                               "its rotary embedding module, which documents feed")
        return out
    return run


def _rotary_positions(module: nn.Module, args: tuple, kwargs: dict):
    """A rotary table's position ids (its second argument) made each
    position's index in its document, of the rows the attention holds."""
    documents = current()
    if documents is None or not documents.replaces_causal:
        return None
    documents.rotated += 1
    pos = documents.attention_positions  # on the ids' device, the model's
    if len(args) > 1:
        return (args[0], pos, *args[2:]), kwargs
    return args, {**kwargs, "position_ids": pos}


class _Masks(TorchFunctionMode):
    """Inside one attention module's forward: its causal
    scaled_dot_product_attention made the documents' (cp's handler, pushed
    inside this one, answers first where cp splits the sequence)."""

    def __init__(self, documents: Documents, name: str):
        super().__init__()
        self.documents, self.name = documents, name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.documents.answered:
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            call = {**dict(zip(names, rest)), **kwargs}
            # A sliding window (Mistral's): the family's own band, recognised
            # and cut into the documents' mask; else plain causal or refused.
            window = self.documents.window(call.get("attn_mask"))
            if window is not None or self.documents.takes(self.name, call.get("attn_mask"),
                                                          call.get("is_causal", False)):
                self.documents.check(q, self.name)
                call.update(attn_mask=self.documents.mask(window), is_causal=False)
                if call.get("enable_gqa") and k.shape[1] != q.shape[1]:  # a mask with gqa: not every kernel has it
                    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
                    call["enable_gqa"] = False
            return func(q, k, v, **call)
        return func(*args, **kwargs)


def _masking(forward, name: str, kind: str):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        documents = current()
        if documents is None or not documents.replaces_causal:
            return forward(*args, **kwargs)
        before = documents.attended
        with _Masks(documents, name):
            out = forward(*args, **kwargs)
        if documents.attended == before:  # it attended by other means: never unmasked silently
            raise RuntimeError(f"data.documents: {name} ({kind}) computes attention without torch's "
                               "scaled_dot_product_attention, whose mask documents replace")
        return out
    return run
