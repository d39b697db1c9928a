#!/usr/bin/env python3
"""Sums the GPU time of each kernel in the CSV that `ncu --csv --metrics gpu__time_duration.sum` writes, largest
first, with each one's share and the share of the GEMMs (cuBLAS's and CUTLASS's kernels) against everything else:
where a training step's GPU time goes beyond its GEMMs.

    python3 scripts/kernel_times.py PROFILE.csv [--top N]

A CSV it cannot read (no "Kernel Name" and "Metric Value" columns) is said so, with its first lines."""
import argparse
import csv
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    # ncu prints its own lines (==PROF== ...) before the CSV's header.
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line and '"Metric Value"' in line), None)
    if start is None:
        print(f"{args.csv}: no ncu CSV found (no \"Kernel Name\" and \"Metric Value\" columns); it begins:")
        print("\n".join(lines[:10]))
        return 1
    totals, counts, unit = {}, {}, ""
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") not in (None, "gpu__time_duration.sum"):
            continue
        try:
            value = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        name = row["Kernel Name"]
        unit = row.get("Metric Unit", unit)
        totals[name] = totals.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    grand = sum(totals.values())
    if grand <= 0:
        print(f"{args.csv}: no kernel times in it")
        return 1
    gemm = sum(t for n, t in totals.items() if any(k in n.lower() for k in ("gemm", "cutlass", "xmma", "sm90_")))
    print(f"{sum(counts.values())} kernel launches, {grand:.0f} {unit} of GPU time in all; GEMMs "
          f"{100 * gemm / grand:.1f}%, everything else {100 * (grand - gemm) / grand:.1f}%")
    print(f"  {'share':>6}  {'total ' + unit:>16}  {'launches':>8}  kernel")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {100 * t / grand:5.1f}%  {t:16.0f}  {counts[name]:8d}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
