#!/usr/bin/env python3
"""Dense decode attention reference: PyTorch scaled_dot_product_attention for one query token.

Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128), bf16 K/V, batch 1, at the context
lengths given (default 32K 128K 512K 1M). Times with CUDA events: `b2b_us` = back-to-back calls,
total / calls; `cold_us` = median of single calls after a 256 MiB L2 flush. Also reports the
backend PyTorch picked where it can tell, and the K+V bytes over cold_us as a fraction of 3.35 TB/s.
Run on the GPU machine: python3 scripts/sdpa_decode_bench.py [context ...]
"""
import sys

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128


def main():
    contexts = [int(a) for a in sys.argv[1:]] or [32768, 131072, 524288, 1048576]
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"{'context':>8} {'variant':>10} {'b2b_us':>9} {'cold_us':>9} {'MiB':>8} {'frac':>6}")
    for n in contexts:
        torch.manual_seed(0)
        q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        mib = 2 * HKV * n * D * 2 / 2**20
        variants = {
            "gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            # The same math with K/V broadcast to 32 heads as a view-free expand (what a model
            # without enable_gqa does); reads the same bytes once per query head group.
            "grouped": lambda: F.scaled_dot_product_attention(
                q.view(1, HKV, HQ // HKV, D), k, v),
        }
        for name, fn in variants.items():
            try:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            except Exception as e:  # a variant the installed PyTorch lacks
                print(f"{n:>8} {name:>10} failed: {e}")
                continue
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            calls = 50
            e0.record()
            for _ in range(calls):
                fn()
            e1.record()
            e1.synchronize()
            b2b = e0.elapsed_time(e1) * 1000 / calls
            cold = []
            for i in range(30):
                flush.fill_(i & 0xFF)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                cold.append(e0.elapsed_time(e1) * 1000)
            cold.sort()
            c = cold[len(cold) // 2]
            frac = mib * 2**20 / (c * 1e-6) / 3.35e12
            print(f"{n:>8} {name:>10} {b2b:9.1f} {c:9.1f} {mib:8.1f} {frac:6.3f}", flush=True)
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
