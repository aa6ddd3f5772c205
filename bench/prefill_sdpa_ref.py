#!/usr/bin/env python3
"""PyTorch SDPA reference for causal prefill attention (run on the GPU machine).

Llama-3.1-8B shape: 32 query heads, 8 KV heads, head_dim 128, batch 1, bf16, is_causal=True,
GQA through enable_gqa=True. Times each SDPA backend that runs (cuDNN, FlashAttention-2, default
dispatch) with CUDA events (2 warm-ups, median of --runs) and prints TFLOP/s with the causal
FLOP count 2 * 2 * n^2 / 2 * d per query head, the figure kernels/cuda/prefill_bench_main.cc
prints for Strata.

Usage: python3 bench/prefill_sdpa_ref.py [--runs R] [n ...]   (default 8192 16384 32768)
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def time_ms(fn, runs):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(2 + runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("n", type=int, nargs="*", default=[8192, 16384, 32768])
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'context':<8} {'backend':<10} {'ms':>10} {'TFLOP/s':>10}")
    torch.manual_seed(0)
    for n in args.n:
        q = torch.randn(1, Q_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        flops = 2 * 2 * n * n / 2 * HEAD_DIM * Q_HEADS
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash2", SDPBackend.FLASH_ATTENTION),
                              ("default", None)):
            def call():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                if backend is None:
                    ms = time_ms(call, args.runs)
                else:
                    with sdpa_kernel(backend):
                        ms = time_ms(call, args.runs)
            except RuntimeError as e:  # backend unavailable for this shape/build
                print(f"{n:<8} {name:<10} unavailable: {str(e).splitlines()[0][:80]}")
                continue
            print(f"{n:<8} {name:<10} {ms:>10.3f} {flops / (ms * 1e-3) / 1e12:>10.1f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
