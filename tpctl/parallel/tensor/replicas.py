"""Who else on the tensor-parallel grid holds a parameter, beyond the
mode's own groups, and the sums over them: the replica sets of shared
key/value heads, learnt after the rewrite with one gather (`share_slices`),
and the once-per-replica-set sum of partial gradients (`sync_replicas`).
Data-parallel replicas are data_parallel.py's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.shard import RowReplicas, spec_of


def shared_params(model: nn.Module, names: list[str]) -> dict[str, nn.Parameter]:
    """{name: parameter} of the modules `names` (or parameters, by name) of `model`."""
    mine, params = {}, dict(model.named_parameters())
    for owner in names:  # a module's parameters, or one parameter by name
        for attr, p in ([("", params[owner])] if owner in params else model.get_submodule(owner).named_parameters()):
            mine[f"{owner}.{attr}" if attr else owner] = p
    return mine


def shard_key(spec) -> tuple:
    """What a rank holds of a parameter, as the ranks compare it: (its
    index in the other dimensions, its row ranges)."""
    return spec.index[1:], spec.index[0] or ((0, spec.full_shape[0]),)


def holder_pieces(everyone: list[dict], name: str, t: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, stop, holders) of tensor-parallel rank t's rows of parameter
    `name`, cut where the set of ranks holding them changes; `everyone`: each
    tp rank's {name: shard_key}. Pure: share_slices and the planner
    (cost/layer_comm.kv_replica_sums) read the same sets."""
    rest, rows = everyone[t][name]
    others = [(u, theirs[name][1]) for u, theirs in enumerate(everyone) if theirs.get(name, (None,))[0] == rest]
    cuts = sorted({x for _, ranges in others for a, b in ranges for x in (a, b)})
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for a, b in rows:
        points = [a] + [c for c in cuts if a < c < b] + [b]
        for lo, hi in zip(points, points[1:]):
            holders = tuple(u for u, ranges in others if any(x <= lo and hi <= y for x, y in ranges))
            if out and out[-1][1] == lo and out[-1][2] == holders:
                out[-1] = (out[-1][0], hi, holders)
            else:
                out.append((lo, hi, holders))
    return out


def share_slices(model: nn.Module, names: list[str], mesh: Mesh) -> None:
    """The parameters of modules `names` hold key/value heads shared by
    several ranks (fewer heads than the split): every rank of the
    tensor-parallel group holding the same rows (output features) of the
    same parameter, with the same other dimensions, is one of their
    replicas, each with the gradient of its own query heads (and rows),
    summed over exactly those ranks. A fused projection also holds rows of
    its own (its query heads): its rows then carry their replicas run by run
    (ShardSpec.row_replicas). Who holds what is learnt with one gather over
    the group; the replica groups are made once per mesh."""
    mine = shared_params(model, names)
    everyone = comm.all_gather_object({name: shard_key(spec_of(p)) for name, p in mine.items()}, mesh.tp_group)
    # Every rank makes every set's group, in one order (process groups are collective).
    sets = sorted({h for t, theirs in enumerate(everyone) for name in theirs
                   for _, _, h in holder_pieces(everyone, name, t)})
    if mesh.layout.pp > 1:  # (stages hold different modules, a hybrid's mixers in one: every stage makes
        # every stage's groups, new_group being collective over the world; rewrite.py calls this on every rank)
        sets = sorted({h for theirs in comm.all_gather_object(sets) for h in theirs})
    groups = mesh.tp_subgroups(sets)
    for name, p in mine.items():
        spec, mine_pieces = spec_of(p), holder_pieces(everyone, name, mesh.tp_rank)
        if len({h for _, _, h in mine_pieces}) == 1:  # one replica set for the whole shard
            group, ranks = groups[mine_pieces[0][2]]
            p.tpctl_spec = dataclasses.replace(spec, replica_ranks=tuple(ranks), partial_grad=len(ranks) > 1,
                                               replica_group=group)
            continue
        runs, at = [], 0
        for lo, hi, holders in mine_pieces:
            group, ranks = groups[holders]
            runs.append(RowReplicas(at, at + hi - lo, tuple(ranks), group))
            at += hi - lo
        index = (tuple((lo, hi) for lo, hi, _ in mine_pieces),) + spec.index[1:]
        p.tpctl_spec = dataclasses.replace(spec, index=index, replica_ranks=(), partial_grad=False,
                                           replica_group=None, row_replicas=tuple(runs))


def sync_replicas(params) -> None:
    """Sum every gradient of `params` (a model, or parameters) that is a
    partial sum, over exactly the ranks of the tensor-parallel grid that
    hold its other parts, once (per the parameter's ShardSpec). Data-parallel
    replicas are not this function's: data_parallel.DataParallel reduces
    across them."""
    buckets: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in (params.parameters() if isinstance(params, nn.Module) else params):
        spec = spec_of(p)
        for piece, group in spec.partial_parts(p.grad) if spec is not None and p.grad is not None else ():
            buckets.setdefault(id(group), (group, []))[1].append(piece)
    # One order on every rank (shared key/value heads give ranks different
    # sets of groups, which must never be entered in crossing orders).
    for group, grads in sorted(buckets.values(), key=lambda b: dist.get_process_group_ranks(b[0])):
        comm.all_reduce_coalesced(grads, group)
