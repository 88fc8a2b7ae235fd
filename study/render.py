"""Render study/out_*.json as Markdown tables, with each kvstrata variant's ratio to the best
deployed peer (s3fifo, arc, gdsf, tinylfu) per capacity."""

from __future__ import annotations

import json
import sys

PEERS = ("s3fifo", "arc", "gdsf", "tinylfu")
rows_by_trace: dict[str, dict[str, dict[str, list[float]]]] = {}
caps: dict[str, list[int]] = {}
for path in sys.argv[1:]:
    data = json.loads(open(path).read())
    label = data["trace"] + (f" seed {path.split('_s')[-1][0]}" if "_s1" in path else "")
    rows_by_trace.setdefault(label, {}).update(data["rows"])
    caps[label] = data["capacities"]
for label, rows in rows_by_trace.items():
    print(f"\n### {label} (capacities {caps[label]} blocks = 2/5/15% of distinct)\n")
    print("| policy | saved s (2/5/15%) | saved Mtokens | s ÷ best peer | tok ÷ best peer |")
    print("|---|---|---|---|---|")
    peers = [p for p in PEERS if p in rows]
    best_s = [max(rows[p]["s"][i] for p in peers) for i in range(3)] if peers else None
    best_t = [max(rows[p]["tok"][i] for p in peers) for i in range(3)] if peers else None
    for name, row in rows.items():
        s = " / ".join(f"{v:.0f}" for v in row["s"])
        t = " / ".join(f"{v / 1e6:.2f}" for v in row["tok"])
        rs = rt = ""
        if best_s and name not in PEERS:
            rs = " / ".join(f"{a / b:.2f}" for a, b in zip(row["s"], best_s))
            rt = " / ".join(f"{a / b:.2f}" for a, b in zip(row["tok"], best_t))
        print(f"| {name} | {s} | {t} | {rs} | {rt} |")
