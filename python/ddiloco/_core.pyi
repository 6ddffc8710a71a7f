"""Type stub of ddiloco._core, the compiled core (an implementation detail: import ddiloco).

Every class here is wrapped by the pure-Python package: ddiloco.Learner over
LearnerCore, ddiloco.Syncer over SyncerCore, ddiloco.sim over the sim submodule.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

class Error(Exception):
    """Base of every error ddiloco raises (a broken contract). The message starts
    with a stable id in brackets, e.g. '[ddiloco.invalid_argument]', and names
    the value and the fix."""

class InvalidArgument(Error, ValueError):
    """A value outside its documented domain (dtype, contiguity, endpoint, P > tensors...)."""

class ShapeMismatch(Error, ValueError):
    """Tensors whose count, sizes or names do not match the plan (a parameter resized after join)."""

class StateError(Error, RuntimeError):
    """An operation called in a state that does not allow it (step() before join(), a closed learner)."""

class ProtocolError(Error):
    """A message or file from outside the process that failed validation."""

class TransportError(Error, ConnectionError):
    """A link that failed: cannot connect, or no reply from the syncer within the time-out."""

class LearnerOptions:
    """Settings of a LearnerCore; ddiloco.Learner's keywords (seconds as *_s)."""
    endpoint: str
    id: int
    fragments: int
    sync_every: int
    overlap: int
    alpha: float
    lock_step: bool
    join_timeout_s: float
    join_retry_s: float
    lock_step_timeout_s: float
    heartbeat_s: float
    metadata_interval_s: float
    codec: str
    error_feedback: bool
    plaintext: bool
    keys: str
    server_key: str
    staging: str
    round: str
    apply_every: int
    announce_applies: bool
    def __init__(self) -> None: ...

class StepReport:
    """What one Learner.step() (or GroupLearner.step()) did."""
    def __init__(self, *, sent: Optional[int] = None, applied: Sequence[int] = (), versions: Sequence[int] = (),
                 waited: bool = False) -> None:
        """A report made in Python (GroupLearner's other ranks); one version per applied fragment."""
    @property
    def sent(self) -> Optional[int]:
        """The fragment sent at this step, or None."""
    @property
    def applied(self) -> List[int]:
        """The fragments whose merged global was written into the parameters at this step (ascending)."""
    @property
    def versions(self) -> List[int]:
        """The version of each global in applied (same order)."""
    @property
    def waited(self) -> bool:
        """Lock-step only: the step waited for a global."""
    @property
    def announced(self) -> List[int]:
        """announce_applies (a group's leader, pull rounds): the fragments whose global this step announced,
        to be applied at the next step that may apply (ascending); empty otherwise."""
    @property
    def announced_versions(self) -> List[int]:
        """The version of each global in announced (same order)."""

class LearnerCore:
    """An OuterLoop over ZeroMQ whose tensors are the given torch parameters (in place on the
    CPU, staged copies of the due fragment otherwise). See ddiloco.Learner."""
    def __init__(self, options: LearnerOptions, names: Sequence[str], tensors: list, embedding: Sequence[bool],
                 float32: object, copy_out: Callable[[object, memoryview], None],
                 copy_in: Callable[[object, memoryview], None]) -> None:
        """Checks every tensor (float32, dense, contiguous, non-empty), builds the plan and connects."""
    def join(self) -> None:
        """Fetches the global state and writes it into the tensors; releases the GIL while waiting."""
    def step(self, tokens: int) -> StepReport:
        """One inner step done: sends the due fragment, applies arrived globals (non-blocking unless lock-step,
        which releases the GIL while it waits)."""
    def leave(self) -> None:
        """Tells the syncer this learner is going away (releases the GIL)."""
    def close(self) -> None:
        """Leaves if joined and closes the socket."""
    @property
    def joined(self) -> bool: ...
    @property
    def staged(self) -> bool:
        """True when tensors go through host copies."""
    def status(self) -> dict:
        """OuterLoop counters, base_versions per fragment and the ZeroMQ counters."""
    def plan(self) -> dict:
        """fingerprint, fragments (tensor names of each), fragment_numel (floats of each), embedding (names),
        numel."""
    def due_at(self, step: int) -> Optional[int]:
        """The fragment due to be sent at inner step `step` (1-based), or None."""
    def copy_applied(self, fragment: int, out: np.ndarray) -> int:
        """Copies the global of `fragment` that the last step applied (its fragment_numel float32 values, in
        fragment order) into `out` (writable, float32, contiguous, exactly that size); returns its version.
        StateError if the last step did not apply that fragment. A group's leader broadcasts these values."""
    def copy_announced(self, fragment: int, out: np.ndarray) -> int:
        """The same for a global that the last step announced (announce_applies); StateError if it did not
        announce that fragment."""

