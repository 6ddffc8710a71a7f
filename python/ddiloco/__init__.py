"""ddiloco: Decoupled DiLoCo for PyTorch trainers.

    learner = ddiloco.Learner(model, endpoint="tcp://syncer:5555", id=0, plaintext=True).join()
    for batch in data:
        loss_of(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=batch.numel())

A thin layer over the compiled core ddiloco._core (the C++ library): Learner
and outer_loop (learner side), GroupLearner (a learner that is the ranks of a
torch.distributed group), Syncer (an in-process syncer), sim (the goodput
and bandwidth models), and the exceptions, each a ddiloco.Error whose message
names the value and the fix. docs/python.md has the whole API and its contracts.
"""
from . import _core, sim
from ._core import Error, InvalidArgument, ProtocolError, ShapeMismatch, StateError, TransportError
from ._params import default_embedding_rule
from .group import GroupLearner
from .learner import Learner, OuterLoop, StepReport, outer_loop
from .syncer import Syncer

write_curve_keys = _core.write_curve_keys

__all__ = [
    "Learner", "GroupLearner", "OuterLoop", "StepReport", "outer_loop", "Syncer", "sim", "default_embedding_rule",
    "write_curve_keys",
    "Error", "InvalidArgument", "ShapeMismatch", "StateError", "ProtocolError", "TransportError",
]
