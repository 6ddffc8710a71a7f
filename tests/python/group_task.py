"""The task of tests/python/test_group.py and group_worker.py: noisy linear regression, a linear model.

Shared so that the test's threads and the worker processes train exactly the same model on the same kind
of data (each learner or rank its own shard, by seed).
"""
import torch
import torch.distributed as dist

BATCH = 32       # rows (tokens) per inner step and rank
ROWS = 256       # rows of one shard


def task(seed, noise=0.01):
    """A shard: rows x and targets y = x w + noise. A larger noise keeps every learner's per-step progress of
    the same size once the model has converged (the syncer's norm-outlier check compares them)."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.tensor([[1.5, -2.0, 0.5, 1.0]])
    x = torch.randn(ROWS, 4, generator=g)
    y = x @ w_true.t() + noise * torch.randn(ROWS, 1, generator=g)
    return x, y


def model_of():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def mse(model, x, y):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def batches(seed):
    """The generator of a learner's (or rank's) random batches: fresh rows every step, never a fixed cycle
    (a cycle of H batches would make each round the same epoch and the outer gradient converge to zero)."""
    return torch.Generator().manual_seed(10_000 + seed)


def inner_step(model, opt, x, y, g, all_reduce=False):
    """One SGD step on a random batch of the shard (generator g); all_reduce: average the gradients over the
    default group (as DDP does: the ranks' steps stay equal)."""
    b = torch.randint(0, ROWS, (BATCH,), generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[b]), y[b]).backward()
    if all_reduce:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
    opt.step()
