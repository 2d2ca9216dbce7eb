"""Reads a run's TensorBoard event files with TensorBoard's own reader (EventAccumulator, the
code behind `tensorboard --logdir`) and checks that the training curves are there: at least
--min-points points of train/loss (steps / log-interval) at increasing steps, the other
per-interval scalars alongside, and the per-epoch test metrics.

Needs only `pip install tensorboard` (no TensorFlow, no torch). Exit status 1 on a failed check.

    python xtask/py/check_tensorboard.py target/ci-run/metrics --min-points 4
"""

import argparse
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PER_INTERVAL = [
    "train/loss",
    "train/learning_rate",
    "train/samples_per_sec",
    "train/comm_seconds",
    "train/comm_fraction",
]
PER_EPOCH = ["test/accuracy", "test/loss", "train/epoch_loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", help="the trainer's --metrics-dir")
    parser.add_argument("--min-points", type=int, required=True,
                        help="the least number of train/loss points (steps / log-interval)")
    args = parser.parse_args()

    if not os.path.isdir(args.logdir):
        print(f"FAILED: no directory {args.logdir}", file=sys.stderr)
        return 1
    # size_guidance 0: keep every point (the default samples scalars down to 10000).
    acc = EventAccumulator(args.logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    failures = []
    for tag in PER_INTERVAL + PER_EPOCH:
        if tag not in tags:
            failures.append(f"no `{tag}` scalars (tags: {sorted(tags)})")
    if "train/loss" in tags:
        points = acc.Scalars("train/loss")
        steps = [p.step for p in points]
        if len(points) < args.min_points:
            failures.append(f"train/loss has {len(points)} points, expected at least "
                            f"{args.min_points}")
        if steps != sorted(set(steps)):
            failures.append(f"train/loss steps are not increasing: {steps}")
        if not all(math.isfinite(p.value) for p in points):
            failures.append("train/loss has non-finite values")
        curve = ", ".join(f"{p.step}: {p.value:.4f}" for p in points)
        print(f"TensorBoard {__import__('tensorboard').__version__} reads train/loss "
              f"({len(points)} points): {curve}")
    for tag in PER_INTERVAL[1:] + PER_EPOCH:
        if tag in tags:
            last = acc.Scalars(tag)[-1]
            print(f"  {tag}: {len(acc.Scalars(tag))} points, last {last.value:.6g} at step "
                  f"{last.step}")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
