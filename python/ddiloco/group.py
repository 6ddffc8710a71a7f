"""ddiloco.GroupLearner: one learner made of the R ranks of a torch.distributed group.

The ranks hold replicated parameters (data parallel inside the learner, e.g.
DDP, whose all-reduced gradients keep them equal). One rank, the leader, holds
the learner (ddiloco.Learner: the OuterLoop and the connection to the syncer);
the others hold a ddiloco._core.FollowerCore (the same plan, no connection).
Every rank calls step() after every inner step. At a step that may apply (push
rounds: a send awaiting its global, from send + tau on: every rank knows these
from the schedule, which sends at each due step, and from the previous header,
which says which sends the leader really made; pull rounds: the multiples of
apply_every, the only steps at which the leader's OuterLoop applies a global,
since a pull may come and a global arrive at any step) the leader steps its learner and
broadcasts over the group which globals it applied and which sends still
await theirs, then the values, and every other rank applies them with the
leader's arithmetic (the C++ FragmentApplier) in the same step: the ranks stay
bit-identical. The leader posts its broadcasts and does not wait for the
others. In pull rounds each apply is announced one such step ahead (the
leader's Learner runs with announce_applies), so the others receive at step t
what every rank applies at t + apply_every and never wait for the leader's
step. At the other steps (a due step included) the leader steps alone and
the others only count. No maths here: only the collectives and the bookkeeping.
"""
from __future__ import annotations

import inspect
import struct
from typing import Optional

import torch
import torch.distributed as dist

from . import _core
from ._params import NamedParameters, default_fragments, embedding_flags, fill, named_parameters, reject_unknown
from .learner import Learner, StepReport, _copy_in, _copy_out

_WHO = "ddiloco.GroupLearner"
_TOKEN_COUNTS = ("sum", "leader")
_ROUNDS = ("pull", "push")
# The header the leader broadcasts at each step that may apply: [count applied (-1: the leader failed), sent
# (-1: none), waited, fragment ids (P slots), versions (P slots), the step of each fragment's send awaiting
# its global (P slots, -1: none)].
_FAILED = -1
# A step's header and the globals it may apply travel in one broadcast when these hold at most this many
# floats together (1 MiB): the slots of globals not applied are sent too, which costs less than a second
# collective at this size.
_FOLD_FLOATS = 1 << 18
_NEVER = float("inf")


def _error(cls, text: str) -> Exception:
    """A ddiloco.Error raised from Python, with the id prefix the C++ ones carry."""
    ids = {_core.InvalidArgument: "ddiloco.invalid_argument", _core.ShapeMismatch: "ddiloco.shape_mismatch",
           _core.StateError: "ddiloco.state", _core.TransportError: "ddiloco.transport"}
    return cls(f"[{ids[cls]}] {_WHO}: {text}")


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    if hasattr(dist, "get_global_rank"):  # torch >= 2.0
        return dist.get_global_rank(group, group_rank)
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_global_rank(group, group_rank)


