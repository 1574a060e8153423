"""The toy GRPO run that plays "an existing RL run", with draftadapt attached through its public API.

    .venv/bin/python recipes/toy_grpo.py --out runs/demo       # the same as: draftadapt demo --out runs/demo

Takes the demo's flags (--out, --steps, --seed, --toy) and DemoConfig key=value overrides, and
prints one line per RL step, then one JSON summary line. The loop and its configs live in the
package (draftadapt/rl/loop.py: the RL run for any world), so that
`draftadapt demo` runs from any directory; this file is its entry from a checkout.
"""

import sys

from draftadapt.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
