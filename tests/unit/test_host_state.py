"""Constructing (and stepping) a DraftTrainer inside another framework's process leaves that
process's global state as it was: torch's RNG and thread count, the environment, accelerate's
shared states (issue 16, item 5; docs/design.md, "TRL integration")."""

from __future__ import annotations

import os

import pytest
import torch

from draftadapt.capture.hidden import TargetCapture
from draftadapt.data.sequences import collate
from draftadapt.train.trainer import DraftTrainer, TrainConfig

from .test_trainer import tiny_data, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def snapshot() -> dict:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return {"rng": torch.get_rng_state(), "threads": torch.get_num_threads(), "env": dict(os.environ),
            **{c.__name__: dict(c._shared_state) for c in (PartialState, AcceleratorState, GradientState)}}


def assert_same(before: dict, after: dict) -> None:
    assert torch.equal(before["rng"], after["rng"]), "torch's global RNG was reseeded or advanced"
    assert before["threads"] == after["threads"]
    changed_env = {k for k in set(before["env"]) | set(after["env"]) if before["env"].get(k) != after["env"].get(k)}
    assert not changed_env, f"environment changed: {sorted(changed_env)}"
    for name in ("PartialState", "AcceleratorState", "GradientState"):
        b, a = before[name], after[name]
        changed = {k for k in set(b) | set(a) if b.get(k, "<unset>") is not a.get(k, "<unset>") and b.get(k) != a.get(k)}
        assert not changed, f"accelerate's {name} changed: { {k: (b.get(k), a.get(k)) for k in changed} }"


def test_draft_trainer_leaves_the_host_process_state_alone():
    from accelerate import Accelerator

    from draftadapt.drafts.eagle3 import init_from_target

    # the host: an RL trainer's own Accelerator, accumulating gradients over 4 micro-steps
    Accelerator(cpu=True, gradient_accumulation_steps=4)
    torch.manual_seed(1234)
    target = tiny_target()
    draft = init_from_target(target, [1, 2, 3], None, None, 0)
    before = snapshot()
    trainer = DraftTrainer(draft, "eagle3", TrainConfig(batch_size=8, lr=1e-2, seed=7, threads=3))
    assert_same(before, snapshot())

    # its own steps run at its own thread count and give the host's back
    capture = TargetCapture(target, [1, 2, 3])
    batch = capture.capture(collate(tiny_data(8), 0))
    seen = []
    orig = trainer._train_step
    trainer._train_step = lambda b: (seen.append(torch.get_num_threads()), orig(b))[1]
    before = snapshot()
    trainer.train_steps([batch], n=1)
    # (vLLM's CPU worker replaces torch.set_num_threads with a no-op; RolloutEngine puts it back,
    # so an engine started earlier in this process does not pin the count)
    assert seen == [3]
    assert_same(before, snapshot())


HOST_THEN_TRAIN = """
import sys
from accelerate import Accelerator
if sys.argv[1] == "bf16":
    Accelerator(cpu=True, mixed_precision="bf16")  # the host's, as TRL's GRPOConfig makes it on a bf16 CPU
from draftadapt.train.trainer import DraftTrainer, TrainConfig
from tests.unit.test_losses import tiny_head
from tests.unit.test_packing import H, padded_batch
trainer = DraftTrainer(tiny_head(), "eagle3", TrainConfig(lr=1e-2, warmup_steps=0, schedule="constant", batch_size=6))
print(repr([trainer.train_step(padded_batch(3 * H))["train/loss"] for _ in range(2)]))
"""


def test_the_draft_trains_at_its_own_precision_beside_a_bf16_host():
    """accelerate's state is process-wide: a host's Accelerator in bf16 mixed precision made
    prepare() wrap the draft's forward in bf16 autocast, and a float32 DraftTrainer's second step
    moved 1.8e-4 (the suite's chunked-loss comparison, after an in-process TRL run). The draft
    trains at train.precision whatever the host's: the same losses to the last bit. Fresh
    interpreters: accelerate's state cannot be set up twice in one process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    losses = []
    for host in ("none", "bf16"):
        done = subprocess.run([sys.executable, "-c", HOST_THEN_TRAIN, host], cwd=root, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(done.stdout.strip().splitlines()[-1])
    assert losses[0] == losses[1], losses


def test_draft_trainer_init_is_still_deterministic_per_seed():
    from draftadapt.drafts.eagle3 import init_from_target

    target = tiny_target()
    capture = TargetCapture(target, [1, 2, 3])
    batch = capture.capture(collate(tiny_data(8), 0))
    losses = []
    for _ in range(2):
        torch.manual_seed(len(losses))  # a different global RNG each time: must not matter
        t = DraftTrainer(init_from_target(target, [1, 2, 3], None, None, 0), "eagle3", TrainConfig(batch_size=8, lr=1e-2, seed=7))
        losses.append(t.train_step(batch)["train/loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
