"""The trainer run the CUDA tests compare against: a tiny Eagle-3 head trained on fixed synthetic
batches. Imported by tests/gpu/test_cuda.py, and run as a script (with CUDA hidden) for the CPU
reference:

    CUDA_VISIBLE_DEVICES= python tests/gpu/reference.py OUT.pt [PRECISION]
"""

from __future__ import annotations

import sys

import torch

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.drafts.eagle3 import Eagle3Config, Eagle3Head
from draftadapt.train.trainer import DraftTrainer, TrainConfig

STEPS = 8
VT, VD, H = 256, 128, 64


def head() -> Eagle3Head:
    cfg = Eagle3Config(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, target_hidden_size=H, target_vocab_size=VT, draft_vocab_size=VD,
                       aux_layer_ids=[1, 2, 3], target_num_layers=4)
    h = Eagle3Head(cfg)
    h.init_weights(seed=0)
    return h


def batches(n: int = STEPS, b: int = 8, t: int = 48) -> list[CapturedBatch]:
    """Fixed data: the target's log-probs normalised over its whole vocabulary, kept on the draft's."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VT, (b, t), generator=g)
        loss_mask = torch.zeros(b, t, dtype=torch.bool)
        loss_mask[:, 8:-1] = True
        logp = torch.log_softmax(2 * torch.randn(b, t, VT, generator=g), -1)[..., :VD]
        aux = torch.randn(b, t, 3 * H, generator=g)
        out.append(CapturedBatch(ids, torch.ones(b, t, dtype=torch.long), loss_mask, logp.contiguous(), aux))
    return out


def train(precision: str) -> dict:
    """Losses and simulated acceptance per step, and the final weights (on CPU)."""
    cfg = TrainConfig(lr=3e-3, warmup_steps=0, schedule="constant", batch_size=8, precision=precision, seed=0)
    trainer = DraftTrainer(head(), "eagle3", cfg)
    losses, accept = [], []
    for batch in batches():
        m = trainer.train_step(batch)
        losses.append(m["train/loss"])
        accept.append(m["accept/simulated_length"])
    return {"device": str(trainer.device), "precision": trainer.precision, "losses": losses, "accept": accept,
            "weights": {k: v.detach().float().cpu() for k, v in trainer.draft.state_dict().items()},
            "weight_dtype": str(trainer.draft.fc.weight.dtype)}


if __name__ == "__main__":
    torch.save(train(sys.argv[2] if len(sys.argv) > 2 else "fp32"), sys.argv[1])
