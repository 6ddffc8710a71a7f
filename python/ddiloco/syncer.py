"""ddiloco.Syncer: an in-process ZeroMQ syncer (tests, notebooks, single-host runs).

The compiled core (ddiloco._core.SyncerCore) is the same Syncer + SyncerRuntime
+ ZmqSyncerTransport that the ddiloco_syncer program serves; this module turns
a model (its names, sizes and initial values) into its arguments.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _core
from ._params import (EmbeddingRule, NamedParameters, default_fragments, embedding_flags, fill, named_parameters,
                      reject_unknown)


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
    answers (0: derived from the step time). See docs/python.md for every keyword.
    """

    def __init__(self, model: NamedParameters, *, bind: str = "tcp://127.0.0.1:*", plaintext: bool = False,
                 keys: Optional[str] = None, allow: Optional[str] = None, fragments: Optional[int] = None,
                 overlap: int = 2, sync_every: int = 24, round: str = "pull", pull_timeout: float = 0.0,
                 quorum: int = 1, grace_gamma: float = 0.3, grace_cap: float = 1.0,
                 deadline: float = 60.0, max_staleness: int = 8, heartbeat_timeout: float = 10.0,
                 send_merged_to: str = "alive", merge: str = "rda", outer_optimizer: str = "nesterov",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, global_codec: str = "fp32",
                 workers: int = 2, embedding: EmbeddingRule = None, init=None, start: bool = True, **unknown):
        reject_unknown("ddiloco.Syncer", Syncer.__init__, unknown)
        names, tensors, modules = named_parameters(model, "ddiloco.Syncer")
        flags = embedding_flags(names, tensors, modules, embedding, "ddiloco.Syncer")
        o = _core.SyncerOptions()
        fill("ddiloco.Syncer", o, {
            "bind": ("bind", bind), "plaintext": ("plaintext", plaintext), "keys": ("keys", keys or ""),
            "allow": ("allow", allow or ""), "fragments": ("fragments", default_fragments(fragments, len(names))),
            "overlap": ("overlap", overlap), "sync_every": ("sync_every", sync_every), "round": ("round", round),
            "pull_timeout": ("pull_timeout_s", pull_timeout), "quorum": ("quorum", quorum), "grace_gamma": ("grace_gamma", grace_gamma),
            "grace_cap": ("grace_cap_s", grace_cap), "deadline": ("deadline_s", deadline),
            "max_staleness": ("max_staleness", max_staleness),
            "heartbeat_timeout": ("heartbeat_timeout_s", heartbeat_timeout),
            "send_merged_to": ("send_merged_to", send_merged_to), "merge": ("merge", merge),
            "outer_optimizer": ("outer_optimizer", outer_optimizer), "outer_lr": ("outer_lr", outer_lr),
            "outer_momentum": ("outer_momentum", outer_momentum), "global_codec": ("global_codec", global_codec),
            "workers": ("workers", workers)})
        numels = [int(t.numel()) for t in tensors]
        if init is None:
            with torch.no_grad():
                init = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]).numpy()
        self.names = names
        self._core = _core.SyncerCore(o, names, numels, flags, np.ascontiguousarray(init, dtype=np.float32))
        if start:
            self.start()

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
        rejected (by reason), quorum_sizes, fragments (version, merges, ... per fragment),
        ZeroMQ counters (decode_errors, auth_denied, ...) and 'line' (one printable line)."""
        return self._core.status()

    def global_parameters(self) -> np.ndarray:
        """A copy of the global parameters, flat float32 in model order."""
        return self._core.global_parameters()

    def __enter__(self) -> "Syncer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
