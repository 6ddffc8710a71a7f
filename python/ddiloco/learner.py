"""ddiloco.Learner and ddiloco.outer_loop: the learner side in a PyTorch trainer.

The work is done by the compiled core (ddiloco._core.LearnerCore, an OuterLoop
over ZeroMQ on the parameters' own memory); this module turns PyTorch objects
into its arguments and offers the optimizer-hook style.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from . import _core
from ._params import (EmbeddingRule, NamedParameters, default_fragments, embedding_flags, fill, named_parameters,
                      reject_unknown)

StepReport = _core.StepReport


def _copy_out(parameter: torch.Tensor, buffer: memoryview) -> None:
    """Staged form: the parameter's values into ddiloco's host buffer (one device-to-host copy)."""
    torch.frombuffer(buffer, dtype=torch.float32).view(parameter.shape).copy_(parameter.detach())


def _copy_in(parameter: torch.Tensor, buffer: memoryview) -> None:
    """Staged form: ddiloco's host buffer into the parameter, in place (one host-to-device copy)."""
    with torch.no_grad():
        parameter.copy_(torch.frombuffer(buffer, dtype=torch.float32).view(parameter.shape))


class Learner:
    """One learner of a Decoupled DiLoCo run: call ``step(tokens)`` after every ``optimizer.step()``.

    ``model``: a ``torch.nn.Module`` or an iterable of ``(name, parameter)`` pairs
    (float32, contiguous; CPU parameters are read and written in place, others
    through staged host copies of the due fragment only). The plan (which
    tensors travel together, ``fragments`` of them) is built from the names and
    sizes in model order, exactly as ``ddiloco.Syncer`` builds it from the same
    model. ``round``: 'pull' (the paper's round, the default: a metadata message
    after every step, and the fragment the syncer pulls at the next step) or
    'push' (each fragment at its own slots); the syncer's must match.
    ``announce_applies`` (pull rounds; ddiloco.GroupLearner's leader sets it):
    a step that may apply announces the globals whose time has come
    (``StepReport.announced``, values via ``copy_announced``) and applies them
    at the next step that may apply, ``apply_every`` steps later. See
    docs/python.md for every keyword.
    """

    def __init__(self, model: NamedParameters, *, endpoint: Union[str, Sequence[str]], id: int, plaintext: bool = False,
                 keys: Optional[str] = None, server_key: Optional[str] = None, fragments: Optional[int] = None,
                 sync_every: int = 24, overlap: int = 2, alpha: float = 0.0, lock_step: bool = False,
                 codec: str = "fp32", error_feedback: bool = False, embedding: EmbeddingRule = None,
                 join_timeout: float = 30.0, join_retry: float = 1.0, heartbeat: float = 1.0,
                 lock_step_timeout: float = 60.0, staging: str = "auto", round: str = "pull",
                 apply_every: int = 1, announce_applies: bool = False, metadata_interval: float = 0.001,
                 **unknown):
        reject_unknown("ddiloco.Learner", Learner.__init__, unknown)
        names, tensors, modules = named_parameters(model, "ddiloco.Learner")
        flags = embedding_flags(names, tensors, modules, embedding, "ddiloco.Learner")
        if isinstance(endpoint, (list, tuple)):  # a syncer sharded by fragment: every shard, in shard order
            if not endpoint or not all(isinstance(e, str) and e and "," not in e for e in endpoint):
                raise _core.InvalidArgument(f"ddiloco.Learner: endpoint = {endpoint!r} must be one endpoint, or a "
                                            "non-empty list of every syncer shard's endpoint (strings), in shard order")
            endpoint = ",".join(endpoint)
        o = _core.LearnerOptions()
        fill("ddiloco.Learner", o, {
            "endpoint": ("endpoint", endpoint), "id": ("id", id), "plaintext": ("plaintext", plaintext),
            "keys": ("keys", keys or ""), "server_key": ("server_key", server_key or ""),
            "fragments": ("fragments", default_fragments(fragments, len(names))),
            "sync_every": ("sync_every", sync_every), "overlap": ("overlap", overlap), "alpha": ("alpha", alpha),
            "lock_step": ("lock_step", lock_step), "codec": ("codec", codec),
            "error_feedback": ("error_feedback", error_feedback), "join_timeout": ("join_timeout_s", join_timeout),
            "join_retry": ("join_retry_s", join_retry), "heartbeat": ("heartbeat_s", heartbeat),
            "lock_step_timeout": ("lock_step_timeout_s", lock_step_timeout), "staging": ("staging", staging),
            "round": ("round", round), "apply_every": ("apply_every", apply_every),
            "announce_applies": ("announce_applies", announce_applies),
            "metadata_interval": ("metadata_interval_s", metadata_interval)})
        self.names = names
        self.parameters = tensors
        self._core = _core.LearnerCore(o, names, tensors, flags, torch.float32, _copy_out, _copy_in)

    def join(self) -> "Learner":
        """Fetches the global state from the syncer and writes it into the parameters
        (blocks at most ``join_timeout`` seconds; releases the GIL while waiting)."""
        self._core.join()
        return self

    def step(self, tokens: int) -> StepReport:
        """Call once after every inner ``optimizer.step()``, with the tokens of that step.
        Never blocks (unless ``lock_step``): sends the due fragment, applies arrived globals."""
        return self._core.step(tokens)

    def leave(self) -> None:
        """Tells the syncer this learner is going away (best effort)."""
        self._core.leave()

    def close(self) -> None:
        """Leaves if joined and closes the connection."""
        self._core.close()

    @property
    def joined(self) -> bool:
        return self._core.joined

    @property
    def staged(self) -> bool:
        """True when the parameters go through host copies (not on the CPU, or staging='always')."""
        return self._core.staged

    def status(self) -> dict:
        """Counters: step, tokens, sends, applies, late_applies, base_versions (per fragment), bytes..."""
        return self._core.status()

    @property
    def plan(self) -> dict:
        """The plan: fingerprint, fragments (tensor names of each), embedding (names), numel."""
        return self._core.plan()

    def __enter__(self) -> "Learner":
        if not self.joined:
            self.join()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OuterLoop:
    """What ``ddiloco.outer_loop`` yields: a joined Learner stepped by the optimizer's hook."""

    def __init__(self, learner: Learner, tokens_per_step: Union[int, Callable[[], int]]):
        self.learner = learner
        self.tokens: Union[int, Callable[[], int]] = tokens_per_step
        self.last: Optional[StepReport] = None

    def _after_step(self, *_args, **_kwargs) -> None:
        tokens = self.tokens() if callable(self.tokens) else self.tokens
        self.last = self.learner.step(int(tokens))

    def status(self) -> dict:
        return self.learner.status()


