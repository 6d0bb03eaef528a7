"""The steps of role inference (parallel/roles/inference.py) for the layers
that are not Linears: norms (on the stream, over each head, over one
projection's output, lists of per-head norms), dropouts, tables of
constants, elementwise modules, an attention module's own per-head
parameters; any other layer with parameters is a problem (a module on the
stream holding one may then run whole: roles/whole.py). A mixin of
inference._Inference: each step reads and writes its state.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

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
            elif n.kind == "layer" and n.name in self.heads and self.per_head_params(n.name):
                continue  # (an attention module holding learned sinks: split with its heads)
            elif n.kind in ("layer", "experts") and n.name not in roles:
                self.problems.setdefault(n.name, f"an unsupported layer type ({type(modules[n.name]).__name__}) "
                                                 "with parameters")

    def per_head_params(self, owner: str) -> bool:
        """Whether every parameter an attention module holds itself has one
        entry per query head along its first dimension (GPT-OSS's sinks);
        if so they are recorded on its Heads."""
        heads = self.heads[owner]
        own = dict(self.modules[owner].named_parameters(recurse=False))
        if not own or any(p.dim() < 1 or p.shape[0] != heads.heads for p in own.values()):
            return False
        self.heads[owner] = dataclasses.replace(heads, params=tuple(own))
        return True

    def elementwise(self, n) -> None:
        """A module measured to act on each element alone (tracing.py): its
        parameters are replicated, so each must be one scalar."""
        module = self.modules[n.name]
        wide = [f"{a} {tuple(p.shape)}" for a, p in module.named_parameters() if p.numel() != 1]
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
