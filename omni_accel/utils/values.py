"""The values a key holds as they are: immutable, with an equality that says what the host decides with (a
CUDA graph's key, the input signature a static compile specializes on)."""

from __future__ import annotations

import enum

import torch

PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
