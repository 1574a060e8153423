"""The draft trainer: built once, stepped many times (pretraining and online adaptation alike).

    trainer = DraftTrainer(head, "eagle3", TrainConfig(), total_steps=1000)
    for batch in iter_captured(capture, batches):          # CapturedBatch, one at a time
        metrics = trainer.train_step(batch)                 # optimizer state persists
    trainer.train_steps(more_batches, n=50)                 # later, on new data
    visited, uniform = trainer.score(heldout_batches, k=3)  # simulated vLLM acceptance
    trainer.save_checkpoint(dir); trainer.load_checkpoint(dir)

Data parallel through accelerate (DDP; gloo on CPU) or DeepSpeed ZeRO (``zero_stage`` or a
DeepSpeed JSON config; on CPU run with ``DS_ACCELERATOR=cpu``). Each rank trains on its own
batches; metrics are reduced as sums and counts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.metrics.acceptance import AcceptanceStats, simulate_acceptance, simulate_acceptance_ids
from draftadapt.precision import cpu_bf16_pays
from draftadapt.tensors import all_finite
from draftadapt.train import losses
from draftadapt.train.forward import DraftLMForward, Eagle3TTT
from draftadapt.train.methods import DraftMethod, method_for

STATE_FILE = "trainer_state.json"


@dataclass
class TrainConfig:
    lr: float = 3e-3  # AdamW peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay (matrices only; norms and biases get none)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    warmup_steps: int = 20  # linear warmup from 0
    schedule: str = "cosine"  # "cosine" (to min_lr_ratio at total_steps) or "constant" after warmup
    min_lr_ratio: float = 0.1  # cosine schedule: the rate ends at lr x this
    batch_size: int = 32  # sequences per optimizer step per rank
    ttt_steps: int = 3  # Eagle-3 training-time-test depth (EAGLE-3 unrolls >= 3; vLLM k = 3)
    step_decay: float = 0.8  # weight of TTT step i is decay^i (EAGLE-3 / HASS)
    ttt_feed: str = "data"  # token inputs of TTT steps >= 1: "data" or "argmax" (see train/forward.py)
    # Share of each sequence's loss positions, drawn afresh every step, at which TTT steps >= 1 run
    # (step 0 always runs on every position): 0.25 cuts a 3-step unroll's work by about half, and
    # each step's loss stays an unbiased mean (docs/design.md, "Adapter cost"). 1 = every position.
    ttt_slots: float = 1.0
    loss: str = "kl"  # "kl": forward KL to the target restricted to the draft vocab; "ce": sampled tokens
    # Eagle-3 and MTP: lm_head and the loss run this many tokens at a time, the gradients formed in
    # the forward, so no [tokens, draft vocab] tensor is kept for backward (same value and gradients,
    # tests/unit/test_chunked_loss.py); 0: every step's logits at once (the reference path).
    # ZeRO-3 always takes the reference path: its lm_head is gathered only inside lm_head's forward.
    loss_chunk: int = 1024
    # Eagle-3: lm_head is not trained (speculators' trainer's default; start it from the target's rows
    # with draft.lm_head_from_target). Saves its gradient and AdamW state: 65M of a 1b head's parameters.
    freeze_lm_head: bool = False
    zero_stage: int = 0  # 0: plain DDP; 1-3: DeepSpeed ZeRO stage (needs deepspeed; CPU: DS_ACCELERATOR=cpu)
    deepspeed_config: str | None = None  # path to a DeepSpeed JSON config (overrides zero_stage)
    seed: int = 0  # the draft wrapper's init, the TTT slot draws, pretrain's batch order and the adapter's replay draws
    threads: int = 0  # torch intra-op threads for training; 0 = leave torch's default
    # "auto": bf16 autocast (float32 master weights and optimizer state, as always) on a CUDA
    # device, and on a CPU with AMX-BF16 or avx512_bf16 for a draft at least 512 wide (draftadapt/precision.py); plain
    # float32 elsewhere; "bf16" / "fp32" force one (docs/design.md, "Precision").
    precision: str = "auto"

    def validate(self) -> None:
        from draftadapt.config import ConfigError

        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(f"train.schedule {self.schedule!r}: use 'cosine' or 'constant'")
        if self.loss not in ("kl", "ce"):
            raise ConfigError(f"train.loss {self.loss!r}: use 'kl' (forward KL) or 'ce' (sampled tokens)")
        if self.ttt_feed not in ("data", "argmax"):
            raise ConfigError(f"train.ttt_feed {self.ttt_feed!r}: use 'data' or 'argmax'")
        if self.ttt_steps < 1:
            raise ConfigError(f"train.ttt_steps must be >= 1 (got {self.ttt_steps}); EAGLE-3 uses >= 3")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage {self.zero_stage}: use 0 (DDP) or a ZeRO stage 1-3")
        if self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("train.batch_size must be >= 1 and train.lr > 0")
        if not 0 < self.ttt_slots <= 1:
            raise ConfigError(f"train.ttt_slots must be in (0, 1] (got {self.ttt_slots}): the share of loss "
                              "positions TTT steps >= 1 run at; 1 = all")
        if self.loss_chunk < 0:
            raise ConfigError(f"train.loss_chunk must be >= 0 (got {self.loss_chunk}): tokens per chunk of the "
                              "draft-vocab loss; 0 = all at once")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"train.precision {self.precision!r}: use 'auto' (bf16 autocast on CUDA and on a "
                              "CPU with AMX-BF16 or avx512_bf16 for a wide draft, else float32), 'bf16' or 'fp32'")


def draft_width(draft: nn.Module) -> int:
    """The draft's hidden width as its matmuls see it: the widest Linear's narrower side."""
    return max((min(m.in_features, m.out_features) for m in draft.modules() if isinstance(m, nn.Linear)), default=0)


def auto_precision(device: torch.device, draft: nn.Module) -> str:
    """train.precision=auto: bf16 on CUDA; on a CPU, bf16 where it multiplies bf16 in hardware (AMX
    tiles or avx512_bf16) and the draft is wide enough to gain from it (draftadapt/precision.py)."""
    if device.type == "cuda":
        return "bf16"
    if device.type == "cpu" and cpu_bf16_pays(draft_width(draft)):
        return "bf16"
    return "fp32"


def make_accelerator(cfg: TrainConfig):
    """An accelerate ``Accelerator``: DDP (gloo on CPU) or DeepSpeed ZeRO from the config."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if cfg.deepspeed_config or cfg.zero_stage:
        # accelerate only sets DeepSpeed up when not forced onto CPU; on a CPU-only machine
        # DeepSpeed itself picks its CPU accelerator (DS_ACCELERATOR=cpu) and the gloo backend.
        plugin = DeepSpeedPlugin(hf_ds_config=_deepspeed_dict(cfg))
        accelerator = Accelerator(cpu=False, deepspeed_plugin=plugin)
        _fix_cpu_deepspeed_ranks()
        return accelerator
    from accelerate.state import GradientState

    # accelerate's states are process-wide singletons. A second Accelerator() in a process where
    # an RL trainer already made one (TRL, gradient_accumulation_steps=4) resets the shared
    # gradient-accumulation steps to its own 1; put the host's back (our steps never accumulate).
    host = GradientState._shared_state.get("plugin_kwargs")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if host is not None:
        GradientState._shared_state["plugin_kwargs"] = host
    # The draft trains at train.precision (DraftTrainer._autocast), not at the mixed precision a
    # host's Accelerator left in the same shared state: TRL's GRPOConfig turns bf16 on wherever
    # the CPU has it, and prepare() would wrap the draft's forward in bf16 autocast. (Found in the
    # suite: after an in-process TRL run, a float32 trainer's second step moved 1.8e-4.)
    accelerator.native_amp = False
    return accelerator


