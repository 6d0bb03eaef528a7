"""The planner's hooks of a mode (`CostHooks`, which `mode.ParallelMode`
extends): what one micro-batch sends on a rank, layer by layer.

cost/planner.py (and cost/layer_comm.py, for the layers other than Linears)
calls them with `add(kind, group, numel, times=1, hidden=False)`, which
counts a collective over the named mesh group; they return the activation
elements kept for the backward (an estimate). Comm counts are exact:
tests/test_plan.py and tests/test_families_anymodel.py check them against
comm.STATS. The defaults are mode=none's (nothing is split, nothing is
sent), and, for the layers after `cost_loss`, those of a mode whose
stream is split by hidden features over `stream_group_name` (2d, 2.5d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# A set of ranks sharing a key/value head names no mesh group (a block of the
# tensor-parallel grid's positions, replicas.share_slices): the planner counts
# its sums over a group named by this prefix and the set's size
# (cost/layer_comm.kv_replica_sums; two sets of one size: two calls).
KV_REPLICAS = "kv_replicas/"


def kv_replicas_size(group: str) -> Optional[int]:
    """The ranks of a group kv_replica_sums named; None for a mesh group."""
    return int(group[len(KV_REPLICAS):]) if group.startswith(KV_REPLICAS) else None


@dataclass(frozen=True)
class ExpertsShape:
    """What the planner knows of an experts module (parallel/roles/experts.py):
    `experts` MLPs of `gate_up` -> `inner` features each (gate_up: the
    first product's outputs, [gate; up]), `routed` routing weights per row
    (its top-k), run by the mode's Linears (`own` False) or by the module's
    own forward (True: experts.OwnSplit); `rows` rows it computes per
    stream row (RolePlan.expert_rows)."""

    experts: int
    gate_up: int
    inner: int
    routed: int
    own: bool
    rows: int = 1


class CostHooks:
    # The group of the vocab-parallel cross entropy (loss_group), by name.
    loss_group_name: Optional[str] = None
    # The group of stream_group() (the ranks holding a row's other hidden
    # features), by name; None: a rank holds whole rows.
    stream_group_name: Optional[str] = None

    def recompute_comm_share(self, dropout: bool, kind: str) -> float:
        """The share of the mode's tensor-parallel collectives of `kind`
        that a checkpointed block's recomputation issues again: its
        forward's (half, where forward and backward mirror each other),
        less those after the block's last saved tensor, which torch's
        recomputation stops before (`dropout`: the model drops out, and a
        dropout after a block's output saves its mask)."""
        return 0.5

    def cost_rows(self, tokens: int) -> int:
        """Token rows of a micro-batch this rank computes on (of `tokens`,
        its replica's)."""
        return tokens

    def cost_hidden(self, hidden: int) -> int:
        """This rank's features of a hidden (or vocabulary) dimension where
        activations hold it."""
        return hidden

    def cost_vocab(self, vocab: int) -> int:
        """This rank's columns of the (padded) logits."""
        return self.cost_hidden(vocab)

    def cost_embedding(self, add, tokens: int, vocab: int, dim: int) -> None:
        """The lookup of `tokens` ids in a (padded) `vocab` x `dim` table."""

    def cost_norm(self, add, tokens: int, hidden: int, moments: int = 2) -> int:
        """A norm over the stream (`moments`: 2 a LayerNorm's, 1 an RMSNorm's)."""
        return 2 * self.cost_rows(tokens) * self.cost_hidden(hidden)

    def cost_proj_norm(self, add, tokens: int, role: str, moments: int) -> None:
        """A norm over all heads of q or k (`proj_norm`: OLMo-2's), over the
        output features of a Linear of `role` (`moments`: 2 a LayerNorm's, 1
        an RMSNorm's): the moments of its rows summed over the ranks
        splitting those features (mode.output_group), forward and backward
        (layers.SplitNorm), one call each however many ranks hold a shared
        key/value head. Nothing where the features are whole (mode=none)."""

    def cost_head_reduce(self, add, tokens: int, role: str, heads: int) -> None:
        """A per-head reduction (`head_reduce`: one value per head from a
        projection of `role`'s heads): its partial products of every head
        reduce-scattered over the ranks splitting that projection's output
        features (mode.output_group; backward: an all-gather), as
        tensor/head_reduce.HeadReduce. Nothing where they are whole."""

    def cost_linear(self, add, role: str, tokens: int, n: int, k: int) -> int:
        """A Linear of role `role`, k -> n features, on `tokens` rows."""
        return tokens * k

    def cost_linear_temporary(self, role: str, tokens: int, n: int, k: int) -> int:
        """Elements such a Linear holds for a moment beyond its output, what
        cost_linear keeps and its weight's gradient: blocks in flight and
        partial products of its forward or backward, whichever is larger
        (the memory check adds the largest of the rank's to its peak)."""
        return 0

    def cost_loss(self, add, tokens: int) -> None:
        """The vocab-parallel cross entropy: the row max, then (sum-exp,
        target logit, sum) over the ranks that share the rows."""
        if self.loss_group_name:
            rows = self.cost_rows(tokens)
            add("all_reduce", self.loss_group_name, rows)
            add("all_reduce", self.loss_group_name, 3 * rows)

    # ---- layers other than Linears (cost/layer_comm.py) ----------------
    def _cost_stream_gather(self, add, tokens: int, hidden: int, times: int = 1) -> None:
        """Whole hidden vectors of this rank's rows gathered over the
        stream's group (comm.gather_along; backward: reduce-scatter), or
        the adjoint pair."""
        if self.rewrites and self.stream_group_name:
            add("all_gather", self.stream_group_name, self.cost_rows(tokens) * hidden, times=times)
            add("reduce_scatter", self.stream_group_name, self.cost_rows(tokens) * hidden, times=times)

    def cost_latent(self, add, tokens: int, hidden: int) -> None:
        """The entry of a latent attention's down-projection: whole rows of
        its attention's rows (ParallelMode.attention_rows)."""
        self._cost_stream_gather(add, tokens, hidden)

    def cost_untrained(self, add, tokens: int, hidden: int) -> None:
        """A module returning indices (convert_untrained): the forward half
        of a latent's entry, whole rows of its attention's rows gathered
        without autograd. In every mode that half is its all-gathers (the
        reduce-scatters and 1d's all-reduce are their backward)."""
        self.cost_latent(lambda kind, *a, **k: add(kind, *a, **k) if kind == "all_gather" else None, tokens, hidden)

    def cost_router(self, add, tokens: int, hidden: int) -> None:
        """A router's input gathered to whole rows (ParallelMode.convert_router)."""
        self._cost_stream_gather(add, tokens, hidden)

    def cost_whole(self, add, tokens: int, hidden: int) -> None:
        """A module run whole (tensor/whole.py): its input gathered to whole
        rows; its output's cut sends nothing."""
        self._cost_stream_gather(add, tokens, hidden)

    def own_forward_ways(self) -> int:
        """The ranks that split a module run by its own forward (a mixer by
        heads, roles/mixers.py; experts by inner features, roles/experts.py):
        those holding one row's hidden features (1d: all of them; 2d, 2.5d,
        3d: q)."""
        return self.geo.size if self.replicated_activations else self.geo.q

    def cost_mixer(self, add, tokens: int, hidden: int) -> None:
        """A mixer split by heads (ParallelMode.convert_mixer): whole rows
        gathered on entry, the partial output reduce-scattered onto this
        rank's hidden block (and their adjoints in the backward)."""
        self._cost_stream_gather(add, tokens, hidden, times=2)

    def cost_mixer_reduce(self, add, tokens: int, width: int) -> None:
        """A sum inside a mixer split by channels (Mamba-1's x_proj, its
        `width` outputs: tensor/whole.py's _sum_reduced; or a norm's
        `width` moments, MiniMax's over every head: _sum_moments) over the
        ranks splitting it, whole rows of this rank's rows: an all-reduce
        both ways (every rank reads the sum for its own channels)."""
        if self.rewrites and self.stream_group_name:
            add("all_reduce", self.stream_group_name, self.cost_rows(tokens) * width, times=2)

    def cost_sliced_replicas(self, role: str) -> Optional[str]:
        """The mesh group whose ranks hold the same slice of a latent
        up-projection (`role` latent_up: by heads) or of an experts module
        run by its own forward (experts: by the stream's hidden blocks);
        None: no rank shares it. 2d, 2.5d: the ranks of a hidden block."""
        return getattr(self, "hidden_replica", None)

    def cost_rows_like_output(self, add, role: str, tokens: int, width: int) -> None:
        """A per-row tensor of `width` features brought from the rows a
        `role` Linear is fed to those its output holds
        (ParallelMode.rows_like_output): nothing where they are the same."""

    def cost_experts(self, add, tokens: int, hidden: int, e: ExpertsShape) -> int:
        """An experts module: its own forward between a gather of whole rows
        and a reduce-scatter of its partial output onto this rank's hidden
        block (convert_own_experts); else (experts.DenseExperts) one product
        of the mode's Linear over every expert's gate/up stacked along the
        output features, the (rows, experts) routing weights brought to its
        output's rows (3d's cube returns other rows than its input's), then
        one product over every expert's down stacked along the input
        features."""
        if e.own:
            self._cost_stream_gather(add, tokens, hidden, times=2)  # the entry's gather, the exit's reduce-scatter
            return self.cost_rows(tokens) * hidden
        act = self.cost_linear(add, "mlp_in", tokens, e.experts * e.gate_up, hidden)
        self.cost_rows_like_output(add, "mlp_in", tokens, e.experts)
        return act + self.cost_linear(add, "mlp_out", tokens, hidden, e.experts * e.inner)
