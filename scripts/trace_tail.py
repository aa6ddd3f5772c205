#!/usr/bin/env python3
"""The last part of a kernel trace (bench/kernel_trace.cc), written apart, with where its time goes.

Usage: trace_tail.py TRACE.tsv --ms 400 --out TAIL.tsv [--top 40]

Keeps the records that start in the trace's last --ms milliseconds (e.g. the last job's decode
steps) and prints, per record kind (kernel, copy, API call) and per stream (kernels and copies) or
calling thread (API calls; kernel_trace writes its id in the stream column), the count, total and
mean microseconds of each name, largest total first.
"""
import argparse
import collections
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--ms", type=float, default=400.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.trace) as f:
        header = f.readline()
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    if not rows:
        sys.exit("trace_tail: no records in " + a.trace)
    last = max(int(r[1]) for r in rows)
    begin = last - int(a.ms * 1e6)
    tail = sorted((r for r in rows if int(r[0]) >= begin), key=lambda r: int(r[0]))
    with open(a.out, "w") as f:
        f.write(header)
        for r in tail:
            f.write("\t".join(r) + "\n")
    totals = collections.defaultdict(lambda: [0, 0.0])
    for r in tail:
        name = r[8]
        kind = "api" if name.startswith("api ") else ("copy" if name.startswith("memcpy") else "kernel")
        key = (kind, ("thread " if kind == "api" else "stream ") + r[5], name[:100])
        t = totals[key]
        t[0] += 1
        t[1] += (int(r[1]) - int(r[0])) / 1e3
    print(f"{len(tail)} of {len(rows)} records in the last {a.ms:.0f} ms")
    print(f"{'kind':6} {'where':16} {'count':>7} {'total us':>11} {'mean us':>9}  name")
    for (kind, where, name), (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{kind:6} {where:16} {n:7d} {us:11.1f} {us / n:9.2f}  {name}")


if __name__ == "__main__":
    main()
