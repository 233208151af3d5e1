"""Unit tests for `raymesh._src.shape`: extents, points and the slicing algebra of shapes."""

from __future__ import annotations

import itertools
import math

import pytest

from raymesh._src.shape import Extent, Point, Shape

# ---------------------------------------------------------------------------------------------
# Extent
# ---------------------------------------------------------------------------------------------


def test_extent_of_keeps_the_order_of_the_mapping():
    extent = Extent.of({"hosts": 2, "procs": 4})
    assert extent.labels == ("hosts", "procs")
    assert extent.sizes == (2, 4)


def test_extent_nelem_is_the_product_of_sizes():
    assert Extent.of({"a": 2, "b": 3, "c": 4}).nelem == 24


def test_extent_with_no_axes_has_one_element():
    extent = Extent((), ())
    assert extent.nelem == 1
    assert [p.coords for p in extent.points()] == [()]
    assert extent.point(0).rank == 0


def test_extent_is_a_mapping_of_axis_to_size():
    extent = Extent.of({"hosts": 2, "procs": 4})
    assert dict(extent) == {"hosts": 2, "procs": 4}
    assert extent["procs"] == 4
    assert len(extent) == 2
    assert list(extent) == ["hosts", "procs"]
    assert "hosts" in extent
    assert "gpus" not in extent
    assert extent.get("gpus") is None


def test_extent_lookup_of_an_unknown_axis_raises_key_error():
    with pytest.raises(KeyError, match="gpus"):
        Extent.of({"hosts": 2})["gpus"]


def test_extent_rejects_a_mismatched_number_of_labels_and_sizes():
    with pytest.raises(ValueError, match="2 axis names for 1 sizes"):
        Extent(("a", "b"), (2,))


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", None, True])
def test_extent_rejects_sizes_that_are_not_positive_ints(size):
    with pytest.raises(ValueError, match="sizes must be ints >= 1"):
        Extent(("procs",), (size,))


@pytest.mark.parametrize("label", ["", "1st", "two words", "a-b", 3])
def test_extent_rejects_labels_that_are_not_identifiers(label):
    with pytest.raises(ValueError, match="not a Python identifier"):
        Extent((label,), (2,))


def test_extent_rejects_duplicate_axis_names():
    with pytest.raises(ValueError, match="repeat a name"):
        Extent(("procs", "procs"), (2, 2))


def test_extent_repr_lists_axes_and_sizes():
    assert repr(Extent.of({"hosts": 2, "procs": 4})) == "Extent(hosts=2, procs=4)"


def test_extent_point_uses_row_major_order():
    extent = Extent.of({"hosts": 2, "procs": 3})
    assert extent.point(0).coords == (0, 0)
    assert extent.point(2).coords == (0, 2)
    assert extent.point(3).coords == (1, 0)
    assert extent.point(5).coords == (1, 2)


@pytest.mark.parametrize("sizes", [{"a": 1}, {"a": 5}, {"a": 2, "b": 3}, {"x": 3, "y": 1, "z": 4}])
def test_extent_point_of_rank_round_trips_through_point_rank(sizes):
    extent = Extent.of(sizes)
    for rank in range(extent.nelem):
        point = extent.point(rank)
        assert point.rank == rank
        assert point.extent == extent


def test_extent_points_are_in_rank_order():
    extent = Extent.of({"a": 2, "b": 3, "c": 2})
    points = list(extent.points())
    assert [p.rank for p in points] == list(range(extent.nelem))
    assert [p.coords for p in points] == list(itertools.product(range(2), range(3), range(2)))


@pytest.mark.parametrize("rank", [-1, 6, 100])
def test_extent_point_outside_the_extent_raises_index_error(rank):
    with pytest.raises(IndexError, match=f"rank {rank} is outside an extent of 6 elements"):
        Extent.of({"hosts": 2, "procs": 3}).point(rank)


# ---------------------------------------------------------------------------------------------
# Point
# ---------------------------------------------------------------------------------------------


