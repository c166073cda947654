"""Shared by the benchmark scripts: a one-line description of the machine for result files."""

from __future__ import annotations

import os
import platform
import subprocess


def machine() -> str:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {os.cpu_count()} cores, {platform.system()} ({gpu})"
