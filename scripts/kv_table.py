#!/usr/bin/env python3
"""Quality table (markdown) and chart (SVG: perplexity increase vs bits per value) from the
JSON that scripts/kv_eval.sh writes. Usage: kv_table.py OUT_DIR"""
import glob, json, math, os, sys

out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "*.ppl.json"))):
    name = os.path.basename(f)[:-len(".ppl.json")]
    try:
        p = json.load(open(f))
    except Exception:
        continue
    n = None
    nf = os.path.join(out, name + ".needle.json")
    if os.path.exists(nf):
        try:
            n = json.load(open(nf))
        except Exception:
            n = None
    tiers = {t["tier"]: t for t in p.get("tiers", [])}
    rows.append(dict(name=name, p=p, n=n, tiers=tiers))

def fmt(x, d=3):
    return "-" if x is None else f"{x:.{d}f}"

# Per-window spread of the increase, against the bf16 row's per-window NLL (same windows).
ref_w = next((r["p"].get("window_nll") for r in rows if r["name"] == "bf16"), None)
def spread(p):
    w = p.get("window_nll")
    if not ref_w or not w or len(w) != len(ref_w) or len(w) < 2:
        return "-"
    inc = [100 * (math.exp(a - b) - 1) for a, b in zip(w, ref_w)]
    return f"{min(inc):+.2f}..{max(inc):+.2f}%"

lines = ["| config | bits/value K | V | overall | + metadata | KV bytes vs BF16 | middle K/V bits | archive K/V bits (tokens) | ppl | ppl increase | per window | KL vs BF16 | top-1 agree | needle |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
order = lambda r: -r["p"]["bits_per_value"]
for r in sorted(rows, key=order):
    p, t = r["p"], r["tiers"]
    mid = t.get("middle"); arc = t.get("archive")
    midb = f"{mid['k_bits_per_value']:.2f}/{mid['v_bits_per_value']:.2f}" if mid and mid["tokens"] else "-"
    arcb = f"{arc['k_bits_per_value']:.2f}/{arc['v_bits_per_value']:.2f} ({arc['tokens']})" if arc and arc["tokens"] else "-"
    # Trials whose prompt filled the whole context could not generate (fixed in cmd_needle.cpp
    # after the first run); they are left out rather than counted as misses.
    valid = [x for x in r["n"]["rows"] if x["length"] <= 4088] if r["n"] else []
    needle = f"{sum(x['correct'] for x in valid)}/{len(valid)}" if valid else "-"
    inc = p.get("ppl_increase")
    lines.append(f"| {r['name']} | {fmt(p['bits_per_value_k'],2)} | {fmt(p['bits_per_value_v'],2)} | {fmt(p['bits_per_value'],2)} | "
                 f"{fmt(p['bits_per_value_with_metadata'],2)} | {fmt(p['kv_bytes_ratio'],2)}x | {midb} | {arcb} | {fmt(p['ppl'],4)} | "
                 f"{'-' if inc is None else f'{100*inc:+.2f}%'} | {spread(p)} | {fmt(p.get('kl_vs_ref'),4)} | {fmt(p.get('top1_agreement'),3)} | {needle} |")
meta = open(os.path.join(out, "meta.txt")).read() if os.path.exists(os.path.join(out, "meta.txt")) else ""
if rows:
    ref = rows[0]["p"].get("ref_ppl")
    lines.append("")
    lines.append(f"BF16 reference perplexity {fmt(ref,4)} over {rows[0]['p']['windows']} windows of {rows[0]['p']['ctx']} tokens.")
open(os.path.join(out, "table.md"), "w").write(meta + "\n" + "\n".join(lines) + "\n")
print("\n".join(lines))

# Chart: x = bits per value (overall, per token), y = perplexity increase (%), log-ish clip.
pts = [(r["p"]["bits_per_value"], 100 * r["p"]["ppl_increase"], r["name"]) for r in rows if r["p"].get("ppl_increase") is not None]
W, H, L, B, T, R = 760, 460, 70, 50, 20, 20
xmax = max([p[0] for p in pts] + [8]) if pts else 8
xmax = min(xmax, 17)
ymax = max([p[1] for p in pts] + [2]) if pts else 2
ymax = min(ymax * 1.1, 60)
ymin = min([p[1] for p in pts] + [0]) if pts else 0
sx = lambda x: L + (W - L - R) * x / xmax
sy = lambda y: T + (H - T - B) * (1 - (min(y, ymax) - ymin) / (ymax - ymin))
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<line x1="{L}" y1="{sy(0)}" x2="{W-R}" y2="{sy(0)}" stroke="#888"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="#000"/>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="#000"/>']
for gx in range(0, int(xmax) + 1, 2):
    svg.append(f'<text x="{sx(gx)}" y="{H-B+15}" text-anchor="middle">{gx}</text>')
step = 5 if ymax - ymin > 20 else 1 if ymax - ymin < 8 else 2
y = math.ceil(ymin / step) * step
while y <= ymax:
    svg.append(f'<text x="{L-6}" y="{sy(y)+4}" text-anchor="end">{y:+d}%</text>')
    svg.append(f'<line x1="{L}" y1="{sy(y)}" x2="{W-R}" y2="{sy(y)}" stroke="#eee"/>')
    y += step
for yline, lab in ((1, "+1% goal"), (3, "+3% goal")):
    if ymin <= yline <= ymax:
        svg.append(f'<line x1="{L}" y1="{sy(yline)}" x2="{W-R}" y2="{sy(yline)}" stroke="#c00" stroke-dasharray="4,3"/>')
        svg.append(f'<text x="{W-R-4}" y="{sy(yline)-3}" text-anchor="end" fill="#c00">{lab}</text>')
svg.append(f'<text x="{(W+L)/2}" y="{H-12}" text-anchor="middle">bits per value (K and V, everything stored per token; 4096 context)</text>')
svg.append(f'<text x="16" y="{(H-B+T)/2}" transform="rotate(-90 16 {(H-B+T)/2})" text-anchor="middle">perplexity increase vs BF16</text>')
for x, yv, name in pts:
    col = "#1f77b4" if "default" in name else "#d62728" if ("kivi" in name or "hadamard" in name) else "#555"
    clipped = yv > ymax
    svg.append(f'<circle cx="{sx(x):.1f}" cy="{sy(yv):.1f}" r="4" fill="{col}"/>')
    svg.append(f'<text x="{sx(x)+6:.1f}" y="{sy(yv)-5:.1f}" fill="{col}">{name}{" (%+.0f%%)" % yv if clipped else ""}</text>')
svg.append("</svg>")
open(os.path.join(out, "chart.svg"), "w").write("\n".join(svg) + "\n")
