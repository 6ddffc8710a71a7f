#!/usr/bin/python3
"""PyTorch peer for bench/bench_syncer.cpp (docs/performance.md).

The same outer step the way PyTorch users write it: average the pseudo-gradients
of M learners (token-weighted: sum_m w_m g_m / sum_m w_m), hand the average to
the parameter's .grad, and step torch.optim.SGD(lr=0.7, momentum=0.9,
nesterov=True). Same sizes as the C++ benchmark (a 2^24-element fragment, M = 8,
fp32 pseudo-gradients), same thread count (torch.set_num_threads).

With --codec int4 the peer receives what ddiloco's syncer receives for int4
(<ddiloco/codec.hpp>): per block of 64 elements one fp32 scale s_b = max|x| / 7
and codes q = round(x / s_b) in [-7, 7], handed over as an int8 tensor of codes
(one code per element: PyTorch has no 4-bit dtype) and an fp32 tensor of
scales, and dequantises each learner the way a PyTorch user writes it,
codes.float().view(-1, block) * scales[:, None], before the same weighted
average and SGD step. The default (--codec fp32) is unchanged.

Note the peer does LESS work than ddiloco's syncer: a plain weighted average,
where ddiloco merges with RDA (per-tensor norms and directions) fused with the
Nesterov step. Timing: wall clock (time.perf_counter) per round, repeated;
the median is reported, with the minimum and the process CPU time per round.

Prints one JSON object on stdout.
"""
import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--codec", choices=("fp32", "int4"), default="fp32")
    args = ap.parse_args()
    block = 64  # kQuantBlock of <ddiloco/codec.hpp>

    torch.set_num_threads(args.threads)
    n = 1 << args.log2n
    m = args.learners
    gen = torch.Generator().manual_seed(12345)
    grads = [torch.rand(n, generator=gen) * 2 - 1 for _ in range(m)]
    assert n % block == 0
    if args.codec == "int4":
        payloads = []  # (int8 codes, fp32 scales) per learner, as received
        for g in grads:
            blocks = g.view(-1, block)
            scales = blocks.abs().amax(dim=1) / 7.0
            inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
            codes = torch.clamp(torch.round(blocks * inv[:, None]), -7, 7).to(torch.int8).view(-1)
            payloads.append((codes, scales))
        del grads
    weights = [1.0 + (k % 7) * 0.5 for k in range(m)]
    total = sum(weights)

    param = torch.nn.Parameter(torch.ones(n))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)

    def outer_step() -> None:
        with torch.no_grad():
            avg = torch.zeros_like(param)
            if args.codec == "int4":
                for (codes, scales), w in zip(payloads, weights):
                    g = (codes.float().view(-1, block) * scales[:, None]).view(-1)
                    avg.add_(g, alpha=w / total)
            else:
                for g, w in zip(grads, weights):
                    avg.add_(g, alpha=w / total)
        param.grad = avg
        opt.step()

    outer_step()  # warm-up: allocates the momentum buffer
    wall, cpu = [], []
    for _ in range(args.repetitions):
        t0, c0 = time.perf_counter(), time.process_time()
        outer_step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)

    # Minimum bytes of the same round as bench_syncer counts them for ddiloco
    # (contributions once, accumulator written then read+written, one fused
    # finish + Nesterov pass), so the two bytes/s figures compare directly.
    payload = 4 * n if args.codec == "fp32" else 4 * (n // block) + n // 2
    min_bytes = m * payload + 4 * n + (m - 1) * 8 * n + 20 * n
    med = statistics.median(wall)
    print(json.dumps({
        "name": "pytorch_average_then_sgd_nesterov" + ("" if args.codec == "fp32" else "_int4"),
        "codec": args.codec,
        "torch_version": torch.__version__,
        "threads": args.threads,
        "log2n": args.log2n,
        "learners": m,
        "repetitions": args.repetitions,
        "median_seconds": med,
        "min_seconds": min(wall),
        "median_cpu_seconds": statistics.median(cpu),
        "bytes_per_second": min_bytes / med,
    }))


if __name__ == "__main__":
    main()
