"""The PyTorch side: `ShadeSampler`.

Importing this package does not import torch: `ShadeSampler` and its helpers are loaded on
first use, so that the control-file client in this package serves the CLI without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShadeSampler", "find_mount"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shadefs.torch import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
