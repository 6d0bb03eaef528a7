"""Mechanisms rather than classes (issue 32): latent attention, expert
weights fused into a model's own module, elementwise modules with learned
parameters. Each family (tests/hf_families.py: tiny, random init,
transformers' defaults) trains a few steps in 1d, 2d, 3d and 1d with two
pipeline stages within 1e-4 of mode=none, on the shared pool, in process.
"""

from __future__ import annotations

import pytest

from conftest import layouts
from test_families import _curve, deviation

pytest.importorskip("transformers")

KEYS = ("1d-2-dp4", "2d-4-dp2", "3d-8", "1d-2-pp2-dp2")
STEPS = 4
FAMILIES = ("deepseek_v3", "dbrx", "apertus")


@pytest.fixture(scope="module")
def reference(pool):
    return {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_mechanism_trains_like_mode_none(pool, reference, family, key):
    if family not in reference:
        reference[family] = pool.run(_curve, "none-dp8", family, STEPS)[0]
    want = reference[family]
    got = pool.run(_curve, key, family, STEPS)[0]
    assert got[0] != "refused", got[1]
    loss, norm = deviation(want, got)
    assert len(got) == STEPS and loss < 1e-4 and norm < 1e-4, (loss, norm)
