"""The model the console-syncer tests serve (`python -m ddiloco syncer --model tests/python/console_model.py:build`)
and train: the same names and sizes on both sides, so the plans match."""
import torch


class ConsoleModel(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(16, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 16)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.tok_emb(tokens))))


def build(width: int = 8) -> torch.nn.Module:
    return ConsoleModel(width)
