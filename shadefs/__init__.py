"""shadefs: a read-only caching filesystem for deep-learning training data.

It mounts over a slow dataset tree (usually NFS), keeps file contents in RAM (and, later, on
local SSD) and lets the training job steer what stays cached. See README.md and
docs/developer-notes.md.
"""

__version__ = "0.1.0"
