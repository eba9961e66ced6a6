"""The LK-vs-default table of benchmarks/lk_equal_budget.yaml's runs (benchmarks/RESULTS.md, "LK losses against
KL at an equal budget"): per head and seed, the held-out acceptance the train stage measured (teacher-forced
accuracy per position on the held-out rows, and the simulated acceptance length at k = 3), then per head the mean
and the spread (max - min) over the seeds, and the LK head's ratio to its default-loss twin.

    .venv/bin/python benchmarks/lk_table.py [--store file://.draftline/lk-equal-budget] [--k 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.formats.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.store.artifacts import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="file://.draftline/lk-equal-budget")
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    store = Store(args.store)
    by_head: dict[str, dict[int, dict]] = {}
    for m in store.list("train"):
        st, seed = m.stats, (m.config or {}).get("seed", "?")
        if st.get("val_acc_per_pos"):
            by_head.setdefault(st.get("head", "?"), {})[seed] = st
    print(f"| head | seed | steps | tokens | held-out acc per position | simulated AL k={args.k} |")
    print("|---|---:|---:|---:|---|---:|")
    means: dict[str, float] = {}
    for head, seeds in sorted(by_head.items()):
        als = []
        for seed, st in sorted(seeds.items(), key=lambda x: str(x[0])):
            al = simulated_acceptance_length(st["val_acc_per_pos"], args.k)
            als.append(al)
            print(f"| {head} | {seed} | {st.get('steps')} | {st.get('tokens')} | "
                  f"{' / '.join(f'{a:.3f}' for a in st['val_acc_per_pos'])} | {al:.3f} |")
        means[head] = statistics.mean(als)
        print(f"| {head} | mean of {len(als)} | | | | {means[head]:.3f} (spread {max(als) - min(als):.3f}) |")
    for head, mean in sorted(means.items()):
        if head.endswith("-lk") and head[:-3] in means:
            print(f"\n{head} / {head[:-3]}: {mean / means[head[:-3]]:.3f}x simulated AL at k={args.k}")


if __name__ == "__main__":
    main()