def test_point_is_a_mapping_of_axis_to_coordinate():
    point = Extent.of({"hosts": 2, "procs": 4}).point(6)
    assert dict(point) == {"hosts": 1, "procs": 2}
    assert point["hosts"] == 1
    assert point["procs"] == 2
    assert len(point) == 2
    assert list(point) == ["hosts", "procs"]
    assert list(point.items()) == [("hosts", 1), ("procs", 2)]


def test_point_can_be_splatted_as_keyword_arguments():
    def f(*, hosts, procs):
        return hosts, procs

    point = Extent.of({"hosts": 2, "procs": 4}).point(5)
    assert f(**point) == (1, 1)


def test_point_lookup_of_an_unknown_axis_raises_key_error():
    point = Extent.of({"hosts": 2}).point(1)
    with pytest.raises(KeyError, match="gpus"):
        point["gpus"]


def test_point_rank_is_row_major_within_its_extent():
    extent = Extent.of({"a": 2, "b": 3, "c": 4})
    assert Point((1, 2, 3), extent).rank == 1 * 12 + 2 * 4 + 3


def test_point_repr_names_each_coordinate():
    assert repr(Extent.of({"hosts": 2, "procs": 4}).point(6)) == "Point(hosts=1, procs=2)"


def test_points_of_the_same_extent_and_coords_are_equal_and_hashable():
    extent = Extent.of({"hosts": 2, "procs": 4})
    assert extent.point(3) == Point((0, 3), extent)
    assert len({extent.point(3), Point((0, 3), extent), extent.point(4)}) == 2


# ---------------------------------------------------------------------------------------------
# Shape basics
# ---------------------------------------------------------------------------------------------


def test_shape_of_numbers_ranks_from_zero():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.ranks == tuple(range(8))
    assert shape.labels == ("hosts", "procs")


def test_shape_rejects_a_rank_count_that_does_not_match_the_extent():
    with pytest.raises(ValueError, match="3 ranks for"):
        Shape(Extent.of({"procs": 4}), (0, 1, 2))


def test_shape_size_without_an_axis_is_the_number_of_elements():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.size() == 8
    assert len(shape) == 8


def test_shape_size_of_an_axis_is_that_axis_length():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.size("hosts") == 2
    assert shape.size("procs") == 4


def test_shape_size_of_an_unknown_axis_names_it_and_the_available_axes():
    with pytest.raises(ValueError, match=r"unknown axis 'gpus'.*\['hosts', 'procs'\]"):
        Shape.of({"hosts": 2, "procs": 4}).size("gpus")


def test_shape_sizes_is_a_dict_of_axis_to_size():
    sizes = Shape.of({"hosts": 2, "procs": 4}).sizes
    assert sizes == {"hosts": 2, "procs": 4}
    assert list(sizes) == ["hosts", "procs"]


def test_shape_repr_lists_axes_and_sizes():
    assert repr(Shape.of({"hosts": 2, "procs": 4})) == "Shape(hosts=2, procs=4)"


def test_shape_points_pair_each_local_point_with_its_global_rank():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3))
    pairs = list(shape.points())
    assert [(dict(p), r) for p, r in pairs] == [
        ({"hosts": 0, "procs": 0}, 1),
        ({"hosts": 0, "procs": 1}, 2),
        ({"hosts": 1, "procs": 0}, 5),
        ({"hosts": 1, "procs": 1}, 6),
    ]
    assert [p.rank for p, _ in pairs] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Shape.slice
# ---------------------------------------------------------------------------------------------


def test_int_index_removes_the_axis():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=2)
    assert shape.labels == ("hosts",)
    assert shape.sizes == {"hosts": 2}
    assert shape.ranks == (2, 6)


def test_negative_int_index_counts_from_the_end():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.slice(procs=-1).ranks == shape.slice(procs=3).ranks == (3, 7)
    assert shape.slice(hosts=-2).ranks == (0, 1, 2, 3)


