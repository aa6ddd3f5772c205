#!/usr/bin/env python3
"""Prints the instructions with the most warp stall samples from an Nsight Compute source page.

Input: the CSV of `ncu -i REPORT --page source --csv --print-source sass` (one table per profiled
kernel launch). For each table: its total stall samples and executed instructions, then the TOP
instructions by samples (address, share of samples, executed count, SASS text).
Usage: ncu_source_top.py SASS.csv [TOP]
"""
import csv
import sys


def pick(header, *names):
    for n in names:
        for i, h in enumerate(header):
            if h.strip().lower() == n.lower():
                return i
    for n in names:
        for i, h in enumerate(header):
            if n.lower() in h.lower():
                return i
    return None


def num(s):
    try:
        return float(s.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    tables, cur, header, title = [], None, None, ""
    for r in rows:
        if not r:
            continue
        joined = ",".join(r)
        if any("Warp Stall Sampling" in c for c in r) and any(c.strip() in ("Source", "Address") for c in r):
            header = r
            cur = {"title": title, "header": r, "rows": []}
            tables.append(cur)
            continue
        if cur is None or len(r) < len(header) // 2:
            title = joined[:160]
            continue
        cur["rows"].append(r)
    if not tables:
        print("no source table found; first lines:")
        for r in rows[:8]:
            print("  " + ",".join(r)[:200])
        return 1
    for t in tables:
        h = t["header"]
        i_src = pick(h, "Source")
        i_addr = pick(h, "Address")
        i_samp = pick(h, "Warp Stall Sampling (All Samples)", "Warp Stall Sampling")
        i_exec = pick(h, "Instructions Executed")
        data = t["rows"]
        total = sum(num(r[i_samp]) for r in data if i_samp is not None and i_samp < len(r))
        execd = sum(num(r[i_exec]) for r in data if i_exec is not None and i_exec < len(r))
        print(f"-- {t['title'][:150]}")
        print(f"   {len(data)} instructions, {total:.0f} stall samples, {execd:.0f} executed")
        if i_samp is None:
            print("   no sample column; header: " + ",".join(h)[:300])
            continue
        ranked = sorted(data, key=lambda r: -num(r[i_samp]))[:top]
        for r in ranked:
            s = num(r[i_samp])
            src = r[i_src] if i_src is not None else ""
            addr = r[i_addr] if i_addr is not None else ""
            ex = num(r[i_exec]) if i_exec is not None else 0
            print(f"   {addr:>6} {100 * s / max(total, 1):5.1f}% exec {ex:8.0f}  {src[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
