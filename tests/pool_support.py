"""Models and helpers the pool tests share (tests/pool/*)."""
from __future__ import annotations

import io

import torch


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch.relu(x @ self.w) + 1


def script_bytes(module, example=None):
    mod = torch.jit.script(module) if example is None else torch.jit.trace(module, example)
    buf = io.BytesIO()
    torch.jit.save(mod, buf)
    return buf.getvalue(), mod

