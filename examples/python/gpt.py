"""A small character-level GPT in plain PyTorch and the fortunes corpus it trains on.

What it is: the model and data of examples/python/train_gpt.py.
  - load_fortunes(): the distribution's `fortunes` package split into train and validation
    exactly as the C++ reference loader does (include/ddiloco/reference/data.hpp): fortunes
    separated by "%" lines, a fortune goes to validation when a mix of the FNV-1a hash of its
    text is below 10 mod 100, and the 97-symbol character vocabulary ('\\n', printable ASCII,
    one "unknown"; a tab reads as a space).
  - Sampler: seeded random windows of context + 1 tokens from one disjoint shard of the stream.
  - Gpt: a decoder-only transformer (pre-LayerNorm, Radford et al. 2019) with the parameter names
    of examples/torch_gpt/gpt.hpp: tok_emb, pos_emb, block<i>.{ln1, attn.qkv, attn.proj, ln2, fc,
    out}, ln_f, head (untied, no bias); GPT-2 initialisation N(0, 0.02), zero biases.
What it is not: a general or fast GPT (no dropout, no KV cache, no sampling).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

VOCAB = 97
FORTUNE_DIR = "/usr/share/games/fortunes"
_M64 = (1 << 64) - 1


def _splitmix64_next(state: int) -> int:
    z = (state + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix_seed(seed: int, stream: int) -> int:
    """reference::mix_seed: one SplitMix64 output of seed ^ (0xD1B54A32D192ED03 * (stream + 1))."""
    return _splitmix64_next(seed ^ ((0xD1B54A32D192ED03 * (stream + 1)) & _M64))


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & _M64
    return h


def _split_fortunes(text: bytes) -> List[bytes]:
    """Fortunes of one file: separated by lines holding only '%'; each keeps its trailing newline."""
    out, current = [], []
    lines = text.split(b"\n")
    for i, line in enumerate(lines):
        has_newline = i + 1 < len(lines)
        if not has_newline and line == b"":
            break
        if line.endswith(b"\r"):
            line = line[:-1]
        if line == b"%":
            if current:
                out.append(b"".join(current))
            current = []
        else:
            current.append(line + (b"\n" if has_newline else b""))
    if current:
        out.append(b"".join(current))
    return [f for f in out if f]


_TABLE = np.full(256, 96, dtype=np.uint8)
_TABLE[10] = 0
_TABLE[9] = 1
_TABLE[32:127] = np.arange(1, 96, dtype=np.uint8)


def encode(data: bytes) -> np.ndarray:
    """Token ids of raw bytes in the 97-symbol vocabulary."""
    return _TABLE[np.frombuffer(data, dtype=np.uint8)]


@dataclass
class Corpus:
    train: torch.Tensor  # int64 token stream
    validation: torch.Tensor
    files: int
    train_fortunes: int
    validation_fortunes: int


def load_fortunes(directory: str = FORTUNE_DIR, validation_percent: int = 10) -> Corpus:
    """The fortunes corpus as two token streams, each fortune followed by "%\\n" (as data.hpp does)."""
    if not 1 <= validation_percent <= 99:
        raise ValueError(f"validation_percent = {validation_percent} must be in [1, 99] so both splits are non-empty")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the fortunes directory {directory} does not exist; install the fortunes package "
                                "(apt-get install fortunes) or pass --fortunes DIR")
    paths = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                   if not n.endswith((".dat", ".u8")) and os.path.isfile(os.path.join(directory, n)))
    train, val, n_train, n_val = [], [], 0, 0
    for path in paths:
        with open(path, "rb") as f:
            text = f.read()
        for fortune in _split_fortunes(text):
            is_val = _mix_seed(_fnv1a64(fortune), 0) % 100 < validation_percent
            (val if is_val else train).append(fortune + b"%\n")
            n_val += is_val
            n_train += not is_val
    if not train or not val:
        raise FileNotFoundError(f"found no fortunes in {directory} ({len(paths)} files); reinstall the fortunes "
                                "package or pass --fortunes DIR")
    as_tensor = lambda parts: torch.from_numpy(encode(b"".join(parts)).astype(np.int64))  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), len(paths), n_train, n_val)


class Sampler:
    """Batches of `batch` random windows of context + 1 tokens from shard `index` of `count`
    (contiguous, disjoint slices of the stream), seeded: inputs [B, T] and next-token targets [B, T]."""

    def __init__(self, stream: torch.Tensor, context: int, batch: int, seed: int, index: int = 0, count: int = 1):
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} must be in [0, {count})")
        lo, hi = len(stream) * index // count, len(stream) * (index + 1) // count
        if hi - lo <= context + 1:
            raise ValueError(f"shard {index} of {count} holds {hi - lo} tokens, fewer than context + 2 = "
                             f"{context + 2}; use fewer processes or a shorter --context")
        self.shard = stream[lo:hi]
        self.context, self.batch = context, batch
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(context + 1)

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.shard) - self.context - 1, (self.batch, 1), generator=self.generator)
        window = self.shard[starts + self.offsets]
        return window[:, :-1], window[:, 1:]


def validation_batches(corpus: Corpus, context: int, batch: int, count: int, seed: int = 12345):
    """The fixed validation set: `count` batches drawn once from the validation stream (the same in every run)."""
    s = Sampler(corpus.validation, context, batch, seed)
    return [s.next() for _ in range(count)]


@dataclass
class GptConfig:
    vocab: int = VOCAB
    context: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2

    def check(self) -> None:
        for name in ("context", "width", "heads", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} = {getattr(self, name)} must be >= 1")
        if self.width % self.heads:
            raise ValueError(f"--width = {self.width} must be a multiple of --heads = {self.heads}")


class Attention(torch.nn.Module):
    """Causal multi-head self-attention: softmax(Q K^T / sqrt(d_head) + mask) V."""

    def __init__(self, c: GptConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = torch.nn.Linear(c.width, 3 * c.width)
        self.proj = torch.nn.Linear(c.width, c.width)
        # A plain attribute, not a buffer: DDP broadcasts buffers, and gloo has no bool type.
        self.future = torch.triu(torch.ones(c.context, c.context, dtype=torch.bool), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        att = (q * (1.0 / math.sqrt(hd))) @ k.transpose(-2, -1)
        att = att.masked_fill(self.future[:t, :t], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, c: GptConfig):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(c.width)
        self.attn = Attention(c)
        self.ln2 = torch.nn.LayerNorm(c.width)
        self.fc = torch.nn.Linear(c.width, 4 * c.width)
        self.out = torch.nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(torch.nn.Module):
    # Averaged plainly by the syncer (not by RDA): the token and position embeddings and the
    # output head (the unembedding), as torch_gpt marks them.
    EMBEDDING = ("tok_emb.weight", "pos_emb.weight", "head.weight")

    def __init__(self, c: GptConfig, seed: int = 1):
        super().__init__()
        c.check()
        self.config = c
        torch.manual_seed(seed)
        self.tok_emb = torch.nn.Embedding(c.vocab, c.width)
        self.pos_emb = torch.nn.Embedding(c.context, c.width)
        for i in range(c.layers):
            self.add_module(f"block{i}", Block(c))
        self.ln_f = torch.nn.LayerNorm(c.width)
        self.head = torch.nn.Linear(c.width, c.vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".ln" in name or name.startswith("ln"):
                    continue
                if name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(t)).unsqueeze(0)
        for i in range(self.config.layers):
            x = getattr(self, f"block{i}")(x)
        return self.head(self.ln_f(x))


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy (nats per character) on fixed batches."""
    was_training = model.training
    model.eval()
    total = sum(loss_of(model, x, y).item() for x, y in batches)
    model.train(was_training)
    return total / max(1, len(batches))


def read_safetensors(path: str) -> dict:
    """{name: float32 numpy array} of a .safetensors file of F32 tensors (what ddiloco_export writes)."""
    import json
    import struct
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: {len(data)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} is {info['dtype']}; this reader takes F32 only")
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data, dtype="<f4", count=(e - b) // 4, offset=8 + n + b).reshape(info["shape"])
    return out
