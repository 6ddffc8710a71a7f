"""The task of tests/python/test_group.py and group_worker.py: noisy linear regression, a linear model.

Shared so that the test's threads and the worker processes train exactly the same model on the same kind
of data (each learner or rank its own shard, by seed).
"""
import torch
import torch.distributed as dist

BATCH = 32       # rows (tokens) per inner step and rank
ROWS = 256       # rows of one shard


def task(seed):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.tensor([[1.5, -2.0, 0.5, 1.0]])
    x = torch.randn(ROWS, 4, generator=g)
    y = x @ w_true.t() + 0.01 * torch.randn(ROWS, 1, generator=g)
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


def inner_step(model, opt, x, y, i, all_reduce=False):
    """One SGD step on batch i of the shard; all_reduce: average the gradients over the default group (DDP)."""
    b = slice((i * BATCH) % ROWS, (i * BATCH) % ROWS + BATCH)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[b]), y[b]).backward()
    if all_reduce:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
    opt.step()
