"""Unit tests for `raymesh._src.value_mesh.ValueMesh`: per-actor values laid out like a mesh."""

from __future__ import annotations

import pytest

from raymesh._src.shape import Shape
from raymesh._src.value_mesh import ValueMesh


def _mesh(sizes: dict[str, int]) -> ValueMesh[str]:
    """A value mesh whose value at global rank r is f"v{r}"."""
    shape = Shape.of(sizes)
    return ValueMesh(shape, [f"v{r}" for r in shape.ranks])


def test_constructor_rejects_a_value_count_that_does_not_match_the_shape():
    with pytest.raises(ValueError, match="3 values for a mesh of 4"):
        ValueMesh(Shape.of({"procs": 4}), [1, 2, 3])


def test_values_are_in_row_major_order():
    assert _mesh({"hosts": 2, "procs": 2}).values() == ["v0", "v1", "v2", "v3"]


def test_values_returns_a_copy_that_does_not_alias_the_mesh():
    mesh = _mesh({"procs": 3})
    values = mesh.values()
    values.append("extra")
    values[0] = "changed"
    assert mesh.values() == ["v0", "v1", "v2"]


def test_items_pair_each_point_with_its_value():
    items = list(_mesh({"hosts": 2, "procs": 2}).items())
    assert [(dict(p), v) for p, v in items] == [
        ({"hosts": 0, "procs": 0}, "v0"),
        ({"hosts": 0, "procs": 1}, "v1"),
        ({"hosts": 1, "procs": 0}, "v2"),
        ({"hosts": 1, "procs": 1}, "v3"),
    ]
    assert [p.rank for p, _ in items] == [0, 1, 2, 3]


def test_iteration_yields_point_value_pairs():
    mesh = _mesh({"hosts": 2, "procs": 3})
    pairs = list(mesh)
    assert [(p.coords, v) for p, v in pairs] == [(p.coords, v) for p, v in mesh.items()]
    assert [v for _, v in pairs] == mesh.values()
    point, value = pairs[4]
    assert dict(point) == {"hosts": 1, "procs": 1}
    assert value == "v4"


def test_len_is_the_number_of_values():
    assert len(_mesh({"hosts": 2, "procs": 3})) == 6
    assert len(_mesh({"procs": 1})) == 1


def test_sizes_and_size_follow_the_shape():
    mesh = _mesh({"hosts": 2, "procs": 3})
    assert mesh.sizes == {"hosts": 2, "procs": 3}
    assert mesh.size() == 6
    assert mesh.size("procs") == 3


def test_size_of_an_unknown_axis_raises_value_error():
    with pytest.raises(ValueError, match="unknown axis 'gpus'"):
        _mesh({"procs": 3}).size("gpus")


def test_shape_property_is_the_shape_given():
    shape = Shape.of({"procs": 3})
    assert ValueMesh(shape, [0, 1, 2]).shape is shape


def test_item_returns_the_value_at_the_coordinates():
    mesh = _mesh({"hosts": 2, "procs": 3})
    assert mesh.item(hosts=0, procs=0) == "v0"
    assert mesh.item(hosts=1, procs=2) == "v5"
    assert mesh.item(procs=1, hosts=1) == "v4"


def test_item_accepts_negative_coordinates():
    assert _mesh({"hosts": 2, "procs": 3}).item(hosts=-1, procs=-1) == "v5"


def test_item_of_every_point_matches_items():
    mesh = _mesh({"a": 2, "b": 3, "c": 2})
    for point, value in mesh.items():
        assert mesh.item(**point) == value


def test_item_with_a_missing_axis_raises_key_error_naming_it():
    with pytest.raises(KeyError) as info:
        _mesh({"hosts": 2, "procs": 3}).item(hosts=0)
    message = str(info.value)
    assert "missing ['procs']" in message
    assert "['hosts', 'procs']" in message