def _fix_cpu_deepspeed_ranks() -> None:
    """accelerate 1.x on a CPU-only machine with DeepSpeed finds no backend, records 1 process
    and rank 0 on every rank, while DeepSpeed has already joined all ranks in a gloo group: every
    rank then acts as the main process and ``reduce(mean)`` divides a world-sized sum by 1. Take
    the ranks from torch.distributed."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", rank))
    for state in (PartialState(), AcceleratorState()):
        if state.num_processes != world or state.process_index != rank:
            state.num_processes, state.process_index, state.local_process_index = world, rank, local


def _deepspeed_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed config: the user's JSON if given, with what this trainer controls filled in."""
    ds: dict[str, Any] = {}
    if cfg.deepspeed_config:
        path = Path(cfg.deepspeed_config)
        if not path.is_file():
            raise FileNotFoundError(f"train.deepspeed_config {path} does not exist; pass a DeepSpeed JSON file")
        ds = json.loads(path.read_text())
    else:
        ds["zero_optimization"] = {"stage": cfg.zero_stage}
    # One trainer step is one micro batch on each rank; the batch is sized by train.batch_size.
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.setdefault("gradient_clipping", cfg.grad_clip)
    # Our AdamW is torch's (FusedAdam needs CUDA); ZeRO refuses unknown optimizers unless told.
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("steps_per_print", 10**9)
    return ds


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count is process-wide: ``n`` (> 0) for this block, then put back."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lr_lambda(cfg: TrainConfig, total_steps: int | None):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or not total_steps:
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