def test_int_index_on_every_axis_leaves_a_shape_with_no_axes():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(hosts=1, procs=3)
    assert shape.labels == ()
    assert shape.ranks == (7,)
    assert shape.size() == 1
    assert [(p.coords, r) for p, r in shape.points()] == [((), 7)]


def test_slice_keeps_the_axis_with_its_size_reduced():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3))
    assert shape.sizes == {"hosts": 2, "procs": 2}
    assert shape.ranks == (1, 2, 5, 6)


def test_slice_with_a_step_picks_every_nth_index():
    shape = Shape.of({"procs": 8}).slice(procs=slice(1, None, 3))
    assert shape.sizes == {"procs": 3}
    assert shape.ranks == (1, 4, 7)


def test_slice_with_negative_indices_counts_from_the_end():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(-2, None))
    assert shape.sizes == {"hosts": 2, "procs": 2}
    assert shape.ranks == (2, 3, 6, 7)


def test_slice_with_a_negative_step_reverses_the_axis():
    shape = Shape.of({"procs": 4}).slice(procs=slice(None, None, -1))
    assert shape.ranks == (3, 2, 1, 0)


def test_full_slice_keeps_the_shape_unchanged():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.slice(hosts=slice(None), procs=slice(None)) == shape


def test_slice_with_no_arguments_returns_an_equal_shape():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.slice() == shape


def test_slice_of_several_axes_combines_the_selections():
    shape = Shape.of({"hosts": 2, "gpus": 3, "procs": 4})
    sub = shape.slice(hosts=1, procs=slice(0, 4, 2))
    assert sub.sizes == {"gpus": 3, "procs": 2}
    # host 1 starts at 12; gpus stride 4; procs 0 and 2
    assert sub.ranks == (12, 14, 16, 18, 20, 22)


def test_keyword_order_of_slice_does_not_change_the_result():
    shape = Shape.of({"hosts": 2, "procs": 4})
    assert shape.slice(procs=slice(1, 3), hosts=1) == shape.slice(hosts=1, procs=slice(1, 3))


def test_slicing_a_slice_preserves_global_ranks():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3)).slice(hosts=1)
    assert shape.sizes == {"procs": 2}
    assert shape.ranks == (5, 6)


def test_slicing_a_slice_indexes_within_the_slice_not_the_original():
    shape = Shape.of({"procs": 8}).slice(procs=slice(2, 8, 2))  # ranks 2, 4, 6
    assert shape.slice(procs=1).ranks == (4,)
    assert shape.slice(procs=slice(1, None)).ranks == (4, 6)
    assert shape.slice(procs=-1).ranks == (6,)


def test_slicing_one_axis_twice_composes_the_selections():
    once = Shape.of({"procs": 10}).slice(procs=slice(1, 9))  # 1..8
    twice = once.slice(procs=slice(None, None, 3))
    assert twice.ranks == (1, 4, 7)


def test_slice_of_an_unknown_axis_names_it_and_lists_the_available_axes():
    shape = Shape.of({"hosts": 2, "procs": 4})
    with pytest.raises(ValueError) as info:
        shape.slice(gpus=0)
    message = str(info.value)
    assert "'gpus'" in message
    assert "['hosts', 'procs']" in message


def test_slice_of_an_axis_removed_by_an_earlier_int_index_is_unknown():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(hosts=0)
    with pytest.raises(ValueError, match=r"unknown axis 'hosts'.*\['procs'\]"):
        shape.slice(hosts=0)


@pytest.mark.parametrize("index", [4, 10, -5])
def test_out_of_range_int_index_names_the_value_and_the_valid_range(index):
    shape = Shape.of({"hosts": 2, "procs": 4})
    with pytest.raises(ValueError) as info:
        shape.slice(procs=index)
    message = str(info.value)
    assert f"procs={index}" in message
    assert "out of range" in message
    assert "0..3" in message


