r"""The fault soak's long tier: several seeded soaks per engine, then the faults by kind.

    python -m tests.soak_long                      # both engines
    python -m tests.soak_long --engines=jax --scale=0.5
    python -m tests.soak_long --engines=jax --soaks=mnist:2,inception:2

For each engine it runs `tests.soak` on MNIST and Inception, with one worker
and with two (the soaks of `SOAKS`, each with its own seed), one after
another, then prints every engine's faults by kind and the fault points
struck. It stops at the first soak that fails (its work directory kept and
named), and fails when an engine's soaks left a fault point of theirs
unstruck. At `--scale=1` each engine takes over 100 faults.
"""

import argparse
import collections
import shutil
import sys
import tempfile
import time

from tests import soak

# (trainer, workers, faults, seed) of each engine's soaks.
SOAKS = (
    ("mnist", 1, 40, 11),
    ("mnist", 2, 16, 12),
    ("inception", 1, 32, 13),
    ("inception", 2, 16, 14),
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="tensorflow,jax")
    parser.add_argument("--scale", type=float, default=1.0, help="times each soak's faults")
    parser.add_argument(
        "--soaks",
        default="",
        help="only these of SOAKS, as TRAINER:WORKERS, comma-separated (e.g. inception:2)",
    )
    args = parser.parse_args(argv)
    chosen = {tuple(s.split(":")) for s in args.soaks.split(",") if s}
    totals = {}
    unstruck = {}
    for engine in args.engines.split(","):
        struck = []
        points = set()
        for trainer, workers, faults, seed in SOAKS:
            if chosen and (trainer, str(workers)) not in chosen:
                continue
            faults = max(1, round(faults * args.scale))
            scenario = soak.scenario_for(trainer, engine, workers, faults)
            work_dir = tempfile.mkdtemp(prefix="keras_bn_soak_")
            began = time.monotonic()
            run = soak.Soak(scenario, faults, seed, work_dir)
            try:
                struck += run.run()
            except soak.SoakFailure as failure:
                print(
                    f"soak FAILED ({engine}, {trainer}, {workers} workers, seed {seed}; "
                    f"work directory kept: {work_dir}): {failure}"
                )
                return 1
            shutil.rmtree(work_dir, ignore_errors=True)
            points |= run.fault_points()
            print(f"  ({trainer}, {workers} worker(s): {time.monotonic() - began:.0f} s)")
        totals[engine] = struck
        unstruck[engine] = sorted(points - {f.point for f in struck})
    for engine, struck in totals.items():
        print(f"\n{engine}: {len(struck)} faults")
        for kind, count in sorted(
            collections.Counter(f"{f.category}: {f.kind}" for f in struck).items()
        ):
            print(f"  {count:4d}  {kind}")
        points = collections.Counter(f.point for f in struck if f.point)
        print(
            f"  fault points struck ({len(points)}): "
            + ", ".join(f"{p} ×{n}" for p, n in sorted(points.items()))
        )
        if unstruck[engine]:
            print(f"  fault points NOT struck: {', '.join(unstruck[engine])}")
    return 1 if any(unstruck.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