@contextlib.contextmanager
def outer_loop(model: NamedParameters, optimizer: torch.optim.Optimizer, *,
               tokens_per_step: Union[int, Callable[[], int]], **learner_kwargs) -> Iterator[OuterLoop]:
    """``with ddiloco.outer_loop(model, optimizer, tokens_per_step=..., endpoint=..., id=...) as loop:``

    Joins on entry; every ``optimizer.step()`` inside the block is followed by
    ``Learner.step(tokens)``, where tokens is ``loop.tokens`` (initially
    ``tokens_per_step``: an int, or a callable returning the tokens of the step
    just taken; assign ``loop.tokens`` to change it). On exit the hook is
    removed and the learner leaves. The other keywords are Learner's.
    """
    if optimizer is None or not hasattr(optimizer, "step"):
        raise TypeError("ddiloco.outer_loop: optimizer must be a torch.optim.Optimizer (its step() is hooked)")
    if not (callable(tokens_per_step) or (isinstance(tokens_per_step, int) and tokens_per_step > 0)):
        raise TypeError(f"ddiloco.outer_loop: tokens_per_step = {tokens_per_step!r} must be the tokens of one "
                        "inner step (an int > 0: batch x sequence length) or a callable returning them")
    learner = Learner(model, **learner_kwargs)
    loop = OuterLoop(learner, tokens_per_step)
    try:
        learner.join()
        if hasattr(optimizer, "register_step_post_hook"):  # torch >= 2.0
            handle = optimizer.register_step_post_hook(loop._after_step)
            remove = handle.remove
        else:  # older torch: wrap this optimizer's step (the instance attribute shadows the class method)
            original = optimizer.step
            had_own = "step" in vars(optimizer)

            def step(*args, **kwargs):
                result = original(*args, **kwargs)
                loop._after_step()
                return result

            optimizer.step = step

            def remove():
                if had_own:
                    optimizer.step = original
                else:
                    del optimizer.step
        try:
            yield loop
        finally:
            remove()
    finally:
        learner.close()
