"""What the pipeline, ZeRO and the Hugging Face round trip let through
(issue 31): layout keys read as written, export's write failures, damaged
safetensors found before start, the bench's layout, dependencies' warnings
kept off the terminal, and dropout under pipeline stages. In-process where
possible; each CLI case is one short subprocess."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from cli_support import tpctl  # noqa: F401  (fixture)
from tpctl.config import compose_jobs
from tpctl.config.layout_checks import check_layout
from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout

# --------------------------------------------------------------------------
# Every integer layout key reaches validation as written
# --------------------------------------------------------------------------

LAYOUT_KEYS = ("size", "depth", "dp", "pp", "zero", "train.grad_accum", "train.batch_size",
               "pipeline.microbatches", "pipeline.virtual_stages")


@pytest.fixture(scope="module")
def plain_config() -> dict:
    """A composed config as a plain mapping: a key can then hold any value
    (a manifest's or a plan's config is untyped too), so what validation
    itself does with it is seen, not what Hydra's typing refused first."""
    return OmegaConf.to_container(compose_jobs(["data=synthetic", "model=gpt-tiny"])[0])


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, 2.0, True], ids=repr)
@pytest.mark.parametrize("key", LAYOUT_KEYS)
def test_every_layout_key_is_validated_as_written(plain_config, key, value):
    if key == "zero" and value == 0 and type(value) is int:
        pytest.skip("zero=0 is the default: no ZeRO")
    cfg = OmegaConf.create(plain_config)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        check_layout(cfg)
    assert e.value.key == key and e.value.value is value, str(e.value)


def test_a_layout_read_from_a_mapping_keeps_its_values():
    # `pp or 1` once made pp=0 one stage: the run said pp: 0, its summary pp: 1.
    assert Layout.from_config({"mode": "none", "pp": 0, "depth": 0, "zero": 0}).pp == 0
    assert Layout.from_config({"mode": "1d"}) == Layout("1d")  # keys a config predates: the defaults
    with pytest.raises(ConfigError, match=r"^invalid config: pp=0: expected a positive number of pipeline stages$"):
        Layout.from_config({"pp": 0}).validate()