class FollowerCore:
    """A rank of a group learner other than its leader (see ddiloco.GroupLearner): the leader's plan and
    parameter contracts (the same checks and messages as LearnerCore), no connection."""
    def __init__(self, options: LearnerOptions, names: Sequence[str], tensors: list, embedding: Sequence[bool],
                 float32: object, copy_out: Callable[[object, memoryview], None],
                 copy_in: Callable[[object, memoryview], None]) -> None:
        """Checks every tensor and builds the plan from options.fragments; options.alpha is the leader's."""
    def apply(self, fragment: int, version: int, values: np.ndarray) -> None:
        """Writes a global the leader's step applied (float32, contiguous, the fragment's numel values in
        fragment order) into the parameters with the leader's arithmetic, alpha * theta + (1 - alpha) * global
        (the C++ FragmentApplier), and records its version. Raises naming a bad fragment, size or dtype."""
    def check_all(self) -> None:
        """Checks every parameter's contracts again (at a join)."""
    def set_versions(self, versions: Sequence[int]) -> None:
        """The leader's base versions (one per fragment), at a join."""
    @property
    def staged(self) -> bool:
        """True when tensors go through host copies."""
    def status(self) -> dict:
        """applies (globals applied since creation) and base_versions (per fragment)."""
    def plan(self) -> dict:
        """fingerprint, fragments, fragment_numel, embedding, numel (as LearnerCore.plan)."""

class SyncerOptions:
    """Settings of a SyncerCore; ddiloco.Syncer's keywords (seconds as *_s)."""
    bind: str
    fragments: int
    overlap: int
    sync_every: int
    round: str
    pull_timeout_s: float
    reask_after_steps: int
    quorum: int
    grace_gamma: float
    grace_cap_s: float
    deadline_s: float
    max_staleness: int
    heartbeat_timeout_s: float
    send_merged_to: str
    merge: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    global_codec: str
    plaintext: bool
    keys: str
    allow: str
    workers: int
    sync_every: int
    checkpoint_dir: str
    shard_index: int
    shard_count: int
    def __init__(self) -> None: ...

class SyncerCore:
    """Syncer + SyncerRuntime + ZmqSyncerTransport in this process. See ddiloco.Syncer."""
    def __init__(self, options: SyncerOptions, names: Sequence[str], numels: Sequence[int],
                 embedding: Sequence[bool], init: np.ndarray, shapes: Sequence[Sequence[int]] = ...) -> None:
        """Builds the plan, binds the socket; `init` is the flat float32 initial state in model order; `shapes`
        (optional) the tensors' shapes for the checkpoints. With options.checkpoint_dir it resumes from the
        newest valid checkpoint there (a new epoch, written back at once)."""
    def checkpoint(self) -> str:
        """Writes the whole state into checkpoint_dir (atomically, a new serial); returns the path."""
    @property
    def resumed_from(self) -> str:
        """The checkpoint resumed from, or ''."""
    @property
    def skipped_checkpoints(self) -> List[str]:
        """Damaged checkpoints passed over ('path: reason')."""
    @property
    def checkpoint_serial(self) -> int:
        """The serial of the last checkpoint written or resumed from."""
    def start(self) -> None:
        """Starts serving on background threads (releases the GIL)."""
    def stop(self) -> None:
        """Stops serving, finishing queued work (releases the GIL)."""
    def close(self) -> None:
        """Stops and unbinds."""
    def status(self) -> dict:
        """SyncerStatus and ZeroMQ counters as a dict ('line': one printable line)."""
    def global_parameters(self) -> np.ndarray:
        """A copy of the global parameters, flat float32 in model order."""
    @property
    def endpoint(self) -> str:
        """The bound endpoint with its actual port."""
    @property
    def fingerprint(self) -> int:
        """The plan fingerprint."""

def read_tensor_list(path: str) -> List[Tuple[str, int, bool]]:
    """A tensor list file (`name numel [embedding]` per line): [(name, numel, embedding)]."""

class sim:
    """The simulator's models (sim/goodput.hpp, sim/bandwidth.hpp); see ddiloco.sim."""
    class FailureModel:
        chip_mtbi_hours: float
        slice_chips: float
        speed_cv: float
        spare_fraction: float
        """Spare slices as a fraction of the slices (rounded up); 0: none."""
        spare_swap_s: float
        """From taking a spare to its slice running in the job; 0: within the stall."""
        recovery_mean_s: float
    class SystemCosts:
        restart_s: float
        reconfigure_s: float
    class DecoupledConfig:
        learners: int
        fragments: int
        sync_every: int
        overlap: int
        link_latency_s: float
        sync_s: float
        min_quorum: int
        gamma: float
        grace_cap_steps: float
        deadline_steps: float
    class GoodputConfig:
        system: str
        chips: float
        horizon_hours: float
        step_s: float
        seed: int
        series_bin_s: float
        failures: "sim.FailureModel"
        costs: "sim.SystemCosts"
        decoupled: "sim.DecoupledConfig"
    class BandwidthScenario:
        params: float
        layers: int
        step_s: float
        backward_fraction: float
        sync_every: int
        fragments: int
        overlap: int
        bits: float
        quantized_bits: float
        workers: int
        latency_s: float
        gbit: float
        decoupled_fragments: int
        decoupled_sync_every: int
        decoupled_overlap: int
        decoupled_learners: int
        decoupled_quorum: int
        send_merged_to: str
        global_bits: float
    @staticmethod
    def simulate_goodput(config: "sim.GoodputConfig") -> dict:
        """Runs the goodput simulation (releases the GIL)."""
    @staticmethod
    def data_parallel_goodput_closed_form(chips: float, chip_mtbi_hours: float, restart_s: float,
                                          step_s: float) -> float: ...
    @staticmethod
    def compute_utilisation(method: str, scenario: "sim.BandwidthScenario", gbps: float) -> float: ...
    @staticmethod
    def bandwidth_for_utilisation(method: str, scenario: "sim.BandwidthScenario", target: float) -> float: ...
    @staticmethod
    def decoupled_link(scenario: "sim.BandwidthScenario", gbps: float) -> dict: ...
