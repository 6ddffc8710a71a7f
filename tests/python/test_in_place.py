"""Parameters are written in place: the module keeps its tensors, the optimizer its state."""
import numpy as np
import pytest
import torch

import ddiloco
from conftest import Tiny


def ln_offset(learner, name):
    """The slice of a tensor in the syncer's flat global parameters (model order)."""
    off = 0
    for n, p in zip(learner.names, learner.parameters):
        if n == name:
            return slice(off, off + p.numel())
        off += p.numel()
    raise KeyError(name)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.parametrize("staging", ["auto", "always"])
def test_join_writes_the_global_state_into_the_modules_own_tensors(syncer_of, staging):
    server_model, model = Tiny(seed=1), Tiny(seed=2)
    s = syncer_of(server_model, fragments=3)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, plaintext=True, fragments=3, staging=staging).join()
    assert ln.staged == (staging == "always")
    np.testing.assert_array_equal(flat(model), flat(server_model))   # the global state, visible through the module
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.data_ptr() == before[n][1]    # same objects, same storage
        assert opt.param_groups[0]["params"][list(before).index(n)] is p
        for k, v in opt.state[p].items():                            # Adam's moments untouched
            assert torch.equal(v, state[n][k]), (n, k)
    ln.close()


@pytest.mark.parametrize("staging", ["auto", "always"])
def test_an_applied_global_lands_in_the_parameter_the_optimizer_steps(syncer_of, staging):
    model = Tiny(seed=3)
    s = syncer_of(model, fragments=3, outer_optimizer="average", send_merged_to="alive", round="push", sync_every=3,
                  overlap=1)
    ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, plaintext=True, fragments=3, sync_every=3, overlap=1,
                         round="push",
                         staging=staging, lock_step=True, lock_step_timeout=30).join()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = set()
    for _ in range(12):  # lock-step: every step from the second applies the fragment sent tau = 1 before
        model(torch.tensor([1, 2, 3])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        applied.update(ln.step(tokens=3).applied)
    assert applied == {0, 1, 2}
    # One learner, average-only outer step: the syncer's global equals its last contributions; each
    # applied fragment equals the global the syncer holds, written into the same tensors.
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())
    st = ln.status()
    assert st["applies"] >= 6 and st["sends"] >= 3 and all(v >= 1 for v in st["base_versions"])
    ln.close()


def test_a_parameter_whose_storage_was_replaced_is_followed(syncer_of):
    model = Tiny(seed=4)
    s = syncer_of(model, fragments=3, round="push", sync_every=3, overlap=1)  # the schedule's sends (push rounds)
    ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, plaintext=True, fragments=3, sync_every=3,
                         overlap=1, lock_step=True, lock_step_timeout=30, round="push").join()
    with torch.no_grad():
        model.hidden.weight.data = model.hidden.weight.data.clone()  # same shape, new storage
    for _ in range(7):
        ln.step(1)
    assert ln.status()["applies"] == 3 + 6 and ln.status()["lock_step_timeouts"] == 0  # 3 at join
    assert torch.equal(model.hidden.weight.detach().reshape(-1),
                       torch.from_numpy(s.global_parameters()[ln_offset(ln, "hidden.weight")]))
    ln.close()


def test_step_reports_which_fragments_were_applied(syncer_of):
    model = Tiny(seed=5)
    s = syncer_of(model, fragments=3, round="push", sync_every=3, overlap=1)  # the schedule's sends (push rounds)
    ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, plaintext=True, fragments=3, sync_every=3,
                         overlap=1, lock_step=True, lock_step_timeout=30, round="push").join()
    sent_at = {}
    for step in range(1, 11):
        r = ln.step(1)
        assert r.sent == ln._core.due_at(step)
        # lock-step, tau = 1: exactly the fragment sent one step before is applied
        assert r.applied == ([sent_at[step - 1]] if step > 1 else [])
        sent_at[step] = r.sent
    assert ln.status()["applies"] == 3 + 9
    ln.close()
