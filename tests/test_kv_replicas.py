"""Shared key/value heads (issue 46): with fewer key/value heads than blocks
of query heads, each is held by the ranks whose queries read it, and their
partial gradients are summed over exactly those ranks, in a process group
of their own (replicas.share_slices / sync_replicas) that no mesh group
names. The planner counts those sums (layer_comm.kv_replica_sums: the sets
of holders replicas.holder_pieces cuts from what every rank of the tensor
group holds, read from dry runs of those ranks, one call per set) and the
larger blocks a Linear holding whole shared heads sends
(layer_comm.held_out_features), so counted == planned (before: Qwen2 with
one key/value head in 1d-2-dp2, 22 all-reduces counted, 21 planned, 4224
bytes more; Qwen3 and Phi-3 with two in 1d-4, 22 vs 21 and 15 vs 14; in
2d-4, 17 all-reduces counted (4432 bytes) vs 15 (2384), broadcasts 204800
bytes vs 196608, reduces 151552 vs 145408; 2.5d-8-d2, 29 all-reduces vs 31,
broadcasts 155648 bytes vs 149504, reduces 102400 vs 98304; 3d-8, 18
all-reduces (2512 bytes) vs 16 (1488), all-gathers and reduce-scatters
120832 bytes each vs 117760). Where the sets differ by rank (gpt_bigcode's
fused multi-query [q | k | v] in 3d-8) each rank has its own plan
(SplitPlan.comm_of; before, rank 0's for all: ranks 4-7 counted 19
all-reduces of 9104 bytes against 18 of 7056 planned).
"""

from __future__ import annotations

import pytest
from test_families_anymodel import trains_like_mode_none

pytest.importorskip("transformers")

# One key/value head shared by both ranks (and, with two stages, on each
# stage); two shared by pairs of four ranks, as separate projections beside
# per-head norms (qwen3), in a fused [q | k | v] projection whose query rows
# are no one else's (phi3), and under a norm over all heads of k (olmo2).
# One key/value head in 2d, 2.5d and 3d: each Linear's blocks of the whole
# head, its weight's rows and its bias summed over different sets of ranks;
# in 2d and 3d also in a fused [q | k | v] projection (gpt_bigcode,
# multi-query), where in 3d the ranks' sets differ (rank 4 sums one more
# than rank 0: each rank is compared with its own plan, SplitPlan.comm_of).
CASES = [("qwen2_kv1", "1d-2-dp2"), ("qwen2_kv1", "1d-2-pp2-dp2"), ("qwen3", "1d-4"), ("phi3", "1d-4"),
         ("olmo2", "1d-4"), ("qwen2_kv1", "2d-4"), ("qwen2_kv1", "2.5d-8-d2"), ("qwen2_kv1", "3d-8"),
         ("gpt_bigcode", "2d-4"), ("gpt_bigcode", "3d-8")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_shared_key_value_heads_train_like_mode_none_and_send_what_is_planned(pool, none_curves, family, key):
    trains_like_mode_none(pool, none_curves, family, key)


def test_a_key_value_replica_set_is_sized_and_placed_as_a_block_of_the_grid():
    """The planner's group of a replica set is of its own size (the wire
    bytes' factor) and spans nodes as a block of consecutive grid positions
    does (planner.sent_s), not as the whole grid."""
    from tpctl.cost.planner import _Counter, _spans_nodes
    from tpctl.parallel.layout import Layout

    layout = Layout.parse("1d-4")
    counter = _Counter(layout)
    counter.add("all_reduce", "kv_replicas/2", 100)
    c = counter.comm[("all_reduce", "kv_replicas/2")]
    assert (c.calls, c.bytes, c.wire_bytes, c.group_size) == (1, 400, 400.0, 2)
    assert not _spans_nodes(layout, "kv_replicas/2", 2) and _spans_nodes(layout, "kv_replicas/4", 2)
    assert _spans_nodes(layout, "tp", 2)