@pytest.mark.parametrize(
    "sel", [slice(2, 2), slice(3, 1), slice(4, None), slice(-1, 0), slice(0, 3, -1)]
)
def test_empty_slice_raises_value_error(sel):
    shape = Shape.of({"hosts": 2, "procs": 4})
    with pytest.raises(ValueError, match="selects nothing from axis 'procs' of size 4"):
        shape.slice(procs=sel)


def test_empty_slice_message_shows_the_slice_and_the_valid_indices():
    with pytest.raises(ValueError) as info:
        Shape.of({"procs": 4}).slice(procs=slice(1, 1, 2))
    message = str(info.value)
    assert "procs=1:1:2" in message
    assert "0..3" in message


@pytest.mark.parametrize("sel", ["0", 1.0, [0, 1], (0,), True, False])
def test_selection_of_the_wrong_type_raises_type_error(sel):
    with pytest.raises(TypeError, match="slice axes with an int or a slice"):
        Shape.of({"hosts": 2, "procs": 4}).slice(procs=sel)


def test_slice_does_not_change_the_original_shape():
    shape = Shape.of({"hosts": 2, "procs": 4})
    shape.slice(procs=1)
    assert shape.sizes == {"hosts": 2, "procs": 4}
    assert shape.ranks == tuple(range(8))


# ---------------------------------------------------------------------------------------------
# flatten and rename
# ---------------------------------------------------------------------------------------------


def test_flatten_makes_one_axis_over_all_elements_in_row_major_order():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3)).flatten("gpus")
    assert shape.sizes == {"gpus": 4}
    assert shape.ranks == (1, 2, 5, 6)


def test_flatten_of_a_shape_with_no_axes_has_one_element():
    shape = Shape.of({"procs": 4}).slice(procs=2).flatten("all")
    assert shape.sizes == {"all": 1}
    assert shape.ranks == (2,)


def test_flatten_rejects_a_name_that_is_not_an_identifier():
    with pytest.raises(ValueError, match="not a Python identifier"):
        Shape.of({"procs": 4}).flatten("not valid")


def test_rename_changes_labels_but_keeps_sizes_and_ranks():
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3))
    renamed = shape.rename(procs="gpus")
    assert renamed.sizes == {"hosts": 2, "gpus": 2}
    assert renamed.ranks == shape.ranks


def test_rename_can_swap_two_axis_names():
    renamed = Shape.of({"a": 2, "b": 3}).rename(a="b", b="a")
    assert renamed.sizes == {"b": 2, "a": 3}


def test_rename_of_an_unknown_axis_names_it_and_the_available_axes():
    with pytest.raises(ValueError, match=r"unknown axis 'gpus'.*\['hosts', 'procs'\]"):
        Shape.of({"hosts": 2, "procs": 4}).rename(gpus="x")


def test_rename_onto_an_existing_axis_name_is_rejected():
    with pytest.raises(ValueError, match="repeat a name"):
        Shape.of({"hosts": 2, "procs": 4}).rename(procs="hosts")


# ---------------------------------------------------------------------------------------------
# Property check: Shape.slice against a brute-force reference
# ---------------------------------------------------------------------------------------------

_SLICES = [
    slice(None),
    slice(1, None),
    slice(None, -1),
    slice(None, None, 2),
    slice(1, None, 2),
    slice(None, None, -1),
    slice(-2, None),
    slice(0, 1),
    slice(-1, None, -2),
]


def _selections(size: int) -> list[object]:
    """Every selection of one axis: absent, each int index (both signs), non-empty slices."""
    sels: list[object] = [None]
    sels.extend(range(-size, size))
    sels.extend(s for s in _SLICES if len(range(size)[s]) > 0)
    return sels


