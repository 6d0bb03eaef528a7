import pytest
from test_families import _curve, deviation

@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4", "3d-8", "1d-2-pp2-dp2"])
def test_oss(pool, key):
    want = pool.run(_curve, "none-dp4", "oss_experts")[0]
    got = pool.run(_curve, key, "oss_experts")[0]
    assert got[0] != "refused", got
    print("DEV", key, deviation(want, got))
