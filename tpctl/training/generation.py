"""Text out: autoregressive decoding of a parallelised model, in every mode.

Every rank of a tensor-parallel group runs the same loop; the model is the
one the rewrite produced, so each rank holds its shard of the weights and of
the activations. Three choices make that work and keep it exact:

* **The batch.** 2d, 2.5d and 3d split the rows (batch) of activations
  across ranks (docs/DESIGN.md, section 1): a forward needs a batch the mode
  can split, `geo.batch_split` rows (q in 2d, depth*q in 2.5d, q*q in 3d, 1
  in none and 1d). A single prompt is therefore *replicated* to that many
  identical rows, rather than padded with other text: every rank then holds
  a copy of the one sequence, so whichever row a rank holds, its last
  position's logits are the prompt's, no attention mask or padding token is
  needed, and the extra rows cost what the mode's split already costs (each
  rank computes one row of its own whatever the mode).
* **The next token.** Logits stay vocab-parallel as in training: a rank
  holds a block of the vocabulary. Only the last position of the first row is
  all-gathered over the ranks that share the rows (the loss group), so the
  group sees the whole (padded) vocabulary; padding and ids the tokenizer
  does not have are masked. The group's first rank picks the token (argmax,
  or a seeded draw) and broadcasts it over the tensor-parallel group, so every
  rank feeds the same token even where round-off differs between row blocks.
* **The cache.** tpctl's GPT takes a `KVCache` (models/gpt.py); a Hugging
  Face model takes its own `DynamicCache` (as `cache`; `past_key_values`
  before transformers 5 renamed it, the old name warning). Either one
  stores the keys and values this rank computed: its heads, its rows. Other
  models are re-run on the whole sequence at every step.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from tpctl.data.tokenizer import Tokenizer
from tpctl.models.gpt import GPT, KVCache
from tpctl.parallel import comm
from tpctl.parallel.roles.plan import logits_of
from tpctl.parallel.tensor.mode import ParallelMode

# ---- text as it comes -------------------------------------------------------

class TextStream:
    """Turns tokens into text as they come: what `push` returns is the text
    that became final. A token may end inside a character (bytes) or a word
    piece may change how the previous ones decode, so the generated ids are
    decoded whole and only a stable new suffix is released."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return ""  # an incomplete character: wait for the next token
        new, self.shown = text[len(self.shown):], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return new


# ---- one forward ------------------------------------------------------------

def is_hf(model: nn.Module) -> bool:
    """A transformers model (its forward takes a cache)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


class Stepper:
    """One forward of new tokens, with the model's KV cache when it has one
    (use_cache=False: every step re-runs the whole sequence)."""

    def __init__(self, model: nn.Module, use_cache: bool = True):
        self.model = model
        self.kind = "gpt" if isinstance(model, GPT) else "hf" if is_hf(model) else "plain"
        self.cached = use_cache and self.kind != "plain"
        if not self.cached:
            self.cache = None
        elif self.kind == "gpt":
            self.cache = KVCache(len(model.blocks))
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
            # transformers 5 renamed the forward's past_key_values to cache (the
            # old name warns on the user's terminal); 4.x takes only the old one.
            self.cache_key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gpt":
            return self.model(x, cache=self.cache) if self.cached else self.model(x)
        if self.kind == "hf":
            if self.cached:
                return logits_of(self.model(input_ids=x, use_cache=True, **{self.cache_key: self.cache}))
            return logits_of(self.model(input_ids=x, use_cache=False))
        return logits_of(self.model(x))


def local_input(mode: ParallelMode, ids: Sequence[int], device) -> torch.Tensor:
    """This rank's model input for one sequence `ids`, replicated to the
    `geo.batch_split` rows the mode splits the batch into (module docstring)."""
    count = mode.read_block()[1]
    rows = mode.geo.batch_split // count
    x = torch.tensor([list(ids)], dtype=torch.long, device=device).expand(rows, -1)
    return mode.split_input(x)


def last_logits(mode: ParallelMode, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The whole vocabulary's logits at the last position, from this rank's
    block of them (every row is the same sequence: take the first)."""
    row = logits[0, -1].float()
    group = mode.loss_group()
    if comm.group_size(group) > 1:
        # Each rank sends its block with its index, so the order does not
        # depend on how the group numbers its members.
        tagged = torch.cat([row.new_tensor([mode.vocab_block()]), row]).unsqueeze(0)
        blocks = comm.all_gather(tagged, group)
        row = blocks[blocks[:, 0].argsort()][:, 1:].reshape(-1)
    return row[:vocab]


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy (temperature 0) or a draw from the top_k most likely (0: all)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def max_positions(model: nn.Module) -> Optional[int]:
    """The longest sequence the model's positions allow (None: no limit known)."""
    if isinstance(model, GPT):
        return model.cfg.block_size
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    return None


