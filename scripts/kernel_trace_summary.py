#!/usr/bin/env python3
"""Where a CUDA graph launch's time goes, from a trace of bench/kernel_trace.cc.

Usage: kernel_trace_summary.py TRACE.tsv [--last N] [--min-kernels M] [--top K]

The kernels of one graph launch share its correlation id. Launches with at least --min-kernels
kernels (default 16) are the steps; the last --last of them (default 16) are summarised: per step
the span (first kernel start to last kernel end), the time some kernel was running (the union of
the kernels' intervals) and the idle rest; per kernel (short name: the function name without its
namespace, template arguments and parameters) the calls and GPU microseconds per step and per
call. Without graph launches the whole trace is summarised as one "step".
"""
import argparse
import collections
import re
import sys


def short_name(name):
    n = name
    # Drop the parameter list and template arguments, then the namespaces.
    depth, out = 0, []
    for ch in n:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    n = "".join(out).strip()
    n = re.sub(r"^(void|float|int)\s+", "", n)
    return n.split("::")[-1] or name


def union_us(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1000.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=16)
    ap.add_argument("--min-kernels", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    launches = collections.OrderedDict()
    plain = []
    with open(args.trace) as f:
        header = f.readline().rstrip("\n").split("\t")
        col = {h: i for i, h in enumerate(header)}
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) < len(header):
                continue
            rec = (int(p[col["start_ns"]]), int(p[col["end_ns"]]), short_name(p[col["name"]]))
            if int(p[col["graph"]]) != 0:
                launches.setdefault(int(p[col["correlation"]]), []).append(rec)
            else:
                plain.append(rec)
    steps = [k for k in launches.values() if len(k) >= args.min_kernels]
    steps.sort(key=lambda k: min(r[0] for r in k))
    if steps:
        steps = steps[-args.last:]
        print(f"{len(steps)} graph launches of >= {args.min_kernels} kernels "
              f"(of {len(launches)} graph launches in the trace)")
    else:
        steps = [plain] if plain else []
        print("no graph launches: the whole trace as one step")
    if not steps:
        print("empty trace")
        return 1
    spans, busies, kernels = [], [], []
    per = collections.defaultdict(lambda: [0, 0.0])
    for k in steps:
        s0 = min(r[0] for r in k)
        s1 = max(r[1] for r in k)
        spans.append((s1 - s0) / 1000.0)
        busies.append(union_us([(r[0], r[1]) for r in k]))
        kernels.append(len(k))
        for s, e, n in k:
            per[n][0] += 1
            per[n][1] += (e - s) / 1000.0
    ns = len(steps)
    span = sum(spans) / ns
    busy = sum(busies) / ns
    print(f"per step: span {span:.1f} us, a kernel running {busy:.1f} us, idle {span - busy:.1f} us, "
          f"{sum(kernels) / ns:.0f} kernels")
    print(f"{'kernel':40s} {'calls/step':>10s} {'us/step':>10s} {'us/call':>9s} {'share':>6s}")
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    for n, (c, t) in rows[:args.top]:
        print(f"{n[:40]:40s} {c / ns:10.1f} {t / ns:10.1f} {t / c:9.2f} {100 * t / ns / span:5.1f}%")
    rest = rows[args.top:]
    if rest:
        t = sum(v[1] for _, v in rest)
        print(f"{'(' + str(len(rest)) + ' others)':40s} {'':10s} {t / ns:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