def test_item_with_an_unknown_axis_raises_key_error_naming_it():
    with pytest.raises(KeyError) as info:
        _mesh({"procs": 3}).item(procs=0, gpus=1)
    message = str(info.value)
    assert "unknown ['gpus']" in message
    assert "missing" not in message


def test_item_with_no_coordinates_on_a_mesh_with_axes_raises_key_error():
    with pytest.raises(KeyError, match="missing"):
        _mesh({"procs": 3}).item()


def test_item_with_an_out_of_range_coordinate_raises_value_error():
    with pytest.raises(ValueError, match="out of range"):
        _mesh({"procs": 3}).item(procs=3)


def test_item_with_no_arguments_works_on_a_mesh_with_no_axes():
    mesh = _mesh({"hosts": 2, "procs": 3}).slice(hosts=1, procs=2)
    assert mesh.sizes == {}
    assert len(mesh) == 1
    assert mesh.item() == "v5"


def test_item_with_no_arguments_works_on_a_mesh_built_over_an_empty_extent():
    shape = Shape.of({})
    mesh = ValueMesh(shape, ["only"])
    assert mesh.item() == "only"
    assert [(p.coords, v) for p, v in mesh] == [((), "only")]


def test_item_on_a_mesh_with_no_axes_rejects_coordinates():
    mesh = _mesh({"procs": 3}).slice(procs=0)
    with pytest.raises(KeyError, match="unknown"):
        mesh.item(procs=0)


def test_slice_with_an_int_removes_the_axis_and_keeps_the_values():
    sub = _mesh({"hosts": 2, "procs": 3}).slice(procs=1)
    assert sub.sizes == {"hosts": 2}
    assert sub.values() == ["v1", "v4"]


def test_slice_with_a_slice_keeps_the_axis():
    sub = _mesh({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3))
    assert sub.sizes == {"hosts": 2, "procs": 2}
    assert sub.values() == ["v1", "v2", "v5", "v6"]
    assert sub.shape.ranks == (1, 2, 5, 6)


def test_slice_of_a_slice_picks_values_by_local_coordinates():
    sub = _mesh({"hosts": 2, "procs": 4}).slice(procs=slice(1, 3)).slice(hosts=1)
    assert sub.values() == ["v5", "v6"]
    assert sub.item(procs=0) == "v5"
    assert sub.item(procs=1) == "v6"


def test_slice_of_a_mesh_over_non_contiguous_ranks_maps_values_by_position():
    # The mesh's shape holds global ranks 3, 1, 7, 5 (not 0..n-1); values follow positions.
    shape = Shape.of({"hosts": 2, "procs": 4}).slice(procs=slice(3, None, -2))
    assert shape.ranks == (3, 1, 7, 5)
    mesh = ValueMesh(shape, ["a", "b", "c", "d"])
    assert mesh.item(hosts=0, procs=1) == "b"
    assert mesh.item(hosts=1, procs=0) == "c"
    assert mesh.slice(procs=1).values() == ["b", "d"]
    assert mesh.slice(hosts=1).values() == ["c", "d"]
    assert mesh.slice(procs=slice(None, None, -1)).values() == ["b", "a", "d", "c"]


def test_slice_errors_are_those_of_shape_slice():
    mesh = _mesh({"procs": 3})
    with pytest.raises(ValueError, match="unknown axis 'gpus'"):
        mesh.slice(gpus=0)
    with pytest.raises(ValueError, match="selects nothing"):
        mesh.slice(procs=slice(3, None))
    with pytest.raises(TypeError):
        mesh.slice(procs="0")


def test_values_may_be_any_objects_including_none():
    mesh = ValueMesh(Shape.of({"procs": 3}), [None, {"k": 1}, [2]])
    assert mesh.item(procs=0) is None
    assert mesh.item(procs=1) == {"k": 1}
    assert mesh.values() == [None, {"k": 1}, [2]]


def test_repr_shows_shape_and_values():
    assert repr(_mesh({"procs": 2})) == "ValueMesh(Shape(procs=2), ['v0', 'v1'])"
