"""Context parallelism as a component: the `cp` ranks that split each
sequence of the rows their replica reads (docs/DESIGN.md, "Context
parallelism").

Everything the split touches lives here: which positions a rank reads
(`positions`: zigzag chunks for the ring, a contiguous run for Ulysses), the
position lookups turned to global positions, and the model's attention
replaced (`install`). The loss needs nothing of its own: every rank sums its
tokens' losses and the step divides by the global batch's token count, over
the `batch` group, which spans cp; the gradients are partial sums over a
rank's tokens, reduced over dp x cp by the data-parallel component.

The attention is replaced where it is computed: inside each attention
module (the plan's), torch's `scaled_dot_product_attention` is answered by
the ring or Ulysses (context_attention.py); the module's projections stay
the tensor mode's. A call it cannot make exact (a mask other than causal,
dropout inside attention) raises naming the module.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpctl.errors import EXIT_USAGE, TpctlError
from tpctl.parallel.context import documents as docs_
from tpctl.parallel.context.attention import gathered_attention, ring_attention, ulysses_attention, zigzag_chunks
from tpctl.parallel.context.masks import band_window, plain_causal
from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.mesh import Mesh

IMPLS = ("ring", "ulysses")

# The mark of a model's own causal attention with a dropout module on the
# probabilities, f(q, k, v, dropout), that answers to a TorchFunctionMode
# (torch.overrides.handle_torch_function), as tpctl's GPT's
# (models.gpt.dropped_attention): cp computes it across its ranks.
DROPPED_ATTENTION = "tpctl_dropped_attention"


class ContextRefused(TpctlError, RuntimeError):
    """An attention call context parallelism cannot make exact: refused
    (exit 2, one line, as a rewrite that is not the model)."""

    exit_code = EXIT_USAGE


class ContextParallel:
    """This rank's place among the ranks splitting its rows' sequences."""

    def __init__(self, mesh: Mesh, impl: str = "ring"):
        self.size, self.rank = mesh.layout.cp, mesh.cp_rank
        self.group, self.ranks = mesh.groups["cp"], mesh.group_ranks["cp"]
        self.impl = impl
        self.active = True  # off: the installed model computes whole sequences as without cp (`prove`)
        # Each attention module's sliding window (name -> positions), read
        # from the masks the family draws on whole sequences (`survey`): a
        # rank's forward sees only its own positions, and a window longer
        # than those is drawn there as no mask at all.
        self.windows: dict[str, int] = {}
        self._surveying: Optional[dict[str, set]] = None
        self._attention: set[str] = set()  # the attention modules `install` answers in

    # ---- data -------------------------------------------------------------
    def pieces(self) -> int:
        """Equal chunks a sequence is cut into (its length must divide)."""
        return 2 * self.size if self.impl == "ring" else self.size

    def positions(self, seq_len: int, rank: Optional[int] = None) -> torch.Tensor:
        """The global positions a rank (default this one) holds of a
        `seq_len` sequence, in the order its activations hold them."""
        if self.size == 1:
            return torch.arange(seq_len)
        chunk, rank = seq_len // self.pieces(), self.rank if rank is None else rank
        ids = zigzag_chunks(rank, self.size) if self.impl == "ring" else (rank,)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in ids])

    def split(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions of [rows, seq] token ids (inputs and targets
        alike: targets were shifted on the whole sequence, before the split)."""
        if self.size == 1:
            return rows
        return rows[:, self.positions(rows.shape[1]).to(rows.device)].contiguous()

    # ---- the model --------------------------------------------------------------
    def install(self, model: nn.Module, roles: dict[str, str]) -> nn.Module:
        """Position lookups by global index and attention across the cp
        ranks, in `model` (rewritten by its mode with the `roles` of its
        plan: module name -> role)."""
        if self.size == 1:
            return model
        whole = next((name for name, role in roles.items() if role == "whole"), None)
        if whole is not None:  # (a state passed along the ring would do it: not built)
            raise ValueError(f"cp={self.size} splits each sequence across ranks, and {whole} "
                             f"({type(model.get_submodule(whole)).__name__}) runs on the whole sequence "
                             "(a recurrence or a convolution over it, no split fits it): use cp=1")
        self._attention = set(attention_modules(roles))
        for name in self._attention:
            module = model.get_submodule(name)
            module.forward = _attending(module.forward, self, name)
        for name, module in list(model.named_modules()):
            if isinstance(module, ParallelDropout):
                parent, _, child = name.rpartition(".")
                # attention probabilities [batch, heads, queries, keys]; the stream [batch, positions, width]
                seq_dim = 2 if roles.get(name) == "attn_dropout" else 1
                setattr(model.get_submodule(parent), child, ContextDropout(module, self, seq_dim))
            elif roles.get(name) == "pos_embedding":
                module.register_forward_pre_hook(self._global_positions)
            elif type(module).__name__.endswith("RotaryEmbedding"):  # Hugging Face's: forward(x, position_ids)
                module.register_forward_pre_hook(self._global_rotary, with_kwargs=True)
        return model

    def prove(self, model: nn.Module, mode, rows: range, batch_size: int, vocab_size: int, seq_len: int,
              check: bool = True) -> float:
        """The start-up `survey` of the family's windows at `seq_len`, then
        the proof of cp's attention and positions (as
        parallel/verify/proof.py proves the tensor rewrite): a short probe
        batch (`rows` of a `batch_size` global batch of 2 x pieces()
        positions, the same ids on every rank) through the installed model
        on this rank's positions, against the same model run on the whole
        sequences with cp off; the largest relative difference of the
        logits at the positions both hold (the tensor mode may split the
        logits' sequence too). check=False: the survey alone (0.0). Every
        rank must call it; in eval mode, without gradients."""
        from tpctl.parallel.roles.plan import logits_of

        def probe(length: int) -> torch.Tensor:
            ids = torch.randint(0, vocab_size, (batch_size, length), generator=torch.Generator().manual_seed(0))
            return ids[rows.start:rows.stop]

        device = next(model.parameters()).device
        training = [m.training for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                self.survey(model, mode.split_input(probe(seq_len)).to(device))
                if not check:
                    return 0.0
                ids = probe(2 * self.pieces())
                self.active = False
                whole = logits_of(model(mode.split_input(ids).to(device)))
                self.active = True
                mine = logits_of(model(mode.split_input(self.split(ids)).to(device)))
        finally:
            self.active = True
            for m, was in zip(model.modules(), training):
                m.training = was
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], ids.shape[1])
        at_whole, at_mine = mode.split_target(pos)[0].tolist(), mode.split_target(self.split(pos))[0].tolist()
        common = [(at_whole.index(p), i) for i, p in enumerate(at_mine) if p in at_whole]
        if not common:
            return 0.0
        want = whole[:, [w for w, _ in common]].float()
        got = mine[:, [i for _, i in common]].float()
        return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

    def survey(self, model: nn.Module, inputs: torch.Tensor) -> None:
        """Each attention module's window (`windows`), from the mask the
        family hands torch's attention in a forward of whole sequences
        `inputs` (the training length: a window that cuts is drawn as a
        band). Only the masks are wanted: the attention answers zeros
        (`_Attend`), and the forward stops once every attention module has
        attended (no LM head, no logits of the whole length)."""
        self.active, self._surveying = False, {}
        try:
            model(inputs)
        except _Surveyed:
            pass
        finally:
            seen, self.active, self._surveying = self._surveying, True, None
        self.windows = {name: next(iter(w)) for name, w in seen.items() if len(w) == 1 and None not in w}

    def surveyed(self, name: str, attn_mask) -> None:
        """Record the window of a mask module `name` draws on a whole
        sequence (None: plain causal, no mask, or another kind of mask,
        which `attend` refuses); raises _Surveyed once every attention
        module has been seen."""
        window = None if attn_mask is None else band_window(attn_mask)
        self._surveying.setdefault(name, set()).add(window)
        if self._attention <= self._surveying.keys():
            raise _Surveyed

    def _global_positions(self, module: nn.Module, args: tuple):
        """A lookup of local positions 0..L-1 made a lookup of the global
        positions this rank holds (not the positions in their documents,
        data.documents: those are counted on the whole sequence)."""
        if not self.active or docs_.current() is not None:
            return None
        pos, *rest = args
        table = self.positions(pos.shape[-1] * self.size).to(pos.device)
        return (table[pos], *rest)

    def _global_rotary(self, module: nn.Module, args: tuple, kwargs: dict):
        """A rotary table's position ids (its second argument) made global
        (data.documents: left to the documents' hook, which feeds each
        position's index in its document, counted on the whole sequence)."""
        if not self.active or docs_.current() is not None:
            return None
        if len(args) > 1:
            return (args[0], self._global_positions(module, args[1:])[0], *args[2:]), kwargs
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": self._global_positions(module, (kwargs["position_ids"],))[0]}
        return None

    def attend_dropped(self, q, k, v, dropout: nn.Module) -> torch.Tensor:
        """A model's attention with dropout (marked DROPPED_ATTENTION) of this
        rank's positions: the whole sequence's keys gathered
        (context_attention.gathered_attention)."""
        seq_len = q.shape[-2] * self.size
        held = torch.cat([self.positions(seq_len, r) for r in range(self.size)]).to(q.device)
        documents = docs_.current()
        if documents is not None:
            documents.check(q)
        return gathered_attention(q, k, v, dropout, self.group, held, self.positions(seq_len).to(q.device),
                                  None if documents is None else documents.doc)

    def attend(self, name: str, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> torch.Tensor:
        """torch's scaled_dot_product_attention of this rank's positions,
        computed across the cp ranks (data.documents: the mask of the
        forward's documents, each pair of chunks masked by their documents)."""
        window = self.windows.get(name)
        if window is not None and (attn_mask is None or plain_causal(attn_mask) or band_window(attn_mask) is not None):
            # The family's window, drawn over this rank's positions as if
            # they were the whole sequence: computed on global positions.
            attn_mask, is_causal = None, True
        else:
            window = None
        documents = docs_.current()
        # (In a Hugging Face model's forward also its plain causal call: Documents.takes.)
        if documents is not None and documents.takes(name, attn_mask, is_causal):
            documents.check(q, name)
            attn_mask, is_causal, doc = None, True, documents.doc
        else:
            doc = None
        why = "a mask" if attn_mask is not None else "dropout" if dropout_p else None if is_causal else "is_causal=False"
        if why is not None:
            raise ContextRefused(f"cp={self.size}: {name} calls attention with {why}; context parallelism "
                                 "computes causal attention without dropout only")
        if enable_gqa and k.shape[1] != q.shape[1]:  # each shared key/value head repeated for its query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        with docs_.answering(documents if doc is not None else None):  # its own attention calls are not the model's
            if self.impl == "ring":
                return ring_attention(q, k, v, self.group, self.ranks, self.rank, scale, doc, window)
            return ulysses_attention(q, k, v, self.group, self.size, scale, doc, window)


class _Surveyed(Exception):
    """Every attention module's mask has been read: the survey's forward
    stops (ContextParallel.survey)."""


class ContextDropout(ParallelDropout):
    """Dropout whose mask is drawn by global position: each cp rank draws
    the mask of the whole sequence (its generator in the state the other cp
    ranks' is in, as one process's would be) and keeps the rows of the
    positions it holds along `seq_dim`. So a cp run drops what the same
    layout without cp drops, and mode=none what one process drops."""

    def __init__(self, inner: ParallelDropout, cp: ContextParallel, seq_dim: int):
        super().__init__(inner.p, inner.generator)
        self.cp, self.seq_dim = cp, seq_dim

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        whole = list(x.shape)
        whole[self.seq_dim] *= self.cp.size
        keep = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.p, generator=self.generator)
        return keep.index_select(self.seq_dim, self.cp.positions(whole[self.seq_dim]).to(x.device))

    def extra_repr(self) -> str:
        return f"p={self.p}, positions along dim {self.seq_dim} of cp={self.cp.size}"


