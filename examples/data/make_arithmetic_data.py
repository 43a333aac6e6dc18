"""Writes the arithmetic data set the file-task example and tests read (run once; output shipped).

    python examples/data/make_arithmetic_data.py

Every sum ``a + b`` of single-digit operands (100 problems; ``--subtract`` adds ``a - b`` for
``a >= b``), as ``{"question": "7 + 3 =", "answer": 10}`` lines, shuffled with seed 0 and split
into ``arithmetic_train.jsonl`` (80) and a held-out ``arithmetic_val.jsonl`` (20; no question
in both). Sums only by default: in 300 GRPO steps the tiny model's exact-answer reward went
0.25 -> 0.49 on them, against 0.13 -> 0.14 with the differences mixed in.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def problems(max_operand: int, subtract: bool) -> list[dict[str, object]]:
    """Every sum and every non-negative difference of two operands in ``0 .. max_operand``."""
    rows: list[dict[str, object]] = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            rows.append({"question": f"{a} + {b} =", "answer": a + b})
            if subtract and a >= b:
                rows.append({"question": f"{a} - {b} =", "answer": a - b})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--subtract", action="store_true", help="differences too")
    ap.add_argument("--val", type=int, default=20, help="held-out problems")
    ap.add_argument("--out-dir", type=Path, default=HERE)
    args = ap.parse_args()
    rows = problems(args.max_operand, args.subtract)
    random.Random(0).shuffle(rows)
    splits = {"val": rows[: args.val], "train": rows[args.val :]}
    for name, part in splits.items():
        path = args.out_dir / f"arithmetic_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path}: {len(part)} problems")


if __name__ == "__main__":
    main()
