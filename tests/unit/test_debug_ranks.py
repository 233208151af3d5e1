"""`ranks(...)` of the debugger's `cast`, in Monarch's syntax: what each form selects, and a
rank, an axis or a coordinate the mesh does not have named in a ValueError."""

from __future__ import annotations

import pytest

from raymesh._src.debugger.ranks import select
from raymesh.debug import parse_ranks

MESH = {"hosts": 2, "gpus": 4}  # ranks 0..7, row-major


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [
        ("ranks(3)", [3]),
        ("ranks(1,4,6)", [1, 4, 6]),
        ("ranks(2:7:2)", [2, 4, 6]),
        ("ranks(:3)", [0, 1, 2]),
        ("ranks(5:)", [5, 6, 7]),
        ("ranks(:)", list(range(8))),
        ("0:2", [0, 1]),
        ("ranks(hosts=1)", [4, 5, 6, 7]),
        ("ranks(hosts=0, gpus=1:3)", [1, 2]),
        ("ranks(gpus=(0,3))", [0, 3, 4, 7]),
        (2, [2]),
        ([6, 1], [1, 6]),
        (range(0, 8, 4), [0, 4]),
    ],
)
def test_each_form_selects_the_ranks_monarch_would(spec, ranks):
    assert select(parse_ranks(spec), MESH) == ranks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ranks(8)", r"ranks\(8\): rank 8 does not exist; the mesh has 8 ranks \(0..7\)"),
        ("ranks(0:9)", "rank 8 does not exist"),
        ("ranks(nodes=0)", r"the mesh has no axis 'nodes' \(axes: \['hosts', 'gpus'\]\)"),
        ("ranks(gpus=4)", "gpus=4 does not exist; axis 'gpus' has size 4"),
    ],
)
def test_ranks_the_mesh_does_not_have_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        select(parse_ranks(spec), MESH)


@pytest.mark.parametrize("spec", ["ranks()", "ranks(a)", "ranks(1:2:3:4)", "ranks(-1)", "x=y=1"])
def test_text_that_is_not_ranks_says_which_forms_it_takes(spec):
    with pytest.raises(ValueError, match=r"write ranks\(3\), ranks\(1,4,6\)"):
        parse_ranks(spec)