class DraftTrainer:
    """Owns the draft, its optimizer, schedule and step counter; see the module docstring."""

    def __init__(self, draft: nn.Module, method: str | DraftMethod, cfg: TrainConfig, total_steps: int | None = None,
                 accelerator=None, pad_id: int = 0):
        # Nothing here changes process-wide state of a host RL framework (docs/design.md, "TRL
        # integration"): cfg.threads applies inside this trainer's own steps only, the seed to a
        # forked RNG, and an accelerate state someone else set up is reused as it is.
        self.cfg = cfg
        self.method = method_for(method)
        self.accelerator = accelerator or make_accelerator(cfg)
        self.is_deepspeed = self.accelerator.state.deepspeed_plugin is not None
        if cfg.freeze_lm_head:
            self.method.freeze_lm_head(draft)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            module = self.method.wrap(draft, cfg.ttt_steps, cfg.ttt_feed, pad_id)
        module.train()
        decay, no_decay = [], []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
        # fused: one kernel over all parameters. torch's default on CPU tensors is a loop of ~10
        # elementwise ops per parameter; at 1b widths (78M parameters, 2 cores, Xeon) the fused
        # step took 85 ms against 541 ms (docs/results.md, "bf16 on a CPU that has it").
        # DeepSpeed steps its own partitions of the optimizer, so it keeps torch's default.
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=None if self.is_deepspeed else True,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(module, opt, sched)
        self._vocab_ids = self.method.vocab_ids(draft)  # [Vd] target id of each draft id
        t2d = torch.full((int(self._vocab_ids.max()) + 1,), -1, dtype=torch.long)
        t2d[self._vocab_ids] = torch.arange(self._vocab_ids.numel())
        self._target_to_draft = t2d  # target id -> draft id, -1 outside the draft vocab
        self.weights = losses.step_weights(cfg.ttt_steps, cfg.step_decay)
        self._slot_rng = torch.Generator().manual_seed(cfg.seed)  # TTT slot draws (cfg.ttt_slots)
        zero3 = self.is_deepspeed and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        self.loss_chunk = 0 if zero3 else cfg.loss_chunk
        self.precision = cfg.precision if cfg.precision != "auto" else auto_precision(self.device, draft)
        self.step = 0  # optimizer steps taken
        # the last step's loss per sequence of its batch (the first TTT step's; a draft LM's one
        # step): the adapter's replay priorities (AdapterConfig.priority; the adapter trains on
        # one rank, each rank's batch is the whole pick)
        self.last_row_losses: torch.Tensor | None = None

    # ------------------------------------------------------------------ properties

    @property
    def draft(self) -> nn.Module:
        """The bare draft (Eagle3Head or HF model) for export; shares parameters with training."""
        return self.method.unwrap(self.accelerator.unwrap_model(self.model))

    def export_draft(self) -> nn.Module:
        """A full-weight CPU copy of the draft for export (gathers ZeRO-3 partitions; all ranks call it)."""
        import copy

        if not self.is_deepspeed:
            # the weights are whole here: copy on the device, then one copy to the host
            return copy.deepcopy(self.draft).cpu().eval()
        state = self.accelerator.get_state_dict(self.model)  # names of the wrapper: head.* / model.*
        draft = copy.deepcopy(self.draft).cpu()
        prefix = self.method.wrapper_prefix
        if state is not None:
            draft.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return draft.eval()

    def live_copy(self) -> nn.Module:
        """A copy of the draft as it stands, on the trainer's device, for scoring (no round trip
        through host memory unless ZeRO-3 holds it in partitions)."""
        import copy

        if self.is_deepspeed:
            return self.export_draft().to(self.device)
        return copy.deepcopy(self.draft).eval()

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    # ------------------------------------------------------------------ training

    def _sampled_draft_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T] draft id of token t + 1 (-1 outside the draft vocab): CE labels."""
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        t2d = self._target_to_draft.to(input_ids.device)
        ids = t2d[nxt.clamp(max=t2d.numel() - 1)]
        return torch.where(nxt < t2d.numel(), ids, torch.full_like(ids, -1))

    def _slots(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """([B, M] positions, [B, M] real) drawn uniformly among each row's loss positions, M the
        ``ttt_slots`` share of the longest row's count; (None, None) when every position runs."""
        if self.cfg.ttt_slots >= 1 or self.cfg.ttt_steps < 2:
            return None, None
        m = max(1, math.ceil(self.cfg.ttt_slots * int(loss_mask.sum(1).max())))
        draw = torch.rand(loss_mask.shape, generator=self._slot_rng).to(loss_mask.device)
        slots = draw.masked_fill(~loss_mask, -1.0).topk(m, dim=1).indices.sort(dim=1).values
        return slots, loss_mask.gather(1, slots)

    def _autocast(self):
        """The forward's precision: bf16 autocast (matmuls in bf16, reductions and the weights in
        float32) or none."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, batch: CapturedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor], torch.Tensor]:
        labels = self._sampled_draft_ids(batch.input_ids) if self.cfg.loss == "ce" else None
        loss, per_step, accs, steps, rows = self.method.loss(self.model, batch, self.cfg, self.weights, labels, self._slots,
                                                             self.loss_chunk)
        parts = {f"loss_pos_{i}": l for i, l in enumerate(per_step)}
        parts.update({f"acc_pos_{i}": a for i, a in enumerate(accs)})
        return loss, parts, steps, rows

    def train_step(self, batch: CapturedBatch) -> dict[str, float]:
        """One optimizer step on one captured batch; returns metrics averaged over ranks.

        Keys: ``train/loss``, ``train/loss_pos_i``, ``train/acc_pos_i``, ``train/lr``,
        ``train/grad_norm``, ``train/tokens`` (summed over ranks), ``accept/simulated_length``
        and ``accept/pos_i`` (simulated on this batch over every drafting start).
        """
        with torch_threads(self.cfg.threads):
            return self._train_step(batch)

    def _train_step(self, batch: CapturedBatch) -> dict[str, float]:
        batch = batch.to(self.device)
        self.model.train()
        with self._autocast():
            loss, parts, steps, rows = self._loss(batch)
        self.last_row_losses = rows.detach()  # no host sync here: read when the next batch is drawn
        self.accelerator.backward(loss)
        grad_norm = torch.zeros(())
        if self.cfg.grad_clip and not self.is_deepspeed:  # DeepSpeed clips from its own config
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        uniform = AcceptanceStats(max(len(steps), 1))
        if steps:
            with torch.no_grad():
                _, uniform = simulate_acceptance_ids(
                    torch.stack(steps, dim=-1), self._vocab_ids, batch.target_logp, batch.input_ids,
                    batch.loss_mask, visit=False,
                )
        means = torch.stack([loss.detach().float(), *[v.float() for v in parts.values()],
                             torch.as_tensor(grad_norm, dtype=torch.float32).reshape(())])
        means = self.accelerator.reduce(means.to(self.device), reduction="mean").cpu()
        sums = self.accelerator.reduce(
            torch.cat([uniform.to_tensor(), torch.tensor([float(batch.num_tokens)], dtype=torch.float64)]).to(self.device),
            reduction="sum",
        ).cpu()
        acc = AcceptanceStats.from_tensor(sums[:-1])
        out = {"train/loss": float(means[0])}
        for name, v in zip(parts, means[1:-1]):
            out[f"train/{name}"] = float(v)
        out["train/grad_norm"] = float(means[-1])
        out["train/lr"] = float(lr)
        out["train/tokens"] = float(sums[-1])
        if steps:
            out.update(acceptance_metrics(acc, prefix="accept"))
        return out

    def train_steps(self, batches: Iterable[CapturedBatch], n: int | None = None, callback=None) -> dict[str, float]:
        """Up to ``n`` steps (all batches if None); returns each metric averaged over the steps.

        ``callback(step, metrics)`` runs after each step (logging, checkpointing, progress).
        """
        totals: dict[str, float] = {}
        done = 0
        for batch in batches:
            if n is not None and done >= n:
                break
            m = self.train_step(batch)
            done += 1
            for key, v in m.items():
                totals[key] = totals.get(key, 0.0) + v
            if callback is not None:
                callback(self.step, m)
        return {key: v / done for key, v in totals.items()} if done else {}

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def score(self, batches: Iterable[CapturedBatch], k: int = 3) -> tuple[AcceptanceStats, AcceptanceStats]:
        """Simulated vLLM acceptance of the current draft at k speculative tokens.

        ``batches`` must be captured at the temperature the engine samples at. Returns
        (stats over the starts vLLM visits, stats over every start), summed over ranks.
        """
        self.model.eval()
        with self._autocast():
            visited, uniform = _score(self.method, self.model, batches, k, self._vocab_ids, self.device)
        self.model.train()
        v = self.accelerator.reduce(visited.to_tensor().to(self.device), reduction="sum").cpu()
        u = self.accelerator.reduce(uniform.to_tensor().to(self.device), reduction="sum").cpu()
        return AcceptanceStats.from_tensor(v), AcceptanceStats.from_tensor(u)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Model, optimizer, schedule and RNG states plus ``trainer_state.json`` (written last).

        Written to ``path.tmp`` and renamed, so an interrupted save never shadows the last good one.
        """
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()
        if self.is_main:
            state = {"step": self.step, "method": self.method.name, **(extra or {})}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        self.accelerator.wait_for_everyone()
        return path

    def resume_state(self) -> dict[str, Any]:
        """What a restart needs beside the published weights: optimizer moments, schedule, step
        (tensors and plain containers only: read back with ``torch.load(weights_only=True)``)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step}

    def load_resume_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def has_optimizer_state(self) -> bool:
        return any(bool(s) for s in _torch_optimizer(self.optimizer).state.values())

    def reset_to(self, module: nn.Module) -> None:
        """Weights from ``module`` (a bare draft of the same shape), optimizer moments cleared."""
        with torch.no_grad():
            self.draft.load_state_dict(module.state_dict())
        _torch_optimizer(self.optimizer).state.clear()  # AdamW starts its moments anew

    def weights_finite(self) -> bool:
        return all(all_finite(p) for p in self.model.parameters())

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore everything :meth:`save_checkpoint` wrote; returns its ``trainer_state.json``."""
        path = Path(path)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE}); delete it and resume from an earlier one")
        state = json.loads(state_file.read_text())
        if state.get("method") not in (None, self.method.name):
            raise ValueError(f"{path} is a {state['method']} checkpoint; this trainer trains {self.method.name}")
        self.accelerator.load_state(str(path))
        self.step = int(state["step"])
        return state


