#!/usr/bin/env python3
"""Where a CUDA graph launch's time goes, from a trace of bench/kernel_trace.cc.

Usage: kernel_trace_summary.py TRACE.tsv [--last N] [--min-kernels M] [--top K]

The kernels of one graph launch share its correlation id. With --passes each pass (the graphs
whose launches interleave in time: the instances of one captured step) is summarised apart. Launches with at least --min-kernels
kernels (default 16) are the steps; the last --last of them (default 16) are summarised: per step
the span (first kernel start to last kernel end), the time some kernel was running (the union of
the kernels' intervals) and the idle rest; per kernel (short name: the function name without its
namespace, template arguments and parameters) the calls and GPU microseconds per step and per
call. Without graph launches the whole trace is summarised as one "step".

With runtime API records (STRATA_KERNEL_TRACE_API=1) it also reports, per summarised step, the
host time of the cudaGraphLaunch call that queued it, the delay from that call's return to the
step's first kernel, and the GPU gap after the step before; and the runtime API calls made on the
host between the first and the last summarised step's launch (calls and host microseconds per
step).
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


def summarise(args, steps, correlations, api, api_all):
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
    calls = [api.get(c) for c in correlations]
    if api and all(calls):
        print("graph launches (host): call us, call return to first kernel us, GPU gap before "
              "the step us")
        prev_end = None
        for call, k in zip(calls, steps):
            s0 = min(r[0] for r in k)
            gap = f"{(s0 - prev_end) / 1000.0:9.1f}" if prev_end is not None else f"{'':9s}"
            print(f"  {call[2][:24]:24s} {(call[1] - call[0]) / 1000.0:9.1f} "
                  f"{(s0 - call[1]) / 1000.0:9.1f} {gap}")
            prev_end = max(r[1] for r in k)
        t0, t1 = calls[0][0], calls[-1][0]
        window = [r for r in api_all if t0 <= r[0] < t1]
        if window and ns > 1:
            byname = collections.defaultdict(lambda: [0, 0.0])
            for s_, e_, n in window:
                byname[n][0] += 1
                byname[n][1] += (e_ - s_) / 1000.0
            print(f"runtime API calls between the first and the last launch, per step "
                  f"({ns - 1} steps):")
            for n, (c, t) in sorted(byname.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"  {n[:40]:40s} {c / (ns - 1):8.1f} calls {t / (ns - 1):10.1f} us")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=16)
    ap.add_argument("--min-kernels", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--passes", action="store_true")
    args = ap.parse_args()
    launches = collections.OrderedDict()
    graph_of = {}  # correlation id -> graph id
    plain = []
    api = {}  # correlation id -> (start, end, name) of runtime API calls
    api_all = []
    with open(args.trace) as f:
        header = f.readline().rstrip("\n").split("\t")
        col = {h: i for i, h in enumerate(header)}
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) < len(header):
                continue
            name = p[col["name"]]
            if name.startswith("api "):
                rec = (int(p[col["start_ns"]]), int(p[col["end_ns"]]), name[4:])
                api[int(p[col["correlation"]])] = rec
                api_all.append(rec)
                continue
            rec = (int(p[col["start_ns"]]), int(p[col["end_ns"]]), short_name(p[col["name"]]))
            graph = int(p[col["graph"]])
            if graph != 0:
                launches.setdefault(int(p[col["correlation"]]), []).append(rec)
                graph_of[int(p[col["correlation"]])] = graph
            else:
                plain.append(rec)
    steps = [(c, k) for c, k in launches.items() if len(k) >= args.min_kernels]
    steps.sort(key=lambda ck: min(r[0] for r in ck[1]))
    if not steps:
        print("no graph launches: the whole trace as one step")
        if not plain:
            print("empty trace")
            return 1
        return summarise(args, [plain], [], api, api_all)
    groups = [steps]
    if args.passes:
        # A pass: the graphs (instances) whose launches interleave in time.
        ranges = collections.OrderedDict()
        for c, k in steps:
            g = graph_of[c]
            lo, hi = ranges.get(g, (None, None))
            t0, t1 = min(r[0] for r in k), max(r[1] for r in k)
            ranges[g] = (t0 if lo is None else min(lo, t0), t1 if hi is None else max(hi, t1))
        merged = []  # [lo, hi, {graph ids}]
        for g, (lo, hi) in sorted(ranges.items(), key=lambda gr: gr[1][0]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
                merged[-1][2].add(g)
            else:
                merged.append([lo, hi, {g}])
        groups = [[ck for ck in steps if graph_of[ck[0]] in m[2]] for m in merged]
    rc = 0
    for i, group in enumerate(groups):
        if args.passes:
            print(f"== pass {i + 1} of {len(groups)}: graphs "
                  f"{sorted({graph_of[c] for c, _ in group})}, {len(group)} launches")
        tail = group[-args.last:]
        print(f"{len(tail)} graph launches of >= {args.min_kernels} kernels "
              f"(of {len(launches)} graph launches in the trace)")
        rc |= summarise(args, [k for _, k in tail], [c for c, _ in tail], api, api_all)
    return rc


if __name__ == "__main__":
    sys.exit(main())
