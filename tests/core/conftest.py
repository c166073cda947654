"""The plain-torch core's tests: no SGLang, every test under the device guard.

`device` gives each test the device its data lives on: the CPU, and CUDA where there is one.
Every test runs under `DeviceGuard`, so a tensor that sgl-kvc makes without the device of its
data fails here on a CPU-only machine, not only on the first GPU.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from device_guard import DeviceGuard


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> torch.device:
    # With its index: a CUDA tensor's `.device` is `cuda:0`, which `torch.device("cuda")` does not
    # equal, so the tests' `x.device == device` checks need the index the tensors will report.
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def device_guard() -> Iterator[None]:
    with DeviceGuard():
        yield
