#!/usr/bin/env python3
"""Writes a deterministic sample long document (a synthetic station log) for the demo.

Usage: make_sample_document.py OUT_FILE [--entries N] [--seed S]
The document plants one fact ("the vault code is ...") in the middle; the demo asks about it.
Plain Python 3, no dependencies.
"""
import argparse
import random

PLACES = ["north dock", "south gate", "east tower", "west archive", "engine room", "greenhouse", "observatory",
          "harbour office", "old library", "signal station", "market hall", "river lock"]
PEOPLE = ["Ada", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kira", "Luis"]
EVENTS = ["checked the pumps and found them working", "logged a delivery of forty crates of grain",
          "repaired a cracked window with fresh putty", "measured the tide at two metres and a half",
          "reported fog rolling in from the sea", "counted the lanterns and replaced three wicks",
          "copied the weather notes into the ledger", "heard the bell ring twice at dusk",
          "cleaned the lenses of the great telescope", "sorted letters that arrived on the morning boat",
          "planted beans along the southern wall", "oiled the hinges of the heavy iron door"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--entries", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lines = ["Station log of the northern harbour, kept day by day.", ""]
    needle_at = args.entries // 2
    for i in range(args.entries):
        day = i // 6 + 1
        who, where, what = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(EVENTS)
        lines.append(f"Day {day}, entry {i + 1}: {who} at the {where} {what}.")
        if i == needle_at:
            lines.append("Note for the record: the vault code is 7391, and only the keeper may use it.")
    lines.append("")
    lines.append("End of the log.")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
