"""A layout's one rendering (parallel/layout.py): `Layout.name`, the short
name `Layout.parse` reads back, and `Layout.label()`, the same fields for
people; what prints a layout (the planner, a sweep's skipped jobs, bench)
calls these."""

from __future__ import annotations

import pytest

from tpctl.parallel.layout import ZERO_STAGES, Layout, layouts_of


def _every_layout(worlds=range(1, 17)):
    for world in worlds:
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            for layout in layouts_of(world, pp):
                for cp in (1, 2):
                    for zero in ZERO_STAGES:
                        yield layout.replace(cp=cp, zero=zero)


def test_every_layout_reads_back_from_its_name():
    seen = 0
    for layout in _every_layout():
        assert Layout.parse(layout.name) == layout, layout
        seen += 1
    assert seen > 1000


def test_names_and_labels_tell_every_layout_apart():
    layouts = set(_every_layout(range(1, 9)))
    assert len({layout.name for layout in layouts}) == len(layouts)
    assert len({layout.label() for layout in layouts}) == len(layouts)


@pytest.mark.parametrize("layout,name,label", [
    (Layout(), "none", "none size=1"),
    (Layout(dp=8), "none-dp8", "none size=1 dp=8"),
    (Layout("2d", 4, dp=2), "2d-4-dp2", "2d size=4 dp=2"),
    (Layout("1d", 2, seq_parallel=True, cp=2), "1d-2-sp-cp2", "1d size=2 sp cp=2"),
    (Layout("2.5d", 8, 2, dp=2, zero=2), "2.5d-8-d2-dp2-z2", "2.5d size=8 depth=2 dp=2 zero=2"),
    (Layout("3d", 8, pp=2, dp=2, zero=1), "3d-8-pp2-dp2-z1", "3d size=8 pp=2 dp=2 zero=1"),
])
def test_name_and_label_show_the_same_fields(layout, name, label):
    assert (layout.name, layout.label()) == (name, label)


def test_a_label_renders_a_config_it_refuses():
    """A sweep's skipped job is named by its label, whatever its values."""
    assert Layout("4d", 3, pp=0).label() == "4d size=3 pp=0"


def test_a_name_parse_refuses_says_what_it_takes():
    with pytest.raises(ValueError, match="'x2' is not a size, d<depth>, sp, pp<N>, cp<N>, dp<N> or z<stage>"):
        Layout.parse("1d-x2")


def test_a_sweep_names_each_skipped_job_by_its_whole_layout(tmp_path, capsys):
    """Two jobs that differ only in cp are two different lines."""
    from tpctl.commands.train import _check_jobs
    from tpctl.config import CONFIG_NAME

    checked = _check_jobs(["mode=1d,2d", "size=2", "cp=1,2", "data=synthetic", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          True, CONFIG_NAME, None, True, dry_run=True)
    assert checked.status == 0
    skipped = [line.split(":", 2)[1].strip() for line in capsys.readouterr().err.splitlines()
               if line.startswith("tpctl: skipping") and "mode=2d" in line]  # (2d needs a square grid)
    assert skipped == ["skipping job 2 (mode=2d size=2)", "skipping job 3 (mode=2d size=2 cp=2)"]


def test_bench_reads_layout_names():
    """A bench mode is a layout's short name; one naming a mode alone runs
    on the bench's group (`1d+sp`, the old spelling, still reads as `1d-sp`)."""
    from tpctl.cost.measure import is_layout_name, layout_of

    assert layout_of("1d-sp", 4, None, pp=2) == layout_of("1d+sp", 4, None, pp=2) == Layout("1d", 4, pp=2, seq_parallel=True)
    assert layout_of("2.5d", 8, None) == Layout("2.5d", 8, 2)
    assert layout_of("none", 4, None, pp=2) == layout_of("plain", 4, None) == Layout()
    assert layout_of("dtensor", 4, None) == Layout("1d", 4)
    assert layout_of("2d-4-dp2-z3-blocking", 8, None) == Layout("2d", 4, dp=2, zero=3)
    assert [is_layout_name(n) for n in ("1d", "1d-sp", "1d+sp-blocking", "none", "plain", "none-cp4", "1d-2", "1d-x")] \
        == [False, False, False, False, False, True, True, True]
