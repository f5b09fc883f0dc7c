#!/usr/bin/env python3
"""`tiermoe_cuda_check chain` results side by side: one row per (shape, variant), one column per
run, each cell the us-per-layer medians of its rounds and the rate its bytes give.
  scripts/chain_table.py LABEL=chain.json [LABEL=chain.json ...]"""
import json
import sys

runs = []
for arg in sys.argv[1:]:
    label, sep, path = arg.partition("=")
    if not sep:
        sys.exit(f"chain_table: '{arg}' is not LABEL=FILE")
    try:
        runs.append((label, json.load(open(path))["results"]))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"chain_table: {path}: {e}")
rows = {}  # (shape, variant) -> {label: [(us, TB/s), ...]}
for label, results in runs:
    for r in results:
        cell = rows.setdefault((r["shape"], r["variant"]), {}).setdefault(label, [])
        cell.append((r["us_per_layer_p50"], r["weights_mb_per_layer"] / r["us_per_layer_p50"]))
print("| shape | variant | " + " | ".join(label for label, _ in runs) + " |")
print("|---|---|" + "---|" * len(runs))
for (shape, variant), cells in rows.items():
    out = []
    for label, _ in runs:
        c = cells.get(label, [])
        out.append(" / ".join(f"{us:.2f}" for us, _ in c) + (f" ({c[0][1]:.2f} TB/s)" if c else ""))
    print(f"| {shape} | {variant} | " + " | ".join(out) + " |")
