"""On/off switches read from the environment: one rule for every `RAYMESH_*` flag.

`switch(name, default, on=..., off=...)` is True for 1/true/yes/on and False for 0/false/no/off
(any case, surrounding spaces ignored), and `default` when the variable is unset or empty.
Anything else is a ValueError naming the variable, its value and what each setting does: a
typo (`RAYMESH_CHANNELS=of`) never silently picks one side.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool, *, on: str, off: str) -> bool:
    """The switch `name`; `on` and `off` say what each setting does, for the error."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    said = "; the default" if default else ""
    unsaid = "" if default else "; the default"
    raise ValueError(f"{name}={os.environ[name]!r}: use 1 ({on}{said}) or 0 ({off}{unsaid})")
