"""Which role each module of a model plays, read from the data flow of one
traced forward (parallel/roles/tracing.py), never from module names:

  * an Embedding fed the model's input ids is the token `embedding`; one fed
    anything else (positions) is a `pos_embedding`;
  * matrix products between two activations are attention: the Linears
    feeding them are `qkv` (one fused Linear) or `attn_in` (separate q, k, v),
    the Linear reading their result is `attn_out`;
  * the Linear whose output is the model's output is the `lm_head`;
  * of the other Linears, one reading another's output is `mlp_out`, the ones
    it reads (a gated pair too) are `mlp_in`;
  * LayerNorm / RMSNorm modules on the residual stream are `norm`; Dropout
    modules are `dropout` on the stream and `attn_dropout` on split activations.

Anything that fits no role is reported with the reason, so a mode that would
have to split it refuses the model before training instead of training it
wrongly.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.experts import expert_count, experts_layout, own_split, routed_per_row, rows_per_row
from tpctl.parallel.roles.fused import FusedLayout, ProbeError, attention_layout, mlp_layout
from tpctl.parallel.roles.plan import (HEAD_ATTRS, RATIO_ATTRS, ROLES, Heads, RolePlan, blocks_of, common_parent,
                                      head_attrs, named_stack)
from tpctl.parallel.roles.layer_steps import LayerSteps
from tpctl.parallel.roles.probes import is_experts, on_cpu
from tpctl.parallel.roles.tracing import TRACE_BATCH, TRACE_SEQ, per_head_args, random_draws, trace
from tpctl.parallel.roles.whole import fundamental, run_whole, untrained_modules, whole_roots


@on_cpu
def resolve_plan(model: nn.Module, plan: Optional[dict[str, str]] = None) -> RolePlan:
    """The roles of `model`'s modules: from `plan` (module-name patterns ->
    roles) if given, else from the model's `tp_plan`, else traced."""
    given = plan if plan is not None else getattr(model, "tp_plan", None)
    if plan is None and isinstance(given, dict) and not set(given.values()) <= set(ROLES):
        given = None  # another library's plan (transformers' colwise/rowwise styles): trace instead
    if not given:
        return infer_plan(model)
    for role in given.values():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} in the plan; roles are {', '.join(ROLES)}")
    roles = {}
    for name, _ in model.named_modules():
        role = next((r for pattern, r in given.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if role is not None and name:
            roles[name] = role
    # The draws are found by tracing on token ids: a model fed something else
    # (a given plan is its only way in) is left to the start-up check.
    fed_ids = any(isinstance(m, nn.Embedding) for m in model.modules())
    draws = random_draws(model, _vocab(model)) if fed_ids else []
    return RolePlan(roles, "plan" if plan is not None else "tp_plan", draws=draws)


def _vocab(model: nn.Module) -> int:
    """Token ids the model accepts: below its smallest embedding table."""
    return min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)


def infer_plan(model: nn.Module, vocab_size: Optional[int] = None) -> RolePlan:
    """Trace `model` and assign a role to every module that has one."""
    if vocab_size is None:
        vocab_size = _vocab(model)
    found = _infer(model, vocab_size)
    untrained = untrained_modules(found)
    if untrained:  # again, each one opaque node: its Linears pair with nothing around it
        found = _infer(model, vocab_size, untrained=untrained)
    roots = whole_roots(found)
    if roots:  # again, each module run whole for a problem of its own one opaque node: what it holds
        # pairs with nothing outside it (roots found for the confusion around it may then vanish)
        roots = {r: why for r, why in roots.items() if fundamental(why.partition(": ")[2])} or roots
        found = _infer(model, vocab_size, frozenset(roots), untrained)
        roots.update(whole_roots(found))
    found.whole = roots
    run_whole(found, roots)
    return found.plan(vocab_size)


def _infer(model: nn.Module, vocab_size: int, opaque: frozenset = frozenset(),
           untrained: frozenset = frozenset()) -> "_Inference":
    """One trace (modules `opaque` run whole, `untrained` ones run as
    written: each one node) and every step of inference."""
    found = _Inference(model, vocab_size, opaque, untrained)
    for ops in found.attention_units():
        found.attention(ops)
    found.lm_head()
    found.mlps()
    found.embeddings()
    found.experts()
    found.stray_linears()
    found.norms_dropouts_and_tables()
    found.uncalled()
    found.norm_lists()
    return found


class _Inference(LayerSteps):
    """One traced forward and the roles, layouts and problems read from it
    so far. The steps run in one order (infer_plan): each reads the roles
    the ones before it assigned."""

    def __init__(self, model: nn.Module, vocab_size: int, opaque: frozenset = frozenset(),
                 untrained: frozenset = frozenset()):
        self.model = model
        self.first_inputs: dict[str, tuple] = {}  # module -> the inputs of its first call, for probes
        self.flows: dict = {}  # module -> tracing.Flow of its first call
        self.unread: dict[str, tuple] = {}  # module -> its own parameters the forward never reads (tracing.trace)
        self.frozen: list[str] = []  # RolePlan.frozen
        self.nodes, self.out, self.calls = trace(model, vocab_size, inputs=self.first_inputs, flows=self.flows,
                                                 opaque=opaque | untrained, unread=self.unread)
        self.whole: dict[str, str] = {}  # modules run whole (roles/whole.py) -> the problem that made them
        self.roles: dict[str, str] = {name: "whole" for name in opaque} | {name: "untrained" for name in untrained}
        self.layouts: dict[str, Any] = {}
        self.probed: dict[tuple, Any] = {}  # one probe per kind of module
        self.problems: dict[str, str] = {}
        self.modules = dict(model.named_modules())
        self.node_name = {i: n.name for i, n in enumerate(self.nodes)}
        self.kind_of = {i: n.kind for i, n in enumerate(self.nodes)}
        self.heads: dict[str, Heads] = {}
        self.units: dict[str, list[str]] = {}  # attention / MLP module -> its Linears
        self.rest: set[str] = set()  # the Linears no attention nor LM head holds
        self.hidden: Optional[int] = None  # the residual stream's width (the token embedding's)
        self.inner: set[int] = set()  # nodes inside attention or an MLP
        self.input_ids: set[int] = set()
        self.widths: dict[str, dict[str, int]] = {}
        self.routed: dict[str, int] = {}  # experts module -> routing weights per row (RolePlan.routed)
        self.expert_rows: dict[str, int] = {}  # experts module -> its rows per stream row (RolePlan.expert_rows)
        self.sources: dict[str, str] = {}
        self.head_rows: dict[str, str] = {}
        self.head_lists: dict[str, str] = {}
        self.latent_nodes: set[int] = set()  # the calls of latent attentions' down-projections
        self.stream_tensors: dict[str, tuple] = {}  # RolePlan.stream_tensors

    def assign(self, name: str, role: str) -> None:
        if self.roles.get(name, role) != role:
            self.problems[name] = f"used as both {self.roles[name]} and {role}"
        self.roles[name] = role

    def linears(self, ids) -> list[int]:
        """The Linear nodes among `ids`, looking through norms (a per-head
        q/k norm between a projection and the attention)."""
        out = []
        for j in ids:
            if self.kind_of[j] == "linear":
                out.append(j)
            elif self.kind_of[j] == "norm":
                out.extend(k for k in self.nodes[j].inputs if self.kind_of[k] == "linear")
        return out

    def probe(self, key: tuple, run):
        """A layout measured once per kind of module (the layers of a model
        are alike); a ProbeError is the refusal's reason."""
        if key not in self.probed:
            try:
                self.probed[key] = run()
            except ProbeError as e:
                self.probed[key] = e
            except Exception as e:  # the module's forward did not run on the probe
                self.probed[key] = ProbeError(f"measuring its layout failed: {type(e).__name__}: {e}")
        return self.probed[key]

    def attention_units(self) -> list[list[int]]:
        """Attention units: attention ops chained through each other (q k^T,
        then the probabilities times v), each unit's ops in call order."""
        nodes = self.nodes
        attention = [i for i, n in enumerate(nodes) if n.kind == "attention"]
        unit_of: dict[int, int] = {}
        for i in attention:  # in call order: an op reads only earlier ones
            linked = {unit_of[j] for j in nodes[i].inputs if j in unit_of}
            unit_of[i] = min(linked, default=i)
            for k, u in unit_of.items():
                if u in linked:
                    unit_of[k] = unit_of[i]
        ops_of_unit: dict[int, list[int]] = {}
        for i, u in unit_of.items():
            ops_of_unit.setdefault(u, []).append(i)
        for ops in ops_of_unit.values():
            ops.sort()
        return list(ops_of_unit.values())

    def attention(self, ops: list[int]) -> None:
        """One attention unit: its projections (`qkv`, or `attn_in` and
        `attn_out`), the layout of a fused one, and its heads."""
        nodes, node_name, modules, problems = self.nodes, self.node_name, self.modules, self.problems
        assign, linears, layouts = self.assign, self.linears, self.layouts
        members = set(ops)
        feeders: list[str] = []
        for i in ops:
            for j in linears(nodes[i].inputs):
                if node_name[j] not in feeders:
                    feeders.append(node_name[j])
        readers = [n.name for n in nodes if n.kind == "linear" and n.inputs & members]
        if not feeders or len(set(readers)) != 1:
            for name in feeders + readers:
                problems[name] = "an attention whose projections tpctl cannot recognise"
            return
        out_proj = readers[0]
        if set().union(*(nodes[j].inputs for j in self.calls[out_proj])) - members:
            problems[out_proj] = "reads the attention's output mixed with other activations"
        first = nodes[ops[0]]
        owner = common_parent(feeders + [out_proj])
        reducers = self.head_reductions(feeders, first)
        feeders = [name for name in feeders if name not in reducers]
        latent = self.latent_projections(owner, out_proj, skip=reducers)
        if latent:
            self.latent_attention(first, owner, feeders, latent, out_proj)
            return
        head_dim = first.shape[-1] if len(first.shape) == 4 else None
        q_name = next((node_name[j] for j in linears(first.operands[0])), feeders[0])
        k_name = next((node_name[j] for j in linears(first.operands[1])), None) \
            if len(first.operands) > 1 else None
        if len(feeders) == 1:
            assign(feeders[0], "qkv")
            fused = feeders[0]
            rel = fused[len(owner) + 1:] if owner else fused
            layout = self.probe((type(modules[owner]), rel, modules[fused].weight.shape),
                                lambda: attention_layout(modules[owner], rel, *self.first_inputs[owner]))
            if isinstance(layout, ProbeError):
                problems[fused] = f"a fused projection whose layout tpctl cannot measure: {layout}"
                return
            layouts[fused] = layout
            q_width, kv_width = layout.width(0), layout.width(1)
            head_dim = q_width // layout.units[0]
        else:
            for name in feeders:
                assign(name, "attn_in")
            q_width = modules[q_name].out_features
            kv_width = modules[k_name].out_features if k_name in modules else q_width
        assign(out_proj, "attn_out")
        if head_dim is None:  # no 4-D query: look for a stored head count
            n = next((v for a, v in vars(modules[owner]).items() if a in HEAD_ATTRS[:4] and isinstance(v, int)), None)
            head_dim = q_width // n if n else None
        if not head_dim or q_width % head_dim or kv_width % head_dim:
            problems[owner] = "cannot tell the attention's head size from its forward"
            return
        h, kv = q_width // head_dim, kv_width // head_dim
        attrs = head_attrs(modules, owner, feeders + [out_proj], h, kv, q_width, kv_width)
        if kv < h:  # separate key/value projections: heads of their own, which may be shared
            for name in feeders:
                if name != q_name and name not in layouts and modules[name].out_features == kv_width:
                    layouts[name] = FusedLayout.heads(kv_width, kv, "k" if name == k_name else "v")
        self.heads[owner] = Heads(h, kv, head_dim, attrs, per_head_args(self.first_inputs.get(owner), h))
        self.units[owner] = feeders + list(reducers) + [out_proj]
        for name, source in reducers.items():
            self.assign(name, "head_reduce")
            self.sources[name] = source

    def head_reductions(self, feeders: list[str], first) -> dict[str, str]:
        """{Linear: the projection it reads}: of an attention's feeders,
        those reading one other feeder's output (a projection the attention
        reads itself) as its heads' features, one output per head of it
        (Doge's dt_proj: a dynamic-mask rate per value head), read by no
        Linear. A latent attention's up-projections read a latent no
        attention reads, and make many features per head."""
        head_dim = first.shape[-1] if len(first.shape) == 4 else None
        out = {}
        for name in feeders:
            read = self.read_linears(name)
            source = next(iter(read)) if len(read) == 1 else None
            if source is None or source not in feeders or source == name or not head_dim:
                continue
            linear, src = self.modules[name], self.modules[source]
            if linear.in_features == src.out_features and src.out_features == linear.out_features * head_dim \
                    and not any(name in self.read_linears(other) for other in feeders):
                out[name] = source
        return out

    def read_linears(self, name: str) -> set[str]:
        """The Linears whose output a Linear's calls read (through norms)."""
        return {self.node_name[j] for i in self.calls[name] for j in self.linears(self.nodes[i].inputs)}

    def latent_projections(self, owner: str, out_proj: str, skip=()) -> list[str]:
        """The Linears inside attention module `owner` whose output another
        Linear inside it reads (through norms): the down-projections of a
        latent attention (DeepSeek's MLA), in call order. A plain
        attention's projections read the stream, which comes from outside."""
        inside = [n.name for n in self.nodes if n.kind == "linear" and owner and n.name.startswith(owner + ".")
                  and n.name != out_proj and n.name not in skip]
        inside = list(dict.fromkeys(inside))
        read = set().union(*(self.read_linears(name) for name in inside)) if inside else set()
        return [name for name in inside if name in read]

    def latent_attention(self, first, owner: str, feeders: list[str], latent: list[str], out_proj: str) -> None:
        """A latent attention: its down-projections and their norms run
        whole (on whole rows of the rows a rank's attention holds), its
        up-projections and any plain projection split by heads (each head's
        rotary and other features together: a head's features are
        contiguous), the output projection as in any attention. Its heads
        are those of the queries' [batch, heads, seq, head_dim] operand."""
        modules = self.modules
        if len(first.shape) != 4:
            self.problems[owner] = "a latent attention whose queries are not [batch, heads, seq, head_dim]"
            return
        heads, head_dim = first.shape[1], first.shape[-1]
        for name in latent:
            self.assign(name, "latent")
        for name in feeders:
            if name in latent:
                continue
            up = bool(self.read_linears(name) & set(latent))
            self.assign(name, "latent_up" if up else "attn_in")
            if modules[name].out_features % heads:
                self.problems[name] = f"{modules[name].out_features} output features are not {heads} heads"
            elif up:
                self.layouts[name] = FusedLayout.heads(modules[name].out_features, heads, "q")
        self.assign(out_proj, "attn_out")
        self.latent_nodes.update(i for name in latent for i in self.calls[name])
        attrs = {a: v for a, v in vars(modules[owner]).items() if isinstance(v, int) and not isinstance(v, bool)
                 and (a in HEAD_ATTRS[:8] and v == heads or a in RATIO_ATTRS and v == 1)}
        self.heads[owner] = Heads(heads, heads, head_dim, attrs, per_head_args(self.first_inputs.get(owner), heads))
        self.units[owner] = list(dict.fromkeys(latent + feeders + [out_proj]))

    def lm_head(self) -> None:
        """The LM head: the Linear the logits come from."""
        out = self.out
        heads_out = [self.node_name[i] for i in out if self.kind_of[i] == "linear"]
        if len(heads_out) == 1 and not (out - {self.calls[heads_out[0]][-1]}):
            self.assign(heads_out[0], "lm_head")
        else:
            self.problems["<output>"] = "the model's output does not come from one Linear (the LM head)"

    def mlps(self) -> None:
        """The MLPs: of the other Linears, a reader of another's output is
        `mlp_out`, what it reads `mlp_in` (with its layout, if fused)."""
        nodes, node_name, kind_of, modules, calls = self.nodes, self.node_name, self.kind_of, self.modules, self.calls
        rest = self.rest = {n.name for n in nodes if n.kind == "linear" and n.name not in self.roles}
        block_of = self._block_of()
        for name in sorted(rest):
            inputs = set().union(*(nodes[i].inputs for i in calls[name]))
            # (an MLP lives in one block: a Linear reading the stream a block
            # before it wrote, through the residual sum, pairs with nothing)
            fed_by = {node_name[i] for i in inputs if kind_of[i] == "linear" and node_name[i] in rest
                      and block_of(node_name[i]) == block_of(name)}
            if not fed_by:
                continue
            if inputs - {i for i in inputs if node_name[i] in fed_by}:
                self.problems[name] = "reads an MLP's hidden activation mixed with other activations"
            self.assign(name, "mlp_out")
            for source in fed_by:
                self.assign(source, "mlp_in")
            owner = common_parent(sorted(fed_by) + [name])
            self.units[owner] = sorted(fed_by) + [name]
            for source in fed_by:
                if modules[source].out_features == modules[name].in_features:
                    continue  # one hidden feature per output feature: split in blocks
                rel, out_rel = (n[len(owner) + 1:] if owner else n for n in (source, name))
                layout = self.probe((type(modules[owner]), rel, modules[source].weight.shape),
                                    lambda: mlp_layout(modules[owner], rel, out_rel, *self.first_inputs[owner]))
                if isinstance(layout, ProbeError):
                    self.problems[source] = f"a fused projection whose layout tpctl cannot measure: {layout}"
                else:
                    self.layouts[source] = layout

    def _block_of(self):
        """module name -> the block of the model's stack holding it (None
        outside the stack, or without one)."""
        found = named_stack(self.model)
        if found is None or not found[0]:
            return lambda name: None
        prefix = f"{found[0]}."
        return lambda name: name[len(prefix):].split(".")[0] if name.startswith(prefix) else None

    def embeddings(self) -> None:
        """Embeddings: the one fed token ids (the vocabulary-sized one, if
        positions are derived from the ids too), and positions; the stream's
        width follows from the token embedding."""
        nodes, roles, modules = self.nodes, self.roles, self.modules
        self.inner = {i for i, n in enumerate(nodes) if n.kind == "attention"
                      or (n.kind == "linear" and roles.get(n.name) in ("qkv", "attn_in", "mlp_in", "latent", "latent_up",
                                                                "head_reduce"))}
        input_ids = self.input_ids = {i for i, n in enumerate(nodes) if n.kind == "input"}
        token = [n.name for n in nodes if n.kind == "embedding" and n.inputs & input_ids]
        if len(set(token)) > 1:  # positions derived from the ids: prefer the vocabulary-sized table
            head = next((modules[n] for n, r in roles.items() if r == "lm_head"), None)
            vocab = [t for t in token if head is not None and modules[t].num_embeddings == head.out_features]
            token = vocab[:1] or token[:1]
        self.hidden = modules[token[0]].embedding_dim if token else None
        for n in nodes:
            table = modules[n.name] if n.kind == "embedding" else None
            if table is not None and n.name not in token and self.hidden is not None \
                    and table.embedding_dim != self.hidden and not table.weight.requires_grad:
                # A frozen table not as wide as the stream (RoFormer's sinusoidal
                # rotary table, one head wide, which every head reads): no split
                # of the stream's features applies; whole on every rank, exact
                # as nothing trains it (RolePlan.frozen).
                self.frozen.append(f"{n.name}.weight")
            elif table is not None:
                self.assign(n.name, "embedding" if n.name in token else "pos_embedding")

    def experts(self) -> None:
        """Mixture-of-experts blocks: the experts module, and beside it (in
        the module holding it) the routers: modules reading the whole
        residual stream with an (outputs x hidden) weight whose output feeds
        no Linear (the router proper, a shared expert's gate)."""
        nodes, modules, roles, hidden = self.nodes, self.modules, self.roles, self.hidden
        moe_blocks = []
        for n in nodes:
            if n.kind == "experts" and n.name not in roles:
                layout = self.probe((type(modules[n.name]), n.name), lambda: experts_layout(modules[n.name])[2])
                if isinstance(layout, ProbeError):  # run by its own forward, split as measured
                    call = self.first_inputs.get(n.name, ((), {}))
                    layout = self.probe((type(modules[n.name]), n.name, "own"),
                                        lambda: own_split(modules[n.name], *call, hidden, TRACE_BATCH * TRACE_SEQ))
                if isinstance(layout, ProbeError):
                    self.problems[n.name] = f"a mixture of experts tpctl cannot shard: {layout}" \
                        if is_experts(modules[n.name]) or "routing" not in str(layout) else \
                        f"an unsupported layer type ({type(modules[n.name]).__name__}) with parameters"
                    continue
                self.assign(n.name, "experts")
                self.layouts[n.name] = layout
                self.routed[n.name] = routed_per_row(*self.first_inputs.get(n.name, ((), {})), hidden)
                rows = rows_per_row(*self.first_inputs.get(n.name, ((), {})), hidden, TRACE_BATCH * TRACE_SEQ)
                if rows > 1:
                    self.expert_rows[n.name] = rows
                moe_blocks.append(n.name.rpartition(".")[0])
                block = modules[moe_blocks[-1]]
                self.widths[moe_blocks[-1]] = {a: v for a, v in vars(block).items()
                                               if isinstance(v, int) and not isinstance(v, bool) and v == hidden}
        experts_of = {n.rpartition(".")[0]: expert_count(modules[n]) for n, r in roles.items() if r == "experts"}
        for n in nodes:
            weight = getattr(modules.get(n.name), "weight", None)
            block = next((b for b in moe_blocks if n.name.startswith(f"{b}." if b else "")), None)
            # (a router holding other ≥2-d parameters beside its weight looks like experts until measured)
            if n.kind in ("linear", "layer", "experts") and n.name not in roles and block is not None \
                    and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == hidden \
                    and (n.kind != "experts" or weight.shape[0] == experts_of[block]):
                self.problems.pop(n.name, None)
                self.assign(n.name, "router")

    def stray_linears(self) -> None:
        """Why each Linear still without a role has none."""
        nodes, kind_of, roles = self.nodes, self.kind_of, self.roles
        stack, block_of = named_stack(self.model), self._block_of()
        feeding = {j for i, n in enumerate(nodes) if n.kind == "linear" and roles.get(n.name) in ("qkv", "attn_in")
                   for j in n.inputs | {k for m in n.inputs if kind_of[m] == "norm" for k in nodes[m].inputs}}
        for name in self.rest:
            if name in roles:
                continue
            if feeding & set(self.calls[name]):
                self.problems[name] = ("a Linear feeding the attention's projections (a low-rank or latent projection, "
                                       "as DeepSeek's multi-head latent attention): tpctl splits attention by heads, "
                                       "and its output has none")
            elif stack is not None and block_of(name) is None and self.changes_width(name):
                # (ELECTRA's, RemBERT's LM head transform: hidden -> the output embedding's width)
                linear = self.modules[name]
                self.problems[name] = (f"a Linear after the model's blocks changing the width the LM head reads "
                                       f"({linear.in_features} -> {linear.out_features} features): tpctl runs such a "
                                       "transform whole only where it keeps the stream's width")
            elif stack is not None and block_of(name) is None:  # (BERT's LM head's transform: run whole, whole.py)
                self.problems[name] = "a Linear outside the attention / MLP / LM head pattern, after the model's blocks"
            else:
                self.problems[name] = "a Linear outside the attention / MLP / LM head pattern"

    def changes_width(self, name: str) -> bool:
        """Whether a Linear's output is not as wide as its input (the
        stream's width as its input has it)."""
        linear = self.modules[name]
        return linear.in_features != linear.out_features

    def plan(self, vocab_size: int) -> RolePlan:
        """The RolePlan, roles in the model's module order. A layer tpctl has
        no rule for says more than the Linears around it that fit no pattern
        because of it (a linear-attention mixer): its problem first, the
        outermost first."""
        ordered = {name: self.roles[name] for name in self.modules if name in self.roles}
        unsupported = lambda item: item[1].startswith("an unsupported layer type")  # noqa: E731
        problems = dict(sorted(self.problems.items(),
                               key=lambda item: (0, item[0].count(".")) if unsupported(item) else (1, 0)))
        return RolePlan(ordered, "inferred", self.heads, problems, blocks_of(self.model, ordered), self.units,
                        self.layouts, self.sources, self.head_lists, self.head_rows,
                        random_draws(self.model, vocab_size), self.widths, self.routed, self.whole,
                        {n: m.tpctl_traced_width for n, m in self.modules.items() if n in ordered
                         and getattr(m, "tpctl_traced_width", None) is not None}, self.stream_tensors,
                        {n: len(c) for n, c in self.calls.items() if n in ordered and len(c) > 1},
                        {n: r for n, r in self.expert_rows.items() if n in ordered},
                        tuple(f"{n}.{a}" for n, attrs in self.unread.items() for a in attrs),
                        tuple(dict.fromkeys(self.frozen)))
