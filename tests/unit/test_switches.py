"""Every RAYMESH_* on/off variable reads by one rule: 1/true/yes/on and 0/false/no/off in any
case, unset or empty is the default, and anything else is refused naming the variable, the
value and what each setting does (a typo never silently picks a side)."""

from __future__ import annotations

import pytest

from raymesh._src.backend import channel
from raymesh._src.backend.switches import switch
from raymesh._src.buffer_copy import one_sided


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), (" TRUE ", True), ("on", True), ("0", False), ("No", False), ("", None)],
)
def test_a_switch_reads_the_usual_spellings_and_empty_as_its_default(monkeypatch, value, expected):
    monkeypatch.setenv("RAYMESH_TEST_SWITCH", value)
    for default in (True, False):
        got = switch("RAYMESH_TEST_SWITCH", default, on="a", off="b")
        assert got is (default if expected is None else expected)


@pytest.mark.parametrize(
    ("name", "read"), [("RAYMESH_CHANNELS", channel.enabled), ("RAYMESH_RDMA_ONE_SIDED", one_sided)]
)
def test_a_misspelt_switch_is_refused_naming_it_its_value_and_both_settings(
    monkeypatch, name, read
):
    monkeypatch.setenv(name, "of")
    with pytest.raises(ValueError) as refused:
        read()
    message = str(refused.value)
    assert message.startswith(f"{name}='of': use 1 (") and "; the default) or 0 (" in message