class GroupLearner:
    """One learner of a Decoupled DiLoCo run made of every rank of ``group``
    (a ``torch.distributed`` process group, default the whole world; gloo for
    CPU parameters, NCCL for CUDA ones), which hold replicated parameters.

    Create it on every rank with the same arguments, then call ``join()`` and,
    after every inner ``optimizer.step()``, ``step(tokens)`` on every rank
    (both are collectives over the group). The rank ``leader`` (a rank within
    the group) talks to the syncer as learner ``id``; the others apply what its
    steps apply, at the same step, and stay bit-identical to it.

    ``token_count``: ``"sum"`` (default): ``step(tokens)`` takes this rank's
    tokens and the learner accounts the group's sum (the others' are added at
    the next step that communicates; every send is one); ``"leader"``: the
    leader's argument is the group's total and the others' are ignored.

    ``round``: 'pull' (default) or 'push', as ``ddiloco.Learner``. In pull
    rounds ``apply_every`` (default H / P, at least 1): globals are applied, and
    the ranks communicate, only at the steps that are multiples of it (a global
    waits at most apply_every - 1 steps for one).

    The other keywords are ``ddiloco.Learner``'s; every rank must pass the same
    ``fragments``, ``alpha``, ``sync_every``, ``overlap``, ``round``,
    ``apply_every`` and ``embedding`` (checked at creation). Set the group's timeout
    (``init_process_group(timeout=...)``) above ``join_timeout`` and, in
    lock-step mode, above ``lock_step_timeout``: the other ranks wait in a
    collective while the leader joins or waits. A collective that fails (a
    rank died) raises ``ddiloco.TransportError`` on the ranks that see it, and
    the leader leaves the run: the group's learner is down; restart every rank,
    and it rejoins as a whole. See docs/python.md, "Learners that are groups".
    """

    def __init__(self, model: NamedParameters, *, endpoint: str, id: int, group=None, leader: int = 0,
                 token_count: str = "sum", **learner_keywords):
        if not (dist.is_available() and dist.is_initialized()):
            raise _error(_core.StateError, "torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group(backend, ..., timeout=...) on every rank first")
        known = {p.name for p in inspect.signature(Learner.__init__).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY}
        reject_unknown(_WHO, Learner.__init__, {k: v for k, v in learner_keywords.items() if k not in known})
        if token_count not in _TOKEN_COUNTS:
            raise _error(_core.InvalidArgument, f"token_count = {token_count!r} must be 'sum' (each rank passes its "
                         "own tokens; the group's sum is accounted) or 'leader' (the leader passes the group's)")
        # Push rounds: the ranks communicate at the steps the schedule may apply at. Pull rounds: a global
        # may arrive at any step, so the leader applies globals only at multiples of apply_every
        # (OuterLoopConfig::apply_every) and the ranks communicate there.
        signature = inspect.signature(Learner.__init__).parameters
        round_mode = learner_keywords.get("round", signature["round"].default)
        if round_mode not in _ROUNDS:
            raise _error(_core.InvalidArgument, f"round = {round_mode!r} must be 'pull' (the default) or 'push'")
        self._pull = round_mode == "pull"
        if "apply_every" in learner_keywords and not self._pull:
            raise _error(_core.InvalidArgument, f"apply_every = {learner_keywords['apply_every']!r} needs "
                         "round='pull' (push rounds apply at their schedule's steps); leave it out")
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise _error(_core.InvalidArgument, f"this process (global rank {dist.get_rank()}) is not in the group "
                         "it was given; create the GroupLearner only on the ranks of its group, with that group")
        if isinstance(leader, bool) or not (isinstance(leader, int) and 0 <= leader < self.group_size):
            raise _error(_core.InvalidArgument, f"leader = {leader!r} is not a rank of the group (0 to "
                         f"{self.group_size - 1}); pass the group rank of the process that talks to the syncer")
        self.leader = leader
        self.is_leader = self.rank == leader
        self.id = id
        self._src = _global_rank(group, leader)
        self._token_count = token_count
        backend = dist.get_backend(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._down: Optional[str] = None
        self._step = 0           # the leader's inner step count (its schedule's clock), on every rank
        self._synced_step = 0    # the last step at which the ranks communicated
        self._synced_steps = 0   # how many steps communicated
        self._own_tokens = 0     # the tokens this rank passed to step()
        self._unsent_tokens = 0  # token_count="sum", not the leader: tokens not yet counted by the leader
        self._sent_at = {}       # fragment -> step of its send that may await its result (as every rank knows it)
        self._eligible_from = _NEVER  # the first step at which one of those may be applied
        self._pending = {}       # the leader: fragment -> step of its send awaiting the result (its OuterLoop's)
        self._posted = []        # the leader: its broadcasts in flight
        self._fold = None        # the buffer of a step's header and values in one broadcast (CPU groups)
        self._fold_floats = _FOLD_FLOATS
        self._tokens_step = 0    # token_count="sum": the last step at which the group's tokens were summed

        names, tensors, modules = named_parameters(model, _WHO)
        self.names = names
        self.parameters = tensors
        if self._pull:
            every = learner_keywords.get("apply_every")
            if every is None:  # one communicating step per slot of the schedule: H / P steps apart
                h = learner_keywords.get("sync_every", signature["sync_every"].default)
                p_count = default_fragments(learner_keywords.get("fragments"), len(names))
                every = max(1, h // p_count) if isinstance(h, int) and isinstance(p_count, int) and p_count > 0 else 1
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise _error(_core.InvalidArgument, f"apply_every = {every!r} must be an int >= 1: the ranks apply "
                             "globals (and communicate) only at the steps that are multiples of it")
            learner_keywords["apply_every"] = every
            # The leader announces each apply one step that may apply ahead, so the others learn at step t what
            # every rank applies at t + apply_every and never wait for the leader's step (see _pull_grid).
            learner_keywords["announce_applies"] = True
        self._apply_every = learner_keywords.get("apply_every", 1)
        alpha = learner_keywords.get("alpha", signature["alpha"].default)
        sync_every = learner_keywords.get("sync_every", signature["sync_every"].default)
        overlap = learner_keywords.get("overlap", signature["overlap"].default)
        failure: Optional[BaseException] = None
        self._learner: Optional[Learner] = None
        self._closed_status: Optional[dict] = None
        self._follower = None
        try:
            if self.is_leader:
                self._learner = Learner(model, endpoint=endpoint, id=id, **learner_keywords)
                plan = self._learner.plan
            else:
                flags = embedding_flags(names, tensors, modules, learner_keywords.get("embedding"), _WHO)
                o = _core.LearnerOptions()
                fill(_WHO, o, {
                    "fragments": ("fragments", default_fragments(learner_keywords.get("fragments"), len(names))),
                    "alpha": ("alpha", alpha), "sync_every": ("sync_every", sync_every),
                    "overlap": ("overlap", overlap),
                    "staging": ("staging", learner_keywords.get("staging", signature["staging"].default))})
                self._follower = _core.FollowerCore(o, names, tensors, flags, torch.float32, _copy_out, _copy_in)
                plan = self._follower.plan()
        except BaseException as e:  # the others must not wait for this rank: say it in the check below
            failure, plan = e, None

        # Every rank checks that every other one built the same plan with the same alpha, schedule and
        # token count.
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, sync_every, overlap))
        mine = torch.tensor([0 if failure else 1, _signed64(plan["fingerprint"]) if plan else 0,
                             _float_bits(float(alpha)) if numbers else 0, _TOKEN_COUNTS.index(token_count), leader,
                             plan["numel"] if plan else 0, int(sync_every) if numbers else 0,
                             int(overlap) if numbers else 0, _ROUNDS.index(round_mode), self._apply_every],
                            dtype=torch.int64, device=self._device)
        everyone = [torch.empty_like(mine) for _ in range(self.group_size)]
        self._collective(lambda: dist.all_gather(everyone, mine, group=group), "the creation check")
        rows = [r.tolist() for r in everyone]
        if failure is not None:
            self._close_learner()
            raise failure
        broken = [r for r, row in enumerate(rows) if row[0] == 0]
        if broken:
            self._close_learner()
            raise _error(_core.StateError, f"rank {self.rank}: ranks {broken} of the group failed to create their "
                         "GroupLearner (their errors say why); fix them and create it again on every rank")
        different = [r for r, row in enumerate(rows) if row[1:] != rows[leader][1:]]
        if different:
            self._close_learner()
            r = different[0]
            raise _error(_core.InvalidArgument, f"rank {r} built a different learner from the leader's (rank "
                         f"{leader}): plan fingerprint {rows[r][1] & ((1 << 64) - 1):016x} vs "
                         f"{rows[leader][1] & ((1 << 64) - 1):016x}, {rows[r][5]} vs {rows[leader][5]} parameters, "
                         f"alpha bits {rows[r][2]} vs {rows[leader][2]}, token_count "
                         f"{_TOKEN_COUNTS[rows[r][3]]!r} vs {_TOKEN_COUNTS[rows[leader][3]]!r}, leader {rows[r][4]} "
                         f"vs {rows[leader][4]}, sync_every {rows[r][6]} vs {rows[leader][6]}, overlap {rows[r][7]} "
                         f"vs {rows[leader][7]}, round {_ROUNDS[rows[r][8]]!r} vs {_ROUNDS[rows[leader][8]]!r}, "
                         f"apply_every {rows[r][9]} vs {rows[leader][9]}; create it on every rank from the same model "
                         "with the same fragments=, alpha=, embedding=, sync_every=, overlap=, round=, apply_every=, "
                         "token_count= and leader=")
        self.plan = plan
        numels = plan["fragment_numel"]
        count = len(numels)
        self._count = count
        # The step header and its host side (the same tensor on the CPU), written and read through numpy.
        self._header_host = torch.zeros(3 + 3 * count, dtype=torch.int64)
        self._header = self._header_host if self._device.type == "cpu" else self._header_host.to(self._device)
        self._header_np = self._header_host.numpy()
        self._leader_nothing = None
        self._tokens_buffer = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._values = torch.empty(max(numels), dtype=torch.float32, device=self._device)
        # Host side of the values: the buffer itself on the CPU, a staging copy for a device group.
        self._host = self._values if self._device.type == "cpu" else torch.empty(max(numels), dtype=torch.float32)
        self._host_np = self._host.numpy()
        self._nothing = StepReport()
        self._sent_reports = [StepReport(sent=p) for p in range(count)]  # the others' reports at a due step
        self._overlap = int(overlap)
        self._due_at = self._learner._core.due_at if self.is_leader else self._follower.due_at
        # Pull rounds: every fragment may be announced at a step that may apply; its header and the announced
        # values travel in one broadcast (slots for every fragment) when they fit in _FOLD_FLOATS (CPU groups).
        self._pull_slots = {}
        if self._device.type == "cpu":
            at = 0
            for f in range(count):
                self._pull_slots[f] = at
                at += numels[f]
        self._pull_floats = sum(numels)
        self._inflight = None    # the others, pull rounds: the receive of the leader's last announcement
        self._announced = []     # the leader, pull rounds: (fragment, version) announced at the last grid step
        self._joined = False

    # ---- collectives -------------------------------------------------------------------

    def _collective(self, call, what: str):
        try:
            return call()
        except RuntimeError as e:  # gloo / NCCL: a peer closed its connection, or the group's timeout passed
            self._down = (f"a collective with the other ranks failed during {what} at step {self._step} ({e}); "
                          "a rank of the group died or stopped calling step()")
            self._close_learner()
            raise _error(_core.TransportError, f"rank {self.rank} of group learner {self.id}: {self._down}: the "
                         "group's learner is down (the leader left the run); restart every rank of the group, and it "
                         "rejoins as a whole") from e

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self._collective(lambda: dist.broadcast(tensor, src=self._src, group=self.group), what)

    def _close_learner(self) -> None:
        if self._learner is not None and self._closed_status is None:
            try:
                self._closed_status = self._learner.status()  # status() keeps answering after the close
                self._closed_status["joined"] = False
                self._learner.close()
            except Exception:  # best effort: the group is going down anyway
                pass

    def _check_up(self, what: str) -> None:
        if self._down is not None:
            raise _error(_core.StateError, f"{what}() on rank {self.rank}: the group's learner is down ({self._down}); "
                         "create a new GroupLearner on every rank (after restarting the group)")

    # ---- the learner ---------------------------------------------------------------------

    def join(self) -> "GroupLearner":
        """Collective: the leader fetches the global state from the syncer (at most ``join_timeout``
        seconds, releasing the GIL), then broadcasts it to every rank, which writes it into its parameters."""
        self._check_up("join")
        if self.is_leader:
            self._finish_posted()
        count = len(self.plan["fragment_numel"])
        header = torch.zeros(2 + count, dtype=torch.int64, device=self._device)
        failure: Optional[BaseException] = None
        if self.is_leader:
            try:
                self._learner.join()
                st = self._learner.status()
                header[0] = 1
                header[1] = st["step"]
                header[2:] = torch.tensor(st["base_versions"], dtype=torch.int64)
            except BaseException as e:
                failure = e
        self._broadcast(header, "join")
        h = header.tolist()
        if h[0] != 1:
            self._down = f"the leader (rank {self.leader}) could not join"
            if failure is not None:
                raise failure
            raise _error(_core.StateError, f"rank {self.rank}: the group's leader (rank {self.leader}) could not join "
                         "the run (its error says why); fix it and create the GroupLearner again on every rank")
        with torch.no_grad():
            flat = torch.empty(self.plan["numel"], dtype=torch.float32, device=self._device)
            if self.is_leader:
                torch.cat([p.detach().reshape(-1).to(self._device) for p in self.parameters], out=flat)
            else:
                self._follower.check_all()
            self._broadcast(flat, "join")
            if not self.is_leader:
                offset = 0
                for p in self.parameters:
                    n = p.numel()
                    p.copy_(flat[offset:offset + n].view(p.shape))
                    offset += n
                self._follower.set_versions(h[2:])
        self._step = self._synced_step = h[1]  # the leader's step count (its schedule's clock)
        self._inflight = None
        self._announced = []
        self._sent_at = {}
        self._pending = {}
        self._eligible_from = _NEVER
        self._unsent_tokens = 0
        self._tokens_step = h[1]
        self._joined = True
        return self

    def step(self, tokens: int) -> StepReport:
        """Collective: call on every rank once after every inner ``optimizer.step()``. The leader steps its
        learner (sends the due fragment, applies arrived globals); every rank applies the same globals at this
        step. Returns the same StepReport on every rank. The ranks communicate only at the steps that may
        apply (from a send + tau until its global is applied: one broadcast of a header, then one per applied
        global), and with token_count="sum" at the steps a fragment is due (one all-reduce of the tokens);
        the others cost no collective. The leader does not wait for the others: it posts its broadcasts and
        returns."""
        if self._down is not None or not self._joined:
            self._check_up("step")
            raise _error(_core.StateError, "step() called before join(); call join() on every rank first")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise _error(_core.InvalidArgument, f"tokens = {tokens!r} must be an int > 0 (a contribution's weight is "
                         "tokens^2 / steps: 0 would give this rank's progress no weight); pass the tokens this inner "
                         "step processed (batch x sequence length)")
        self._step += 1
        t = self._step
        self._own_tokens += tokens
        if self._pull:
            return self._pull_step(t, tokens)
        due = self._due_at(t)
        if due is not None and self._token_count == "sum":
            # A step that may send: the contribution carries the group's tokens up to this step.
            tokens = self._sum_tokens(tokens)
        elif not self.is_leader:
            self._unsent_tokens += tokens
        if due is not None:
            # Every rank takes a fragment due here as sent (a send the leader did not make is corrected by the
            # next header); with tau = 0 its global may be applied at this very step.
            self._believe_sent(due, t)
        if t < self._eligible_from:
            # Nothing can be applied at this step (every rank knows the sends that may be awaiting their global):
            # the leader steps alone; the others only count.
            if not self.is_leader:
                return self._nothing if due is None else self._sent_reports[due]
            report = self._learner.step(tokens)
            if report is not self._leader_nothing:
                if report.applied or report.waited or (report.sent is not None and report.sent != due):
                    self._down = f"the leader's step {t} did what the group did not expect ({report})"
                    self._close_learner()
                    raise _error(_core.StateError, f"rank {self.rank}: {self._down}; this is a bug in ddiloco: "
                                 "please report it with the learner's keywords")
                if report.sent is None:
                    self._leader_nothing = report  # LearnerCore returns one shared object for such steps
                else:
                    self._pending[report.sent] = t
            return report
        # The fragments whose send + tau has come may be applied here.
        return self._communicate(t, tokens, sorted(f for f, at in self._sent_at.items() if at + self._overlap <= t))

    def _pull_step(self, t: int, tokens: int) -> StepReport:
        """Pull rounds: the leader answers pulls and sends metadata at every step, alone; globals are applied
        only at the multiples of apply_every, where every rank communicates (any fragment may be applied)."""
        at_grid = t % self._apply_every == 0
        if at_grid and self._token_count == "sum":
            tokens = self._sum_tokens(tokens)  # the group's tokens up to this step
        elif not self.is_leader:
            self._unsent_tokens += tokens
        if at_grid:
            return self._pull_grid(t, tokens)
        if not self.is_leader:
            return self._nothing
        report = self._learner.step(tokens)
        if report.applied:
            self._down = f"the leader's step {t} applied {report.applied} off the apply_every grid"
            self._close_learner()
            raise _error(_core.StateError, f"rank {self.rank}: {self._down}; this is a bug in ddiloco: please "
                         "report it with the learner's keywords")
        return report

    def _pull_grid(self, t: int, tokens: int) -> StepReport:
        """Pull rounds, a step that may apply: every rank applies the globals the leader announced at the previous
        such step (apply_every steps ago), and the leader announces those its learner applies at the next one.
        The announcement is posted by the leader and received by the others without waiting: they wait only
        for the previous one, which came apply_every steps ago. Small models: the announced values travel with
        it. Larger ones: the values of the globals applied here follow at this step, and the others wait for
        them only at a step that applies."""
        count = self._count
        numels = self.plan["fragment_numel"]
        fold = bool(self._pull_slots) and self._pull_floats <= self._fold_floats
        message, h, folded = self._message(fold, self._pull_floats)
        self._synced_step = t
        self._synced_steps += 1
        if self.is_leader:
            self._finish_posted()  # the announcement of the previous such step is out: its buffer is free
            failure: Optional[BaseException] = None
            report = None
            try:
                report = self._learner.step(tokens)
                if [(f, v) for f, v in zip(report.applied, report.versions)] != self._announced:
                    raise _error(_core.StateError, f"rank {self.rank}: the leader's step {t} applied "
                                 f"{list(zip(report.applied, report.versions))} but announced {self._announced}; "
                                 "this is a bug in ddiloco: please report it with the learner's keywords")
            except BaseException as e:
                failure = e
            if not fold:  # the values of what the others apply here (announced before), whatever happened since
                for i, (fragment, _) in enumerate(self._announced):
                    values, host = self._leader_buffer(numels[fragment], first=i == 0)
                    if failure is None:
                        self._learner._core.copy_applied(fragment, host.numpy())
                        if values is not host:
                            values.copy_(host)
                    self._post(values, "step")
            self._announced = []
            if failure is None:
                try:
                    n = len(report.announced)
                    h[0], h[1], h[2] = n, -1, 0
                    h[3:3 + n] = report.announced
                    h[3 + count:3 + count + n] = report.announced_versions
                    if fold:
                        for fragment in report.announced:
                            at = self._pull_slots[fragment]
                            self._learner._core.copy_announced(fragment, folded[at:at + numels[fragment]])
                    self._announced = list(zip(report.announced, report.announced_versions))
                except BaseException as e:
                    failure = e
            if failure is not None:
                h[0] = _FAILED
            if not fold and self._header is not self._header_host:
                self._header.copy_(self._header_host)
            self._post(message, "step")
            if failure is not None:
                self._down = f"the leader's step {t} failed: {failure}"
                self._close_learner()
                raise failure
            return report
        ids, versions = [], []
        if self._inflight is not None:  # the leader's announcement of the previous such step: applied now
            work, self._inflight = self._inflight, None
            self._collective(work.wait, f"the announcement of step {t - self._apply_every}")
            if not fold and self._header is not self._header_host:
                self._header_host.copy_(self._header)
            ids, versions = self._named(h, t - self._apply_every)
            for fragment, version in zip(ids, versions):
                if fold:
                    at = self._pull_slots[fragment]
                    self._follower.apply(fragment, version, folded[at:at + numels[fragment]])
                else:
                    self._receive_and_apply(fragment, version, numels[fragment])
        self._inflight = self._collective(
            lambda: dist.broadcast(message, src=self._src, group=self.group, async_op=True), "step")
        if not ids:
            return self._nothing
        return StepReport(applied=ids, versions=versions)

    def _communicate(self, t: int, tokens: int, fragments) -> StepReport:
        """A step at which the ranks communicate: the leader steps its learner and broadcasts what it applied
        (a header, and the values); every rank applies the same globals. `fragments`: those that may be applied
        here, in order."""
        count = self._count
        numels = self.plan["fragment_numel"]
        # One broadcast for the header and the values when the globals that may be applied here are small
        # (each of `fragments` in its own slot; slots of globals not applied carry nothing): a step then makes
        # one collective, not 1 + applied. Larger ones go after the header.
        slots, total = {}, 0
        if self._device.type == "cpu":
            for f in fragments:
                slots[f] = total
                total += numels[f]
        fold = bool(slots) and total <= self._fold_floats
        message, h, folded = self._message(fold, total)
        failure: Optional[BaseException] = None
        report = None
        if self.is_leader:
            self._finish_posted()  # the header and value buffers are free again
            try:
                report = self._learner.step(tokens)
                applied = report.applied
                n = len(applied)
                if fold:
                    for fragment in applied:
                        if fragment not in slots:
                            raise _error(_core.StateError, f"rank {self.rank}: the leader's step {t} applied fragment "
                                         f"{fragment}, whose send + tau the group had not reached ({report}); this "
                                         "is a bug in ddiloco: please report it with the learner's keywords")
                        at = slots[fragment]
                        self._learner._core.copy_applied(fragment, folded[at:at + numels[fragment]])
                if report.sent is not None and not self._pull:  # (pull rounds: answers await nothing)
                    self._pending[report.sent] = t
                for fragment in applied:
                    self._pending.pop(fragment, None)
                h[0], h[1], h[2] = n, -1 if report.sent is None else report.sent, int(report.waited)
                h[3:3 + n] = applied
                h[3 + count:3 + count + n] = report.versions
                h[3 + 2 * count:] = -1
                for fragment, sent_at in self._pending.items():
                    h[3 + 2 * count + fragment] = sent_at
            except BaseException as e:
                failure = e
                h[0] = _FAILED
            if not fold and self._header is not self._header_host:
                self._header.copy_(self._header_host)
            self._post(message, "step")
        else:
            self._broadcast(message, "step")
        if failure is not None:
            self._down = f"the leader's step {t} failed: {failure}"
            self._close_learner()
            raise failure
        if not fold and not self.is_leader and self._header is not self._header_host:
            self._header_host.copy_(self._header)
        ids, versions = self._named(h, t)
        self._synced_step = t
        self._synced_steps += 1
        sent = int(h[1])
        # The sends awaiting their result, as the leader's OuterLoop keeps them (the header says which).
        self._sent_at = {f: int(v) for f, v in enumerate(h[3 + 2 * count:]) if v >= 0}
        self._eligible_from = min(self._sent_at.values()) + self._overlap if self._sent_at else _NEVER
        for fragment, version in zip(ids, versions):
            size = numels[fragment]
            if fold:
                if not self.is_leader:
                    at = slots[fragment]
                    self._follower.apply(fragment, version, folded[at:at + size])
            elif self.is_leader:
                values, host = self._leader_buffer(size, first=len(self._posted) == 1)  # only the header is out
                self._learner._core.copy_applied(fragment, host.numpy())
                if values is not host:
                    values.copy_(host)
                self._post(values, "step")
            else:
                self._receive_and_apply(fragment, version, size)
        if self.is_leader:
            return report
        if not ids and sent < 0 and h[2] == 0:
            return self._nothing
        return StepReport(sent=None if sent < 0 else sent, applied=ids, versions=versions, waited=bool(h[2]))

    def _message(self, fold: bool, floats: int):
        """(message, h, folded) of a step's broadcast: folded, one buffer of the header and `floats` values (h
        and folded: numpy views of its parts); else the header alone (h: its host view, folded None)."""
        if not fold:
            return self._header, self._header_np, None
        header_bytes = 8 * (3 + 3 * self._count)
        need = header_bytes + 4 * floats
        if self._fold is None or self._fold.numel() < need:
            self._fold = torch.empty(need, dtype=torch.uint8)
        message = self._fold[:need]
        return message, message[:header_bytes].view(torch.int64).numpy(), message[header_bytes:].view(
            torch.float32).numpy()

    def _named(self, h, step: int):
        """(fragments, versions) a header of the leader's `step` names; StateError if it says the leader failed."""
        n = int(h[0])
        if n == _FAILED:
            self._down = f"the leader (rank {self.leader}) failed at step {step}"
            raise _error(_core.StateError, f"rank {self.rank}: the group's leader (rank {self.leader}) failed at step "
                         f"{step} and took the group's learner down (its error says why); restart every rank of the "
                         "group: it rejoins as a whole")
        count = self._count
        return [int(x) for x in h[3:3 + n]], [int(x) for x in h[3 + count:3 + count + n]]

    def _receive_and_apply(self, fragment: int, version: int, size: int) -> None:
        """The others: receive one global from the leader's broadcast and apply it."""
        values = self._values[:size]
        self._broadcast(values, "step")
        if self._values is not self._host:
            self._host[:size].copy_(values)
        self._follower.apply(fragment, version, self._host_np[:size])

    # ---- the leader's broadcasts, posted without waiting ----------------------------------

    def _sum_tokens(self, tokens: int) -> int:
        """token_count="sum", at a step that may send: the group's tokens since the last such step."""
        b = self._tokens_buffer
        b.fill_(tokens if self.is_leader else self._unsent_tokens + tokens)
        self._collective(lambda: dist.all_reduce(b, group=self.group), "step")
        self._unsent_tokens = 0
        self._tokens_step = self._step
        return int(b.item())

    def _believe_sent(self, fragment: int, t: int) -> None:
        """A send of `fragment` at step t, as every rank assumes it. A fragment already awaiting its global
        keeps its earlier step: if the new send fails, the earlier one's global may still be applied (and if
        it succeeds, the group merely looks for it from the earlier step on)."""
        if fragment not in self._sent_at:
            self._sent_at[fragment] = t
            self._eligible_from = min(self._eligible_from, t + self._overlap)

    def _post(self, tensor: torch.Tensor, what: str) -> None:
        """The leader's side of a broadcast, without waiting for the others to take it: the leader's step
        does not wait for the other ranks. The buffer is not written again before the broadcast is done."""
        work = self._collective(lambda: dist.broadcast(tensor, src=self._src, group=self.group, async_op=True), what)
        self._posted.append(work)

    def _finish_posted(self) -> None:
        """Waits for the leader's posted broadcasts (the others took them at the step they were posted:
        done by now, unless a rank died, which this reports)."""
        posted, self._posted = self._posted, []
        for work in posted:
            self._collective(work.wait, f"a broadcast of step {self._synced_step}")

    def _leader_buffer(self, size: int, first: bool):
        """(values, host) buffers of an applied fragment's broadcast: the shared one for the first fragment of a
        step, a fresh one for each further fragment of the same step (its broadcast may still be in flight)."""
        if first:
            return self._values[:size], self._host[:size]
        host = torch.empty(size, dtype=torch.float32)
        return (host if self._values is self._host else torch.empty(size, dtype=torch.float32, device=self._device),
                host)

    def leave(self) -> None:
        """The leader tells the syncer the group's learner is going away (best effort); a no-op elsewhere."""
        if self._learner is not None:
            self._learner.leave()

    def close(self) -> None:
        """The leader leaves if joined and closes the connection; a no-op elsewhere. Not a collective, but
        the leader first waits until its last broadcasts have been handed to the group (a rank that died
        is ignored here), so that the others can finish the step they are in even if it exits at once."""
        if self.is_leader and self._posted and self._down is None:
            try:
                self._finish_posted()
            except Exception:  # the group is down: nothing more to hand over
                pass
        if self._inflight is not None and self._inflight.is_completed():
            self._inflight.wait()  # the last announcement, received: nothing left in flight
        self._inflight = None
        self._close_learner()
        self._joined = False

    @property
    def joined(self) -> bool:
        return self._joined and self._down is None

    @property
    def staged(self) -> bool:
        """True when this rank's parameters go through host copies (not on the CPU, or staging='always')."""
        return self._learner.staged if self.is_leader else self._follower.staged

    def status(self) -> dict:
        """This rank's counters. The leader: ddiloco.Learner.status() (whose tokens are the group's, the other
        ranks' counted up to synced_step). Every rank: role ('leader' or 'follower'), rank, leader, group_size,
        group_step (inner steps), synced_step (the last step at which the ranks communicated), synced_steps
        (how many did), own_tokens (the
        tokens this rank passed to step()), tokens_step (token_count="sum": the last step at which the group's
        tokens were summed, the last step a fragment was due) and down (None, or why the group's learner went down); the others
        also step, applies and base_versions (as the leader's)."""
        if self.is_leader:
            d = dict(self._closed_status) if self._closed_status is not None else self._learner.status()
        else:
            d = self._follower.status()
            d["step"] = self._step
        d.update(role="leader" if self.is_leader else "follower", rank=self.rank, leader=self.leader,
                 group_size=self.group_size, group_step=self._step, synced_step=self._synced_step,
                 synced_steps=self._synced_steps, tokens_step=self._tokens_step,
                 own_tokens=self._own_tokens, down=self._down)
        return d

    def __enter__(self) -> "GroupLearner":
        if not self._joined:
            self.join()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
