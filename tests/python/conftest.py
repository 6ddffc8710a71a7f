"""Shared fixtures of the Python tests: a tiny model and an in-process syncer on loopback.

Run with the build tree's package on the path (ctest does this):
    PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
"""
import pytest
import torch

import ddiloco


class Tiny(torch.nn.Module):
    """An embedding, a linear layer and an output head: 3 names the default rule sees."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok_emb = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.tok_emb(tokens))))


def train_step(model, opt, seed):
    """One inner step of a Tiny on a seeded random token sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 16, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:]).backward()
    opt.step()


@pytest.fixture
def tiny():
    return Tiny()


@pytest.fixture
def syncer_of():
    """syncer_of(model, **kw): a started plaintext Syncer on a free loopback port, closed after the test."""
    made = []

    def make(model, **kw):
        kw.setdefault("plaintext", True)
        s = ddiloco.Syncer(model, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