def attention_modules(roles: dict[str, str]) -> list[str]:
    """The attention modules of a role plan: the parents of their output
    projections (`attn_out`), the modules whose forward calls attention."""
    return sorted({name.rpartition(".")[0] for name, role in roles.items() if role == "attn_out"})


class _Attend(TorchFunctionMode):
    """Inside one attention module's forward: its call of
    scaled_dot_product_attention answered across the cp ranks."""

    def __init__(self, cp: ContextParallel, name: str):
        super().__init__()
        self.cp, self.name = cp, name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.cp.active:  # the survey of whole sequences: the mask read, nothing computed
            if func is F.scaled_dot_product_attention or getattr(func, DROPPED_ATTENTION, False):
                q, v = args[0], args[2]
                mask = (kwargs or {}).get("attn_mask", args[3] if len(args) > 3 else None)
                documents = docs_.current()
                if documents is not None:  # answered here, not by the documents' mask: their guard counts it
                    documents.attended += 1
                self.cp.surveyed(self.name, mask if func is F.scaled_dot_product_attention else None)
                return q.new_zeros(*q.shape[:-1], v.shape[-1])
            return func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.cp.attend(self.name, *args, **(kwargs or {}))
        if getattr(func, DROPPED_ATTENTION, False):
            self.calls += 1
            return self.cp.attend_dropped(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.calls = 0
        return super().__enter__()


def _attending(forward, cp: ContextParallel, name: str):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not cp.active:
            if cp._surveying is None:  # the proof's run of whole sequences
                return forward(*args, **kwargs)
            with _Attend(cp, name):  # the survey: the masks read, nothing computed
                return forward(*args, **kwargs)
        with _Attend(cp, name) as attend:
            out = forward(*args, **kwargs)
        if attend.calls == 0:  # it attended by other means, over this rank's positions alone: never silently
            raise ContextRefused(f"cp={cp.size}: {name} ({type(forward.__self__).__name__}) computes attention "
                                 "without torch's scaled_dot_product_attention, which context parallelism replaces: "
                                 "expected cp=1")
        return out
    return run


def cost_context(add, cp: int, impl: str, kv_numel: int, layers: int) -> None:
    """The planner's count of one micro-batch's attention across `cp`
    ranks, `kv_numel` the elements of one of this rank's key (or query)
    blocks in one attention layer, as `add(kind, group, numel, times)`.
    Ring: the stacked key and value block passes cp-1 times in the forward,
    again cp-1 times in the backward, and its gradient accumulators cp
    times. Ulysses: q, k, v and the output each one all-to-all, forward and
    backward. Gather: see attention_path."""
    if impl == "ring":
        add("ring_pass", "cp", 2 * kv_numel, times=layers * (3 * cp - 2))
    elif impl == "gather":  # dropout on (attention_path): the stacked keys and values gathered, their gradient summed back
        add("all_gather", "cp", 2 * cp * kv_numel, times=layers)
        add("reduce_scatter", "cp", 2 * cp * kv_numel, times=layers)
    else:
        add("all_to_all", "cp", kv_numel, times=layers * 8)


def attention_path(impl: str, dropout: float) -> str:
    """The attention a cp run computes: with dropout, the gathered one
    (ContextParallel.attend_dropped, whatever context.impl), else `impl`."""
    return "gather" if dropout > 0 else impl
