"""The start-up proof of context parallelism (training/build.py
prove_context, ContextParallel.prove): the installed model's logits on each
rank's positions against the same model on whole sequences with cp off;
a split that is not exact is refused before step 1, in one line."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from tpctl.parallel.layout import Layout

LLAMA = {"model.arch": "llama", "model.bias": None}


def _proof(name: str, impl: str, local_positions: bool = False, **overrides):
    """build_run with verify on, in layout `name`: the proof's worst
    difference, or the refusal's line. `local_positions`: the position
    lookups left local (a split that is not exact)."""
    from conftest import build

    from tpctl.parallel.context.split import ContextParallel
    from tpctl.parallel.verify.proof import RewriteRefused

    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8, "context.impl": impl, **overrides})
    hook = ContextParallel._global_positions
    if local_positions:
        ContextParallel._global_positions = lambda self, module, args: None
    try:
        return build(cfg, Layout.parse(name), verify=True, step=False).cp_error
    except RewriteRefused as e:
        return str(e)
    finally:
        ContextParallel._global_positions = hook


@pytest.mark.parametrize("name,impl,model", [
    ("none-cp2-dp4", "ring", {}), ("1d-2-sp-cp2-dp2", "ring", {}), ("2d-4-cp2", "ulysses", {}),
    ("1d-2-cp4", "ring", LLAMA),
], ids=lambda v: v.get("model.arch", "gpt") if isinstance(v, dict) else str(v))
def test_the_start_up_proof_passes_an_exact_split(pool, name, impl, model):
    assert all(0 <= e < 1e-6 for e in pool.run(_proof, name, impl, timeout_s=600, **model))


def test_a_split_that_is_not_exact_is_refused_before_step_1(pool):
    lines = pool.run(_proof, "none-cp2-dp4", "ring", local_positions=True, timeout_s=600)
    assert len(set(lines)) == 1, lines  # every rank refuses alike
    assert lines[0].startswith("cp=2 context.impl=ring: the logits on each rank's positions differ from the whole "
                               "sequence's by ") and lines[0].endswith("expected cp=1"), lines[0]
