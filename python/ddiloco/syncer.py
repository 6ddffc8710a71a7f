"""ddiloco.Syncer: an in-process ZeroMQ syncer (tests, notebooks, single-host runs).

The compiled core (ddiloco._core.SyncerCore) is the same Syncer + SyncerRuntime
+ ZmqSyncerTransport that the ddiloco_syncer program serves; this module turns
a model (its names, sizes and initial values) into its arguments.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch

from . import _core
from ._params import (EmbeddingRule, NamedParameters, default_fragments, embedding_flags, fill, named_parameters,
                      reject_unknown)


class _TensorList:
    """A model given as names, sizes and embedding flags only (a tensor list file)."""

    def __init__(self, names, numels, embedding):
        self.names, self.numels, self.embedding = list(names), [int(n) for n in numels], [bool(e) for e in embedding]
        self.shapes = [[n] for n in self.numels]


class Syncer:
    """The syncer of a run: binds ``bind`` (port ``*``: a free one; see ``endpoint``),
    merges contributions (``merge``: 'rda' or 'average'; outer optimizer
    'nesterov', 'sgd' or 'average') and streams merged fragments back.

    ``model``: the same module or (name, parameter) pairs the learners pass (the
    plan must match); its current values are the initial global state unless
    ``init`` (a flat float32 array in model order) is given. Starts at once
    unless ``start=False``. ``round``: 'pull' (the paper's round, the default:
    the syncer keeps the global step from the learners' metadata and pulls each
    fragment once per ``sync_every`` global steps) or 'push'; ``sync_every`` is
    the learners' H (a join with another H or ``overlap`` is refused; 0: not
    checked, push only); ``pull_timeout``: seconds a pull round waits for its
    answers (0: derived from the step time); ``reask_after_steps``: a pulled
    learner that reports this many steps past the pull with no answer in is
    asked once more (its pull or answer was likely lost; 0: never). ``checkpoint_dir``: resume from the
    newest valid checkpoint there (of the same plan) and allow
    ``checkpoint()``. ``shard``: (i, S) serves only shard i of S of the
    fragments (docs/sharding.md; learners then list every shard's endpoint).
    ``payload_crc``: under CURVE, compare each contribution's payload CRC-32C
    too (by default it is not: CURVE's MAC already authenticates every byte;
    ``status()['payload_checks']`` says which). ``io_threads``: ZeroMQ I/O
    threads the learners' connections are spread over (each encrypts its
    connections' bytes under CURVE; ``ddiloco_sim size`` says how many). See docs/python.md for every keyword.
    """

    def __init__(self, model: NamedParameters, *, bind: str = "tcp://127.0.0.1:*", plaintext: bool = False,
                 keys: Optional[str] = None, allow: Optional[str] = None, payload_crc: bool = False,
                 fragments: Optional[int] = None,
                 overlap: int = 2, sync_every: int = 24, round: str = "pull", pull_timeout: float = 0.0,
                 reask_after_steps: int = 3,
                 quorum: int = 1, grace_gamma: float = 0.3, grace_cap: float = 1.0,
                 deadline: float = 60.0, max_staleness: int = 8, heartbeat_timeout: float = 10.0,
                 send_merged_to: str = "alive", merge: str = "rda", outer_optimizer: str = "nesterov",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, global_codec: str = "fp32",
                 workers: int = 2, io_threads: int = 1, embedding: EmbeddingRule = None, init=None,
                 checkpoint_dir: Optional[str] = None, shard: Tuple[int, int] = (0, 1), start: bool = True,
                 **unknown):
        reject_unknown("ddiloco.Syncer", Syncer.__init__, unknown)
        if (not isinstance(shard, (tuple, list)) or len(shard) != 2 or
                not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)):
            raise _core.InvalidArgument(f"ddiloco.Syncer: shard = {shard!r} must be (index, count), e.g. (0, 2) and "
                                        "(1, 2) for two shards; (0, 1) is not sharded")
        if isinstance(model, _TensorList):
            names, numels, flags, shapes = model.names, model.numels, model.embedding, model.shapes
            if init is None:
                raise ValueError("ddiloco.Syncer: a tensor list brings no values; pass init= (a flat float32 array "
                                 "of the model's initial parameters, in list order)")
        else:
            names, tensors, modules = named_parameters(model, "ddiloco.Syncer")
            flags = embedding_flags(names, tensors, modules, embedding, "ddiloco.Syncer")
            numels = [int(t.numel()) for t in tensors]
            shapes = [[int(d) for d in t.shape] for t in tensors]
            if init is None:
                with torch.no_grad():
                    init = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]).numpy()
        o = _core.SyncerOptions()
        fill("ddiloco.Syncer", o, {
            "bind": ("bind", bind), "plaintext": ("plaintext", plaintext), "keys": ("keys", keys or ""),
            "allow": ("allow", allow or ""), "payload_crc": ("payload_crc", payload_crc),
            "fragments": ("fragments", default_fragments(fragments, len(names))),
            "overlap": ("overlap", overlap), "sync_every": ("sync_every", sync_every), "round": ("round", round),
            "pull_timeout": ("pull_timeout_s", pull_timeout),
            "reask_after_steps": ("reask_after_steps", reask_after_steps), "quorum": ("quorum", quorum), "grace_gamma": ("grace_gamma", grace_gamma),
            "grace_cap": ("grace_cap_s", grace_cap), "deadline": ("deadline_s", deadline),
            "max_staleness": ("max_staleness", max_staleness),
            "heartbeat_timeout": ("heartbeat_timeout_s", heartbeat_timeout),
            "send_merged_to": ("send_merged_to", send_merged_to), "merge": ("merge", merge),
            "outer_optimizer": ("outer_optimizer", outer_optimizer), "outer_lr": ("outer_lr", outer_lr),
            "outer_momentum": ("outer_momentum", outer_momentum), "global_codec": ("global_codec", global_codec),
            "workers": ("workers", workers), "io_threads": ("io_threads", io_threads),
            "shard[0]": ("shard_index", shard[0]), "shard[1]": ("shard_count", shard[1]),
            "checkpoint_dir": ("checkpoint_dir", os.fspath(checkpoint_dir) if checkpoint_dir is not None else "")})
        self.names = names
        self.numels = list(numels)
        self._core = _core.SyncerCore(o, names, numels, flags, np.ascontiguousarray(init, dtype=np.float32), shapes)
        if start:
            self.start()

    @classmethod
    def from_tensor_list(cls, path: str, *, init, **keywords) -> "Syncer":
        """A syncer of the model a tensor list file describes (``name numel [embedding]`` per line, model
        order: what ``ddiloco_syncer --tensors`` reads, with the embedding flags it marks); ``init`` is the
        flat float32 initial state in list order. The other keywords are the constructor's (``embedding``
        does not apply: the list marks them)."""
        if "embedding" in keywords:
            raise TypeError("ddiloco.Syncer.from_tensor_list: the list marks the embeddings (a third column "
                            "'embedding'); drop embedding=")
        specs = _core.read_tensor_list(path)
        return cls(_TensorList([s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs]), init=init,
                   **keywords)

    @property
    def endpoint(self) -> str:
        """The bound endpoint, with the actual port (give it to the learners)."""
        return self._core.endpoint

    @property
    def fingerprint(self) -> int:
        """The plan's fingerprint (the learners' must be equal)."""
        return self._core.fingerprint

    def start(self) -> None:
        """Starts serving on background threads (releases the GIL)."""
        self._core.start()

    def stop(self) -> None:
        """Stops serving; queued contributions are finished first (releases the GIL)."""
        self._core.stop()

    def close(self) -> None:
        """Stops and unbinds; the syncer is unusable after."""
        self._core.close()

    def status(self) -> dict:
        """learners_alive/known, joins, leaves, deaths, merges, contributions_accepted,
        round ('push' or 'pull'), global_step, pull_rounds, pulls_sent, pull_timeouts, pull_rounds_empty,
        pulls_repeated, answers_redundant, steps_beyond_lead, frontier_carries, rejected (by reason), quorum_sizes, fragments (version, merges, ... per fragment),
        ZeroMQ counters (decode_errors, auth_denied, ...) and 'line' (one printable line)."""
        return self._core.status()

    def checkpoint(self) -> str:
        """Writes the whole state into ``checkpoint_dir`` (atomically, a new serial: the file format of
        ``ddiloco_syncer``, which ``ddiloco_export`` reads); returns the file's path. Safe while serving."""
        return self._core.checkpoint()

    @property
    def resumed_from(self) -> str:
        """The checkpoint this syncer resumed from ('' when it started fresh)."""
        return self._core.resumed_from

    @property
    def skipped_checkpoints(self) -> list:
        """Damaged checkpoints passed over when resuming ('path: reason' each)."""
        return list(self._core.skipped_checkpoints)

    def global_parameters(self) -> np.ndarray:
        """A copy of the global parameters, flat float32 in model order."""
        return self._core.global_parameters()

    def __enter__(self) -> "Syncer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
