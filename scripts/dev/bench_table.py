#!/usr/bin/env python3
"""Render the rows of `trellis bench --json FILE` as a Markdown table (for docs/benchmarks.md)."""
import json
import sys

rows = json.load(open(sys.argv[1]))
print(f"Device: {rows[0]['device']}\n")
print("| workload | shape | implementation | ms | ratio (÷ Trellis) | peak extra memory | max error vs float64 |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
for r in rows:
    peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f} MiB"
    err = "-" if r["max_error"] is None else f"{r['max_error']:.1e}"
    print(f"| {r['workload']} | {r['shape']} | {r['implementation']} | {r['ms']:.3f} | {r['ratio']:.2f} | {peak} | {err} |")
