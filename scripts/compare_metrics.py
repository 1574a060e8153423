"""Compare two demo runs' metrics.jsonl on every non-timing key (rewards, acceptance, versions,
swaps...): a refactor of the loop must leave them equal on the same world and seed.

    .venv/bin/python scripts/compare_metrics.py runs/before/metrics.jsonl runs/after/metrics.jsonl

Timing keys (stage/*, tps/*, *_s, swap/ms, adapt/share, time) are left out and listed. Exit 1 on a
difference. Runs with adapter.schedule.max_share=0 compare exactly: the cost cap's deferrals
follow the clock.
"""
import json, re, sys
TIMING = re.compile(r"(^stage/|^tps/|_s$|_ms$|/ms$|seconds|per_s|^time|_time|share|/s$|budget|cost|elapsed)")
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b), (len(a), len(b))
keys = compared = 0
diffs = []
for i, (x, y) in enumerate(zip(a, b)):
    kx = {k for k in x if not TIMING.search(k)}
    ky = {k for k in y if not TIMING.search(k)}
    if kx != ky:
        diffs.append((i, "keys", sorted(kx ^ ky)))
    for k in kx & ky:
        compared += 1
        if x[k] != y[k]:
            diffs.append((i, k, x[k], y[k]))
print(f"rows {len(a)}, non-timing values compared {compared}, differing {len(diffs)}")
for d in diffs[:30]:
    print(d)
skipped = sorted({k for x in a for k in x if TIMING.search(k)})
print("timing keys left out:", skipped)
sys.exit(1 if diffs else 0)
