"""The vocabulary-parallel LLM head against the single-device one: world sizes 1, 2 and 3 (uneven slices of W and of
the bias) as processes with the Gloo backend on the CPU, float32 and float64, every reduction, label smoothing,
z-loss, soft-cap, ignored targets, recompute_logits: the loss, token log-probabilities, entropies and log-sum-exps, each
with its gradients (dx, each rank's dW and bias rows), and the log-probabilities under torch.compile. fp32 agrees within
1e-5 relative.

    python tests/vocab_parallel_head.py --library build/bindings/libtrellis_ops.so
"""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relative(a, b):
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:  # an output not asked for
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1)).item()


def worker(rank, world, port, library, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.ops.load_library(library)
    ops = torch.ops.trellis
    group = dist.group.WORLD.group_name
    N, D, V = 29, 12, 97
    # Uneven contiguous slices: rank r holds sizes[r] rows.
    sizes = [V // world + (1 if r < V % world else 0) for r in range(world)]
    sizes[0] += 3 if world > 1 else 0
    sizes[-1] -= 3 if world > 1 else 0
    begin = sum(sizes[:rank])
    worst = 0.0
    try:
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
            torch.manual_seed(7)  # the same inputs on every rank
            x = torch.randn(N, D, dtype=dtype)
            w = torch.randn(V, D, dtype=dtype) * 0.5
            b = torch.randn(V, dtype=dtype)
            t = torch.randint(0, V, (N,))
            t[::5] = -100
            ws, bs = w[begin:begin + sizes[rank]], b[begin:begin + sizes[rank]]

            def check(name, got, expected):
                nonlocal worst
                error = relative(got, expected)
                worst = max(worst, error)
                if not error <= tolerance:
                    raise AssertionError(f"{name} ({dtype}, world {world}, rank {rank}): relative error {error:.2e}")

            # Log-sum-exps, log-probabilities and entropies with their gradients: each output alone and all together,
            # against a random upstream gradient (the same on every rank).
            statistics = {
                "lse": (lambda x, w, b, *g: ops.vocab_parallel_linear_logsumexp(x, w, *g, bias=b, softcap=5.0),
                        lambda x, w, b: ops.linear_logsumexp(x, w, bias=b, softcap=5.0)),
                "log-probabilities": (lambda x, w, b, *g: ops.vocab_parallel_token_logprobs(x, w, t, *g, bias=b),
                                      lambda x, w, b: ops.token_logprobs(x, w, t, bias=b)),
                "log-probabilities and entropies": (
                    lambda x, w, b, *g: ops.vocab_parallel_token_logprobs(x, w, t, *g, bias=b, entropy=True,
                                                                          softcap=4.0, temperature=0.8),
                    lambda x, w, b: ops.token_logprobs(x, w, t, bias=b, entropy=True, softcap=4.0,
                                                       temperature=0.8)),
            }
            for name, (parallel, single) in statistics.items():
                for used in ((0, 1), (0,), (1,)) if "entropies" in name else ((0,),):
                    xp, wp, bp = (p.clone().requires_grad_() for p in (x, ws, bs))
                    got = parallel(xp, wp, bp, group)
                    xr, wr, br = (p.clone().requires_grad_() for p in (x, w, b))
                    expected = single(xr, wr, br)
                    got, expected = (r if isinstance(r, tuple) else (r,) for r in (got, expected))
                    for i in range(len(expected)):
                        check(f"{name} {i}", got[i], expected[i])
                    upstream = [torch.randn_like(expected[i]) for i in used]
                    sum((got[i] * g).sum() for i, g in zip(used, upstream)).backward()
                    sum((expected[i] * g).sum() for i, g in zip(used, upstream)).backward()
                    where = f"{name}, gradient of outputs {used}"
                    check(f"dx of {where}", xp.grad, xr.grad)
                    check(f"dW of {where}", wp.grad, wr.grad[begin:begin + sizes[rank]])
                    check(f"dbias of {where}", bp.grad, br.grad[begin:begin + sizes[rank]])
            for reduction in ("mean", "sum", "none"):
                for options in ({}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 4.0},
                                {"recompute_logits": True}):
                    xp, wp, bp = (p.clone().requires_grad_() for p in (x, ws, bs))
                    loss = ops.vocab_parallel_linear_cross_entropy(xp, wp, t, group, bias=bp, reduction=reduction,
                                                                   **options)
                    xr, wr, br = (p.clone().requires_grad_() for p in (x, w, b))
                    ref = ops.linear_cross_entropy(xr, wr, t, bias=br, reduction=reduction, **options)
                    check(f"loss {reduction} {options}", loss, ref)
                    g = torch.randn_like(ref)  # a random upstream gradient
                    (loss * g).sum().backward()
                    (ref * g).sum().backward()
                    check(f"dx {reduction} {options}", xp.grad, xr.grad)
                    check(f"dW {reduction} {options}", wp.grad, wr.grad[begin:begin + sizes[rank]])
                    check(f"dbias {reduction} {options}", bp.grad, br.grad[begin:begin + sizes[rank]])
        if world == 2:
            # torch.compile traces the operators whole (fullgraph): the group travels by name, the backward runs
            # _vocab_parallel_head_statistics_backward. The compiled step's gradients are the eager step's.
            def step(x, w, b):
                lp, h = ops.vocab_parallel_token_logprobs(x, w, t, group, bias=b, entropy=True)
                lse = ops.vocab_parallel_linear_logsumexp(x, w, group, bias=b)
                return (lp - 0.1 * h + 0.01 * lse * lse).sum()

            compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
            for run in (step, compiled):
                leaves = [p.detach().clone().requires_grad_() for p in (x, ws, bs)]
                run(*leaves).backward()
                if run is step:
                    expected = [p.grad for p in leaves]
                else:
                    for name, p, e in zip(("dx", "dW", "dbias"), leaves, expected):
                        check(f"compiled {name}", p.grad, e)
        if rank == 0:
            print(f"world size {world}: slices {sizes}, every result agrees (max relative error {worst:.1e})")
        dist.barrier()  # no rank tears its connections down while another still finishes the last collective
    except Exception as e:  # reported by the parent
        import traceback
        failures.put(f"rank {rank}: {e} {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    args = parser.parse_args()
    if not dist.is_available() or not dist.is_gloo_available():
        raise SystemExit(77)
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    for world in (1, 2, 3):
        failures = context.Queue()
        port = free_port()
        processes = [context.Process(target=worker, args=(r, world, port, args.library, failures))
                     for r in range(world)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(timeout=300)
            if p.is_alive():
                p.kill()
                failures.put("a rank did not finish within 300 s")
        errors = []
        while not failures.empty():
            errors.append(failures.get())
        if errors or any(p.exitcode != 0 for p in processes):
            sys.exit("vocabulary-parallel head: " + "; ".join(errors or ["a rank exited with an error"]))


if __name__ == "__main__":
    main()