def _reference(sizes: dict[str, int], ranks: list[int], sel: dict[str, object]):
    """Brute force: filter every point of the full shape, then order by position in selection.

    Returns (labels, sizes, ranks) of the expected result.
    """
    labels = list(sizes)
    picked: dict[str, list[int]] = {}
    for label in labels:
        s = sel.get(label)
        n = sizes[label]
        if s is None:
            picked[label] = list(range(n))
        elif isinstance(s, slice):
            start, stop, step = s.indices(n)
            picked[label] = [i for i in range(start, stop, step)]
        else:
            picked[label] = [s + n if s < 0 else s]
    kept = [lb for lb in labels if not isinstance(sel.get(lb), int)]
    members = []
    for coords in itertools.product(*(range(sizes[lb]) for lb in labels)):
        if all(c in picked[lb] for lb, c in zip(labels, coords, strict=True)):
            flat = 0
            for lb, c in zip(labels, coords, strict=True):
                flat = flat * sizes[lb] + c
            key = tuple(picked[lb].index(c) for lb, c in zip(labels, coords, strict=True))
            members.append((key, ranks[flat]))
    members.sort()
    return tuple(kept), tuple(len(picked[lb]) for lb in kept), tuple(r for _, r in members)


@pytest.mark.parametrize(
    "sizes",
    [
        {"procs": 5},
        {"hosts": 2, "procs": 3},
        {"a": 3, "b": 1, "c": 2},
        {"x": 2, "y": 2, "z": 2},
    ],
)
def test_every_selection_matches_a_brute_force_reference(sizes):
    shape = Shape.of(sizes)
    labels = list(sizes)
    count = 0
    for combo in itertools.product(*(_selections(sizes[lb]) for lb in labels)):
        sel = {lb: s for lb, s in zip(labels, combo, strict=True) if s is not None}
        got = shape.slice(**sel)
        exp_labels, exp_sizes, exp_ranks = _reference(sizes, list(shape.ranks), sel)
        assert got.labels == exp_labels, sel
        assert got.extent.sizes == exp_sizes, sel
        assert got.ranks == exp_ranks, sel
        assert got.size() == math.prod(exp_sizes), sel
        count += 1
    assert count > 1


_FIRST_CUTS = [slice(None), slice(1, None), slice(None, None, 2), slice(None, None, -1)]


@pytest.mark.parametrize("sizes", [{"hosts": 3, "procs": 4}, {"hosts": 2, "procs": 5}])
def test_every_slice_of_a_slice_matches_a_brute_force_reference_on_the_slice(sizes):
    # First cut: keep every axis but shrink each to a strided or reversed sub-range, so that
    # global ranks are no longer 0..n-1; then check every second selection against the reference
    # computed over the cut's own sizes and ranks.
    shape = Shape.of(sizes)
    for first in itertools.product(*(_FIRST_CUTS for _ in sizes)):
        first_sel = dict(zip(sizes, first, strict=True))
        if any(len(range(sizes[lb])[s]) == 0 for lb, s in first_sel.items()):
            continue
        cut = shape.slice(**first_sel)
        cut_sizes = cut.sizes
        for combo in itertools.product(*(_selections(n) for n in cut_sizes.values())):
            sel = {lb: s for lb, s in zip(cut_sizes, combo, strict=True) if s is not None}
            got = cut.slice(**sel)
            exp_labels, exp_sizes, exp_ranks = _reference(cut_sizes, list(cut.ranks), sel)
            assert (got.labels, got.extent.sizes, got.ranks) == (
                exp_labels,
                exp_sizes,
                exp_ranks,
            ), (first_sel, sel)


@pytest.mark.parametrize("sizes", [{"hosts": 2, "procs": 3}, {"a": 3, "b": 2, "c": 2}])
def test_int_indices_on_different_axes_compose_in_any_order(sizes):
    shape = Shape.of(sizes)
    first, second = list(sizes)[:2]
    for i in range(sizes[first]):
        for j in range(sizes[second]):
            together = shape.slice(**{first: i, second: j})
            assert shape.slice(**{first: i}).slice(**{second: j}) == together
            assert shape.slice(**{second: j}).slice(**{first: i}) == together
