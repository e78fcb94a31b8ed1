"""The PyTorch side: `ShadeSampler`, and the control-file client it shares with the CLI.

Importing this package does not import torch: `ShadeSampler` is loaded on first use, so that
`shadefs.torch.client` (no torch) serves the command line where torch is not installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ControlClient", "ShadeSampler", "find_mount"]


def __getattr__(name: str) -> Any:
    if name == "ShadeSampler":
        from shadefs.torch import sampler

        return sampler.ShadeSampler
    if name in __all__:
        from shadefs.torch import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
