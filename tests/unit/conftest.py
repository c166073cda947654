"""The SGLang adapter's unit tests run under `DeviceGuard`, as the plain-torch core's do: a tensor
that sgl-kvc's adapter makes without the device of its data fails here on a CPU-only machine, not
only on the first GPU (`tests/device_guard.py`)."""

from __future__ import annotations

from typing import Iterator

import pytest

from device_guard import DeviceGuard


@pytest.fixture(autouse=True)
def device_guard() -> Iterator[None]:
    with DeviceGuard():
        yield
