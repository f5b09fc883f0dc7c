#!/usr/bin/env python3
"""Where a captured decode step's time goes on the GPU: reads the kernel records of an nsys export
(sqlite; `nsys profile --cuda-graph-trace=node`, so each graph node is its own record), cuts them
into steps at each embed kernel, and prints per kernel name, over the last 16 whole steps: how many
per step, the median duration, and how far it moves the chain's end -- end_i - end_{i-1} with ends
taken in start order, i.e. what the kernel adds to the step once overlapped (programmatic launch)
with the ones before it. The adds sum to the step. Used by scripts/gpu_check.sh timeline.

  graph_timeline.py EXPORT.sqlite LABEL
"""
import collections
import sqlite3
import statistics
import sys


def main(path, label):
    db = sqlite3.connect(path)
    names = dict(db.execute("select id, value from StringIds"))
    ev = sorted((s, e, names[n]) for s, e, n in db.execute("select start, end, shortName from CUPTI_ACTIVITY_KIND_KERNEL"))
    starts = [i for i, e in enumerate(ev) if e[2].startswith("embed")]
    steps = [ev[a:b] for a, b in zip(starts, starts[1:] + [len(ev)])][-17:-1]  # the last one may be cut short
    if len(steps) < 2:
        sys.exit(f"{label}: fewer than two decode steps in {path}")
    dur, adds, order, span = collections.defaultdict(list), collections.defaultdict(float), [], []
    for st in steps:
        end = st[0][0]
        span.append((st[-1][1] - st[0][0]) / 1e3)
        for s, e, n in st:
            if n not in order:
                order.append(n)
            dur[n].append((e - s) / 1e3)
            adds[n] += (max(e, end) - end) / 1e3
            end = max(end, e)
    gaps = [(b[0][0] - a[-1][1]) / 1e3 for a, b in zip(steps, steps[1:])]
    print(f"== {label}: {len(steps)} steps of {len(steps[0])} kernels, step {statistics.median(span):.1f} us (median), "
          f"{statistics.median(gaps):.1f} us between steps")
    print(f"  {'kernel':48s} {'per step':>8s} {'duration':>9s} {'adds each':>10s} {'adds per step':>14s}")
    for n in order:
        c = len(dur[n]) / len(steps)
        a = adds[n] / len(steps)
        print(f"  {n[:48]:48s} {c:8.1f} {statistics.median(dur[n]):9.2f} {a / c:10.2f} {a:14.1f}")
    print(f"  {'sum':48s} {'':8s} {'':9s} {'':10s} {sum(adds.values()) / len(steps):14.1f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    main(sys.argv[1], sys.argv[2])