def stop_ids(model: nn.Module, tokenizer: Optional[Tokenizer]) -> set[int]:
    """End-of-sequence ids: the model config's (as transformers' generate
    stops at them) and the tokenizer's."""
    out: set[int] = set()
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    out.update(eos if isinstance(eos, (list, tuple)) else [eos] if isinstance(eos, int) else [])
    if tokenizer is not None and tokenizer.eos_id is not None:
        out.add(tokenizer.eos_id)
    return out


@torch.no_grad()
def generate(model: nn.Module, mode: ParallelMode, prompt: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, use_cache: bool = True,
             vocab_limit: Optional[int] = None, stop: Sequence[int] = (),
             on_token: Optional[Callable[[int], None]] = None, vocab_size: Optional[int] = None) -> list[int]:
    """The tokens generated after `prompt` (at most max_new_tokens; fewer if a
    `stop` id comes, which is kept). Every rank of the mesh calls this; all
    return the same tokens; `on_token` is called on each as it is decided.
    `vocab_limit`: ids at or above it are never chosen (a tokenizer smaller
    than the model's vocabulary). `vocab_size`: the real vocabulary, where
    a mode pads the LM head (Run.vocab_size; default: the model's config's)."""
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    mesh = mode.mesh
    vocab = vocab_size or config_vocab(model)
    was_training = model.training
    model.eval()
    stepper = Stepper(model, use_cache)
    generator = torch.Generator().manual_seed(seed)
    chooser = mesh.group_ranks["tp"][0]  # decides each token for its group
    ids, new = list(prompt), []
    feed = list(prompt)
    try:
        for _ in range(max_new_tokens):
            logits = last_logits(mode, stepper(local_input(mode, feed, mesh.device)), vocab)
            if vocab_limit is not None and vocab_limit < logits.numel():
                logits[vocab_limit:] = float("-inf")
            token = torch.tensor([pick(logits, temperature, top_k, generator) if mesh.rank == chooser else 0],
                                 dtype=torch.long, device=mesh.device)
            comm.broadcast(token, chooser, mesh.tp_group)
            token = int(token.item())
            ids.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop:
                break
            feed = [token] if stepper.cached else ids
    finally:
        model.train(was_training)
    return new


def config_vocab(model: nn.Module) -> int:
    """The vocabulary of a model without an LM head role: its config's."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size"))


def sample(model: nn.Module, mode: ParallelMode, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
           vocab_size: Optional[int] = None) -> str:
    """A short greedy continuation of `prompt` as text (training's
    train.sample_every). The prompt keeps its end if it would not leave room
    in the model's positions; fewer tokens are generated if needed."""
    ids = tokenizer.encode(prompt) or [0]  # an empty prompt: start from id 0
    limit = max_positions(model)
    if limit is not None:
        ids = ids[-max(1, limit - max_new_tokens):]
        max_new_tokens = min(max_new_tokens, limit - len(ids))
    new = generate(model, mode, ids, max_new_tokens, vocab_limit=tokenizer.vocab_size,
                   stop=stop_ids(model, tokenizer), vocab_size=vocab_size)
    return tokenizer.decode(new)

