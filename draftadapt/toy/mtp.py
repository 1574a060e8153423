"""The toy target with MTP layers (``toy build --mtp N``): a Qwen2 body trained jointly with them.

vLLM serves a target's own MTP layers with ``method="mtp"`` on CPU through its MiMo path
(docs/design.md, "MTP"): the body is a plain Qwen2 model whose config says
``"architectures": ["MiMoForCausalLM"]`` and ``"num_nextn_predict_layers": N``, and whose
``model.safetensors`` also holds ``model.mtp_layers.{i}.*``. transformers loads the same
directory as a ``Qwen2ForCausalLM`` (its auto class follows ``model_type``) and drops the MTP
tensors as unexpected keys, so the HF policy never holds them and RL gradients cannot reach them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftadapt.drafts.mtp import MTP_ARCH, MTPConfig, MTPHead
from draftadapt.train.losses import step_weights

# Train layer 0 three draft steps deep (vLLM chains it k times for k > 1) with the Eagle-3 / HASS
# step weights 0.8^j: the demo speculates k = 3.
JOINT_TTT_STEPS = 3
JOINT_STEP_DECAY = 0.8
# Each step's MTP loss is added to the LM's at its full step weight (2.44 in all). The body pays
# for it: the seed-0 MTP toy solves 0.09 of the held-out problems at T=1, the llama toy 0.41.
# A smaller weight (DeepSeek-V3's lambda = 0.3) should give that back; not measured yet.


class JointMTP(nn.Module):
    """A Qwen2 causal LM and its MTP head, trained together: ``model(**batch).loss`` is the LM's
    loss plus the MTP head's (the same labels, t + 2 + j at draft step j); any other call is the
    LM's own (generation, evaluation)."""

    def __init__(self, lm: nn.Module, num_mtp: int, seed: int, weight: float = 1.0):
        super().__init__()
        self.lm = lm
        self.weight = weight
        self.head = MTPHead(MTPConfig.from_hf({**lm.config.to_dict(), "architectures": [MTP_ARCH],
                                               "num_nextn_predict_layers": num_mtp}))
        self.head.init_weights(seed)
        # Joint training: the head uses the LM's own embedding and output head (vLLM shares them).
        self.head.embed_tokens = lm.get_input_embeddings()
        self.head.lm_head = lm.get_output_embeddings()
        self._pre_norm: torch.Tensor | None = None
        lm.model.norm.register_forward_pre_hook(self._keep)

    def _keep(self, _module, inputs):
        self._pre_norm = inputs[0]  # the residual stream after the last layer, before the final norm

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = self.lm(input_ids=input_ids, labels=labels, **kwargs)
        if labels is None:
            return out
        ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # slot t reads t + 1

        def feed(j, _logits):  # the data's own tokens: t + j + 2 at step j + 1
            return torch.cat([input_ids[:, j + 2:], torch.zeros_like(input_ids[:, :j + 2])], dim=1)

        steps = self.head.unroll(ids, self._pre_norm, JOINT_TTT_STEPS, feed_ids=feed)
        weights = step_weights(JOINT_TTT_STEPS, JOINT_STEP_DECAY)
        mtp = sum(w * _shifted_ce(lg, labels, 2 + j) for j, (w, lg) in enumerate(zip(weights, steps)))
        out.loss = out.loss + self.weight * mtp
        return out


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor, shift: int) -> torch.Tensor:
    """CE of logits at t against labels at t + shift (-100 ignored). logits [B, T, V], labels [B, T]."""
    lg, tg = logits[:, : -shift], labels[:, shift:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), tg.reshape(-1), ignore_index=-100)


def save_mtp(out: Path, head: MTPHead) -> None:
    """Add the MTP layers to a target ``save_pretrained`` wrote: tensors and config, as vLLM reads them."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    sd = load_file(str(path))
    sd.update(head.mtp_state_dict())
    save_file(sd, str(path), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=[MTP_ARCH], num_nextn_predict_layers=head.cfg.num_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def carry_mtp_layers(src: Path, dst: Path) -> None:
    """Give a policy saved with ``save_pretrained`` (a plain Qwen2 model) the MTP layers and config
    of the MTP target ``src`` it was trained from, so that ``dst`` serves with ``method="mtp"``
    too; nothing when ``src`` has no MTP layers."""
    from draftadapt.drafts.mtp import head_from_target

    cfg = json.loads((Path(src) / "config.json").read_text())
    if MTP_ARCH not in (cfg.get("architectures") or []):
        return
    save_mtp(Path(dst), head_from_target(src))
