"""The vocabulary-parallel LLM head against the single-device one: world sizes 1, 2 and 3 (uneven slices of W and of
the bias) as processes with the Gloo backend on the CPU, float32 and float64, every reduction, label smoothing,
z-loss, soft-cap, ignored targets, recompute_logits: loss, gradients (dx, each rank's dW and bias rows), token
log-probabilities, entropies and log-sum-exps. fp32 agrees within 1e-5 relative.

    python tests/vocab_parallel_head.py --library build/lib/libtrellis_ops.so
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

            lse = ops.vocab_parallel_linear_logsumexp(x, ws, group, bias=bs, softcap=5.0)
            check("lse", lse, ops.linear_logsumexp(x, w, bias=b, softcap=5.0))
            lp, h = ops.vocab_parallel_token_logprobs(x, ws, t, group, bias=bs, entropy=True)
            lp_ref, h_ref = ops.token_logprobs(x, w, t, bias=b, entropy=True)
            check("log-probabilities", lp, lp_ref)
            check("entropy", h, h_ref)
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
        # No silent missing gradient: the log-probabilities' operator refuses inputs that want one.
        try:
            ops.vocab_parallel_token_logprobs(x.clone().requires_grad_(), ws, t, group)
            raise AssertionError("vocab_parallel_token_logprobs accepted an input that requires a gradient")
        except RuntimeError as e:
            if "no gradient is implemented" not in str(e):
                raise
        if rank == 0:
            print(f"world size {world}: slices {sizes}, every result agrees (max relative error {worst:.1e})")
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