def _torch_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(opt, "optimizer", opt)


def score_draft(draft: nn.Module, batches: Iterable[CapturedBatch], k: int) -> tuple[AcceptanceStats, AcceptanceStats]:
    """Simulated acceptance of a bare draft (Eagle3Head or HF draft LM) on captured held-out
    data, on this process only. Returns (visited-starts stats, every-start stats), both summed.

    The draft is always scored through a fresh default wrapper (data tokens fed along the
    unroll, as on vLLM's accepted path), so a candidate and the live draft are scored alike
    whatever ``train.ttt_feed`` the trainer's own wrapper uses."""
    method = method_for(draft)
    if isinstance(draft, (Eagle3TTT, DraftLMForward)):
        draft = method.unwrap(draft)  # a module wrapped for training: score the draft inside it
    device = next(draft.parameters()).device  # scored where it lives (a GPU trainer's draft on the GPU)
    return _score(method, method.wrap(draft, k), batches, k, method.vocab_ids(draft), device)


@torch.no_grad()
def _score(method: DraftMethod, model: nn.Module, batches: Iterable[CapturedBatch], k: int, vocab_ids: torch.Tensor,
           device: torch.device | str = "cpu") -> tuple[AcceptanceStats, AcceptanceStats]:
    """``model``: the draft wrapped for its method (``method.wrap``, maybe inside DDP)."""
    visited, uniform = AcceptanceStats(k), AcceptanceStats(k)
    for batch in batches:
        batch = batch.to(device)
        steps = method.step_logits(model, batch, k)
        v, u = simulate_acceptance(steps, vocab_ids, batch.target_logp, batch.input_ids, batch.loss_mask)
        visited, uniform = visited + v, uniform + u
    return visited, uniform


def acceptance_metrics(stats: AcceptanceStats, prefix: str = "accept") -> dict[str, float]:
    """``{prefix}/simulated_length`` and ``{prefix}/pos_i`` from summed stats."""
    out = {f"{prefix}/simulated_length": stats.length}
    for i, r in enumerate(stats.per_position):
        out[f"{prefix}/pos_{i}"] = r
    return out
