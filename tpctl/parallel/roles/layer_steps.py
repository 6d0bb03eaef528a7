"""The steps of role inference (parallel/roles/inference.py) for the layers
that are not Linears: norms (on the stream, over each head, over one
projection's output, lists of per-head norms), dropouts, tables of
constants, elementwise modules, an attention module's own per-head
parameters, modules the forward never calls (`uncalled`), tensors as wide as the stream a module holds itself and adds to
(or multiplies into) it outside any Linear; any other layer with parameters
is a problem (a module on the
stream holding one may then run whole: roles/whole.py). A mixin of
inference._Inference: each step reads and writes its state.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from tpctl.parallel.roles.plan import blocks_of
from tpctl.parallel.roles.probes import norm_width


class LayerSteps:
    def norms_dropouts_and_tables(self) -> None:
        """Norms (on the stream, over each head, over one projection's
        output), dropouts, position tables; other layers with parameters
        are unsupported."""
        modules, roles, hidden = self.modules, self.roles, self.hidden
        head_dims = {h.head_dim for h in self.heads.values()}
        projections = {i for i, n in enumerate(self.nodes) if n.kind == "linear"
                       and roles.get(n.name) in ("qkv", "attn_in", "latent_up")}
        # What tables of constants were computed from (a rotary table takes
        # the stream only for its dtype and positions): a head's features
        # rotated by them still come from the projection alone.
        tabled = frozenset().union(*(n.inputs for n in self.nodes if n.kind == "table"))
        for n in self.nodes:
            if n.kind == "norm":
                self.norm(n, projections, head_dims, tabled)
            elif n.kind == "dropout":
                self.assign(n.name, "attn_dropout" if n.inputs & self.inner else "dropout")
            elif n.kind == "table" and n.inputs <= self.input_ids and hidden is not None and n.shape[-1:] == (hidden,):
                # A table of constants indexed by positions and as wide as the
                # stream, added to it (XGLM's sinusoidal positions): each rank
                # keeps its piece of the stream's layout.
                self.assign(n.name, "pos_table")
            elif n.kind == "elementwise" and n.name not in roles:
                self.elementwise(n)
            elif n.kind == "layer" and n.name not in roles and self.own_params(n):
                continue  # (learned sinks split with their heads, a bias added to the stream with the stream)
            elif n.kind in ("layer", "experts") and n.name not in roles:
                self.problems.setdefault(n.name, f"an unsupported layer type ({type(modules[n.name]).__name__}) "
                                                 "with parameters")
        self.stream_buffers()

    def own_params(self, n) -> bool:
        """Whether every parameter a module holds itself (outside its
        children) is placed: one entry per query head along its first
        dimension (or per key/value head: Doge's A), held by an attention
        module (GPT-OSS's sinks: recorded on its Heads), or one per feature of the stream (recorded in
        `stream_tensors`, held as the stream's features are) where the
        module is the stream's: an attention module returning it for its
        block to add (GPT-NeoX-Japanese's dense_bias), a block of the stack
        or a module holding the stack (a learned per-feature residual rate:
        Doge, Dory), a module holding no other module (Zaya's residual
        scales). Inside another module (a mixer's per-head A_log as long as
        the stream is wide) it is no feature of the stream: a problem."""
        owner = n.name
        heads = self.heads.get(owner)
        own = dict(self.modules[owner].named_parameters(recurse=False))
        per_head = tuple(a for a, p in own.items() if heads is not None and p.dim() >= 1
                         and p.shape[0] in (heads.heads, heads.kv_heads))
        wide = tuple(a for a, p in own.items() if a not in per_head and self.stream_wide(p, buffer=False)
                     and (a in n.returns if heads is not None else self.streams(owner)))
        if not own or len(per_head) + len(wide) != len(own):
            return False
        if per_head:
            self.heads[owner] = dataclasses.replace(heads, params=per_head)
        if wide:
            self.stream_tensors[owner] = wide
        return True

    def streams(self, name: str) -> bool:
        """Whether a module is the stream's own: a block of the stack, a
        module holding the stack, or one holding no other module."""
        stack = blocks_of(self.model, self.roles)
        if stack is not None and (name.rpartition(".")[0] == stack or stack == name or stack.startswith(f"{name}.")
                                  or not name):
            return True
        return not any(True for _ in self.modules[name].children())

    def stream_wide(self, t, buffer: bool) -> bool:
        """A parameter of one entry per feature of the stream, or a table of
        constants whose last dimension is the stream's features (a
        sinusoidal position table [positions, hidden]; not a vector: a
        rotary embedding's inv_freq may be as long as the stream is wide)."""
        hidden = self.hidden
        if hidden is None or not t.is_floating_point():
            return False
        return t.dim() >= 2 and t.shape[-1] == hidden if buffer else tuple(t.shape) == (hidden,)

    def stream_buffers(self) -> None:
        """Buffers of constants as wide as the stream that a module with no
        role holds itself and reads in its own forward (CTRL's model adds
        `pos_encoding[position_ids]` to the embeddings): each rank reads its
        features of them, as its piece of the stream holds. What a role's
        module holds is its layer's (a position table's own forward: its
        output cut), what lies inside one its owner's."""
        placed = tuple(f"{name}." for name, role in self.roles.items() if name)
        for name, module in self.modules.items():
            if name in self.roles or (placed and name.startswith(placed)):
                continue
            wide = tuple(a for a, b in module._buffers.items() if b is not None and self.stream_wide(b, buffer=True))
            if wide:
                self.stream_tensors[name] = self.stream_tensors.get(name, ()) + wide

    def elementwise(self, n) -> None:
        """A module measured to act on each element alone (tracing.py): its
        parameters are replicated, so each must be one scalar, or, on the
        stream, one per feature of it (held as the stream's features are)."""
        module = self.modules[n.name]
        per_feature = tuple(a for a, p in module.named_parameters() if p.numel() != 1 and self.stream_wide(p, False))
        if per_feature and not n.inputs & self.inner:  # one per feature of the stream: held as its features are
            self.stream_tensors[n.name] = per_feature
        wide = [f"{a} {tuple(p.shape)}" for a, p in module.named_parameters()
                if p.numel() != 1 and a not in self.stream_tensors.get(n.name, ())]
        if wide:
            self.problems[n.name] = (f"an elementwise module ({type(module).__name__}) with parameters of more than "
                                     f"one element ({', '.join(wide)}): tpctl replicates only scalar ones")
        else:
            self.assign(n.name, "split_elementwise" if n.inputs & self.inner else "elementwise")

    def norm(self, n, projections: set[int], head_dims: set[int], tabled: frozenset = frozenset()) -> None:
        """One norm: on the stream (`norm`), over each head (`head_norm`,
        one weight row per head or one for all), or over all heads of one
        projection's output (`proj_norm`)."""
        heads, modules, hidden = self.heads, self.modules, self.hidden
        size = norm_width(modules[n.name])
        source = self.node_name[next(iter(n.inputs))] if len(n.inputs) == 1 and n.inputs <= projections else None
        weight = getattr(modules[n.name], "weight", None)
        if n.inputs and n.inputs <= self.latent_nodes:  # a latent attention's latent: whole on every rank
            self.assign(n.name, "latent_norm")
        elif weight is not None and weight.dim() == 2:  # one row per head
            owner = next((o for o in heads if n.name.startswith(o + ".")), None)
            if owner is not None and n.inputs and n.inputs <= projections and size == heads[owner].head_dim \
                    and weight.shape[0] in (heads[owner].heads, heads[owner].kv_heads):
                self.assign(n.name, "head_norm")
                self.head_rows[n.name] = owner
            else:
                self.problems[n.name] = f"a norm with a {tuple(weight.shape)} weight that is not one row per head"
        elif n.inputs and (n.inputs <= projections or (n.inputs - tabled and n.inputs - tabled <= projections
                                                       and n.inputs & tabled)) and size in head_dims:
            # A norm over each head of q or k (Qwen3 style), before or after
            # their rotation (NanoChat): whole heads live on one rank, so it
            # runs as written.
            self.assign(n.name, "head_norm")
        elif source is not None and size == modules[source].out_features:
            # A norm over all heads of one projection's output (OLMo-2's
            # q/k norms): split as that output is.
            self.assign(n.name, "proj_norm")
            if self.sources.setdefault(n.name, source) != source:
                self.problems[n.name] = f"one norm over the outputs of both {self.sources[n.name]} and {source}"
        elif n.inputs & self.inner or (hidden is not None and size not in (None, hidden)):
            self.problems[n.name] = (f"a norm over {size} features inside attention or the MLP: neither per head "
                                     f"({', '.join(map(str, sorted(head_dims))) or 'no heads'}) nor over one "
                                     "projection's output")
        else:
            self.assign(n.name, "norm")

    def norm_lists(self) -> None:
        """Lists of one per-head norm per head: a rank keeps its heads'."""
        heads = self.heads
        for name, module in self.modules.items():
            if isinstance(module, nn.ModuleList) and len(module) > 1 \
                    and all(self.roles.get(f"{name}.{i}") == "head_norm" for i in range(len(module))):
                owner = next((o for o in heads if name.startswith(o + ".")), None)
                if owner is not None and len(module) in (heads[owner].heads, heads[owner].kv_heads):
                    self.head_lists[name] = owner
                else:
                    self.problems[name] = f"a list of {len(module)} per-head norms that matches no attention's head count"

    def uncalled(self) -> None:
        """Dropout modules the traced forward never called (used only in
        training, or only for their `p`): split activations inside
        attention. Other modules never called that hold parameters are
        problems."""
        roles, calls = self.roles, self.calls
        owners = tuple(f"{owner}." for owner in self.heads)
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Dropout) and name not in roles:
                self.assign(name, "attn_dropout" if owners and name.startswith(owners) else "dropout")
        called = {id(p) for name in calls  # (what an experts module, a router or a module run whole holds runs inside it)
                  for p in self.modules[name].parameters(recurse=roles.get(name) in ("experts", "router", "whole",
                                                                                      "untrained"))}
        # (a module holding parameters its called forward never reads: held whole, never trained, as in mode=none)
        called |= {id(getattr(self.modules[name], a)) for name, attrs in self.unread.items() for a in attrs}
        for name, module in self.model.named_modules():
            own = list(module.parameters(recurse=False))
            if name and name not in calls and own and not all(id(p) in called for p in own):
                self.problems.setdefault(name, "never called in the forward")
