"""Draft directories on disk: export and import in the formats vLLM and other trainers use.

Three layouts, each a directory with ``config.json``, ``model.safetensors`` and our
``draftadapt.json`` (target fingerprint, versions, sha256):

- ``speculators`` (vLLM speculators / SpecForge export): config has
  ``speculators_model_type: eagle3``, a ``transformer_layer_config`` (llama), and the Eagle-3
  fields; weights named ``layers.0.*``.
- ``eagle`` (original EAGLE-3 release): a llama config with architecture
  ``LlamaForCausalLMEagle3``; weights named ``midlayer.*``.
- ``hf`` (the small draft LM for ``method="draft_model"``): a plain transformers model dir
  with the target's tokenizer.

Everything a loader could otherwise guess is written explicitly: aux layer ids, draft vocab
size, max positions, ``norm_before_residual``, speculators' ``norm_before_fc``, ``fc_norm`` and
``norm_output``, and which modules are shared with the target
(always none: a shared ``embed_tokens`` in vLLM is the target's own module, and writing it on a
draft swap would overwrite the policy; docs/design.md, "Failures other systems shipped").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftadapt.drafts.eagle3 import LAYER_FIELDS, Eagle3Config, Eagle3Head
from draftadapt.drafts.serving import DraftFormatError  # defined torch-free; callers keep formats.DraftFormatError
from draftadapt.drafts.vocab import check_vocab_map
from draftadapt.fileio import atomic_path, atomic_write_json, bytes_sha256, file_sha256, fsync_dir

META_FILE = "draftadapt.json"
WEIGHTS_FILE = "model.safetensors"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"


# --------------------------------------------------------------------------- target identity

def tokenizer_digest(target_dir: str | Path) -> str:
    """sha256 of the target's vocabulary (token -> id), so a draft can name the tokenizer it was built for.

    Loading a tokenizer takes tens of milliseconds (seconds for a large vocabulary) and every
    export and swap asks: computed once per state of the directory's tokenizer files."""
    target_dir = Path(target_dir).resolve()
    files = sorted(f for f in target_dir.glob("*") if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")))
    key = (str(target_dir), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))
    if key not in _TOKENIZER_DIGESTS:
        _TOKENIZER_DIGESTS[key] = _tokenizer_digest(target_dir)
    return _TOKENIZER_DIGESTS[key]


_TOKENIZER_DIGESTS: dict[tuple, str] = {}


def _tokenizer_digest(target_dir: Path) -> str:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as exc:  # transformers raises several types for a missing tokenizer
        raise DraftFormatError(
            f"no usable tokenizer in {target_dir} ({type(exc).__name__}: {exc}); save the target's "
            "tokenizer there with tokenizer.save_pretrained(DIR)"
        ) from None
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return bytes_sha256(json.dumps(vocab).encode())


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DraftFormatError(f"{path} is missing; {model_dir} is not a model directory")
    return json.loads(path.read_text())


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise DraftFormatError(f"dtype {dtype!r}: weights are float32, bfloat16 or float16")
    return name


def model_dtype(model_dir: str | Path) -> str:
    """The dtype an HF model directory says its weights are in (float32 when it names none)."""
    cfg = read_hf_config(model_dir)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return dtype_name(cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype")
                      or text.get("torch_dtype") or "float32")


def target_fingerprint(target_dir: str | Path) -> dict[str, Any]:
    cfg = read_hf_config(target_dir)
    if "text_config" in cfg:  # multimodal wrappers keep the LM config one level down
        cfg = {**cfg, **cfg["text_config"]}
    return {
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "tokenizer_sha256": tokenizer_digest(target_dir),
    }


# --------------------------------------------------------------------------- Eagle-3 export

def _layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    """The llama config of the head's single decoder layer, as transformers writes it."""
    from transformers import LlamaConfig

    layer = {name: getattr(cfg, name) for name in LAYER_FIELDS}
    lc = LlamaConfig(**layer, vocab_size=cfg.target_vocab_size, num_hidden_layers=1, tie_word_embeddings=False).to_dict()
    lc["architectures"] = [EAGLE3_ARCH]
    lc.pop("transformers_version", None)
    return lc


def eagle3_state_dict(head: Eagle3Head, fmt: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Checkpoint names for ``fmt`` and float tensors in ``dtype``; d2t/t2d only when the draft
    vocab is reduced.

    vLLM keeps ``draft_id_to_target_id`` only when draft vocab != target vocab and would reject a
    ``d2t`` it has no parameter for.
    """
    sd = {k: v.detach().to(FLOAT_DTYPES[dtype]).contiguous().clone() for k, v in head.state_dict().items()}
    sd["d2t"] = head.d2t.to(torch.int64).clone()
    sd["t2d"] = head.t2d.to(torch.bool).clone()
    if head.cfg.draft_vocab_size == head.cfg.target_vocab_size:
        del sd["d2t"], sd["t2d"]
    if head.cfg.share_embeddings:
        del sd["embed_tokens.weight"]  # vLLM then serves the target's own embed_tokens
    if fmt == "eagle":
        sd = {k.replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}
    return sd


def export_eagle3(
    head: Eagle3Head,
    out: str | Path,
    target_dir: str | Path,
    fmt: str = "speculators",
    num_speculative_tokens: int = 3,
    meta: dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
) -> Path:
    """Write ``head`` as a draft directory vLLM loads with ``method="eagle3"``. ``dtype``: of the
    written weights; None = the target's own (a bf16 target gets a bf16 draft: half the bytes
    per swap; training keeps float32 weights of its own)."""
    out = Path(out)
    cfg = head.cfg
    fp = target_fingerprint(target_dir)
    _check_head_fits(cfg, fp, where=f"export to {out}")
    if not cfg.share_embeddings and torch.equal(head.embed_tokens.weight.detach().float(), _target_embeddings(target_dir)):
        # vLLM shares a draft embedding identical to the target's; a later swap would then write
        # into the policy's module. Say it: the embeddings are shared.
        cfg.share_embeddings = True
        head.embed_tokens.weight.requires_grad_(False)
    aux = list(cfg.aux_layer_ids)
    explicit = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": aux,
    }
    if fmt == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            **explicit,
            "transformer_layer_config": _layer_config(cfg),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
                ],
                "verifier": {
                    "name_or_path": str(Path(target_dir).resolve()),
                    "architectures": read_hf_config(target_dir).get("architectures", []),
                },
            },
        }
    elif fmt == "eagle":
        config = {
            **_layer_config(cfg),
            **explicit,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        }
    else:
        raise DraftFormatError(f"unknown Eagle-3 format {fmt!r}; use 'speculators' or 'eagle'")
    sd = eagle3_state_dict(head, fmt, model_dtype(target_dir) if dtype is None else dtype_name(dtype))
    info = {
        "method": "eagle3",
        "format": fmt,
        "head_config": cfg.to_dict(),
        "target": fp,
        "shared_modules": ["embed_tokens"] if cfg.share_embeddings else [],
        "max_position_embeddings": cfg.max_position_embeddings,
        **(meta or {}),
    }
    config["shared_modules"] = info["shared_modules"]
    return _write_draft_dir(out, config, sd, info)


def _write_draft_dir(out: Path, config: dict, sd: dict[str, torch.Tensor], info: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    # Weights first, metadata last: a directory whose draftadapt.json names a sha256 is complete.
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(sd, str(tmp))
    atomic_write_json(out / "config.json", config)
    info = {**info, "sha256": file_sha256(out / WEIGHTS_FILE)}
    atomic_write_json(out / META_FILE, info)
    fsync_dir(out)
    return out


# --------------------------------------------------------------------------- Eagle-3 import

def _read_weights(draft_dir: Path) -> dict[str, torch.Tensor]:
    st = draft_dir / WEIGHTS_FILE
    if st.is_file():
        try:
            return load_file(str(st))
        except Exception as exc:
            raise DraftFormatError(
                f"{st} is not a readable safetensors file ({exc}); it is truncated or corrupt, "
                "re-export the draft"
            ) from None
    bins = sorted(draft_dir.glob("*.bin"))
    if bins:  # original EAGLE releases ship pytorch_model.bin
        sd: dict[str, torch.Tensor] = {}
        for b in bins:
            sd.update(torch.load(b, map_location="cpu", weights_only=True))
        return sd
    raise DraftFormatError(f"no {WEIGHTS_FILE} or *.bin weights in {draft_dir}")


def detect_format(config: dict) -> str:
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if config.get("draftadapt_draft") == "mtp":
        return "mtp"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs):
        return "eagle"
    if config.get("speculators_model_type"):
        raise DraftFormatError(
            f"speculators model type {config['speculators_model_type']!r} is not Eagle-3; "
            "draftadapt trains Eagle-3 heads and small draft LMs"
        )
    return "hf"


def load_eagle3(draft_dir: str | Path, target_dir: str | Path | None = None) -> Eagle3Head:
    """Read an Eagle-3 draft in either format into an :class:`Eagle3Head`.

    Missing pieces a foreign checkpoint may omit are filled from the target, never left random:
    ``embed_tokens`` (copied from the target's embeddings) and the aux layer ids (vLLM's default
    for the target depth). ``target_dir`` is required for those cases.
    """
    draft_dir = Path(draft_dir)
    config = read_hf_config(draft_dir)
    fmt = detect_format(config)
    if fmt == "hf":
        raise DraftFormatError(
            f"{draft_dir} is a plain HF model, not an Eagle-3 head; serve it with method='draft_model'"
        )
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    tfp = target_fingerprint(target_dir) if target_dir is not None else None
    _check_layer_supported(layer, draft_dir, (tfp or {}).get("max_position_embeddings"))
    sd = _read_weights(draft_dir)
    sd = {k.replace("midlayer.", "layers.0.", 1).removeprefix("model."): v for k, v in sd.items()}
    cfg = _eagle3_config(config, layer, fmt, tfp, draft_dir)
    _fill_embeddings(sd, cfg, draft_dir, target_dir)
    head = Eagle3Head(cfg)
    vt, vd = cfg.target_vocab_size, cfg.draft_vocab_size
    if "d2t" not in sd:
        sd["d2t"] = torch.zeros(vd, dtype=torch.int64)
    if "t2d" not in sd:
        t2d = torch.zeros(vt, dtype=torch.bool)
        t2d[torch.arange(vd) + sd["d2t"]] = True
        sd["t2d"] = t2d
    expected = head.state_dict()
    _check_weights(sd, expected, draft_dir)
    head.load_state_dict({k: sd[k].to(expected[k].dtype) for k in expected})
    head.embed_tokens.weight.requires_grad_(not cfg.share_embeddings)
    check_vocab_map(head.d2t, head.t2d, vt, where=str(draft_dir))
    if tfp is not None:
        _check_head_fits(cfg, tfp, where=str(draft_dir))
    return head


def _eagle3_config(config: dict[str, Any], layer: dict[str, Any], fmt: str, tfp: dict[str, Any] | None,
                   draft_dir: Path) -> Eagle3Config:
    """The head's config from the draft's (``layer``: its decoder layer's), the target's fingerprint
    ``tfp`` filling the aux layers and the vocabulary a foreign config leaves out."""
    eagle_config = config.get("eagle_config") or {}
    aux = config.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        if tfp is None:
            raise DraftFormatError(
                f"{draft_dir} does not name its aux layers; pass the target so they can be set"
            )
        from draftadapt.drafts.eagle3 import default_aux_layers

        aux = default_aux_layers(tfp["num_hidden_layers"])
    hidden = layer["hidden_size"]
    nh = layer["num_attention_heads"]
    vt = layer.get("vocab_size") or (tfp or {}).get("vocab_size")
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=nh,
        num_key_value_heads=layer.get("num_key_value_heads") or nh,
        head_dim=layer.get("head_dim") or hidden // nh,
        target_hidden_size=config.get("target_hidden_size") or layer.get("target_hidden_size") or hidden,
        target_vocab_size=vt,
        draft_vocab_size=config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vt,
        aux_layer_ids=list(aux),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        # vLLM's speculators parser defaults this to True, the plain-config path to False.
        norm_before_residual=bool(config.get("norm_before_residual", fmt == "speculators")),
        # as vLLM reads them (llama_eagle3.py): norm_before_fc from eagle_config first, then the config
        norm_before_fc=bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        target_model_type=(tfp or {}).get("model_type") or "llama",
        target_num_layers=(tfp or {}).get("num_hidden_layers") or 0,
    )


def _fill_embeddings(sd: dict[str, torch.Tensor], cfg: Eagle3Config, draft_dir: Path,
                     target_dir: str | Path | None) -> None:
    """A head without ``embed_tokens`` shares the target's: copy them in. Sets
    ``cfg.share_embeddings``: also true for an own copy equal to the target's."""
    if "embed_tokens.weight" not in sd:
        if target_dir is None:
            raise DraftFormatError(
                f"{draft_dir} has no embed_tokens (it shares the target's); pass the target so "
                "they can be copied in"
            )
        sd["embed_tokens.weight"] = _target_embeddings(target_dir)
        cfg.share_embeddings = True
    else:
        # an own copy identical to the target's is shared by vLLM all the same
        cfg.share_embeddings = target_dir is not None and torch.equal(
            sd["embed_tokens.weight"].float(), _target_embeddings(target_dir))


def _check_weights(sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], draft_dir: Path) -> None:
    """Refuse weights that do not match the head their config builds, naming every difference."""
    problems = []
    for name, ref in expected.items():
        if name not in sd:
            problems.append(f"missing {name}")
        elif tuple(sd[name].shape) != tuple(ref.shape):
            problems.append(f"{name} has shape {tuple(sd[name].shape)}, expected {tuple(ref.shape)}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}")
    if problems:
        raise DraftFormatError(f"{draft_dir}: weights do not match its config: " + "; ".join(problems))


def _check_layer_supported(layer: dict[str, Any], draft_dir: Path, target_max: int | None) -> None:
    """Refuse a decoder layer the head cannot be, naming each difference and the speculators option
    that avoids it. Without this a speculators draft with a rescaled RoPE or a narrow sliding window
    loads, serves in vLLM as written, and trains here as a different model; the others (more layers,
    a qwen3 layer, biases) would fail later as unexpected tensors."""
    problems = []
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"{layer['num_hidden_layers']} decoder layers (draftadapt trains one; "
                        "speculators: --num-layers 1)")
    if layer.get("model_type", "llama") != "llama":
        problems.append(f"a {layer['model_type']} decoder layer (draftadapt's is llama; "
                        "speculators: --draft-arch llama)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("biases in attention or MLP (draftadapt's layer has none)")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {layer['hidden_act']!r} (draftadapt's MLP is SiLU-gated)")
    for rope in (layer.get("rope_parameters") or {}, layer.get("rope_scaling") or {}):  # transformers 5, 4
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            problems.append(f"RoPE type {rope_type!r} (draftadapt's head uses plain RoPE with rope_theta)")
            break
    window = layer.get("sliding_window")
    sliding = "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window")
    context = target_max or layer.get("max_position_embeddings")
    if sliding and window is not None and context is not None and window < context:
        problems.append(f"sliding-window attention over {window} positions, below the target's context of {context} "
                        f"(draftadapt's head attends over all of it; speculators: --sliding-window {context} or "
                        "--full-attention-indices 0)")
    if problems:
        raise DraftFormatError(f"{draft_dir}: its Eagle-3 head is not one draftadapt can train: " + "; ".join(problems))


def _target_embeddings(target_dir: str | Path) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.endswith("embed_tokens.weight"):
                    return st.get_tensor(key).float()
    raise DraftFormatError(f"no embed_tokens.weight in {target_dir}/*.safetensors")


# --------------------------------------------------------------------------- fit checks

def _check_head_fits(cfg: Eagle3Config, fp: dict[str, Any], where: str) -> None:
    """Refuse a head that cannot serve this target, naming the mismatch and the fix."""
    if cfg.target_hidden_size != fp["hidden_size"]:
        raise DraftFormatError(
            f"{where}: the head reads target hidden size {cfg.target_hidden_size}, the target has "
            f"{fp['hidden_size']}; initialise a head for this target with `draftadapt draft init`"
        )
    if cfg.target_vocab_size != fp["vocab_size"]:
        raise DraftFormatError(
            f"{where}: draft built for vocab {cfg.target_vocab_size}, the target has "
            f"{fp['vocab_size']}; re-export the draft for this target"
        )
    bad = [k for k in cfg.aux_layer_ids if not 0 <= k <= fp["num_hidden_layers"]]
    if bad or len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids):
        raise DraftFormatError(
            f"{where}: aux layer ids {list(cfg.aux_layer_ids)} do not fit a "
            f"{fp['num_hidden_layers']}-layer target (need distinct ids in 0..{fp['num_hidden_layers']})"
        )
    check_max_positions(cfg.max_position_embeddings, fp["max_position_embeddings"], where)


def check_max_positions(draft_max: int, target_max: int | None, where: str) -> None:
    if target_max is not None and draft_max < target_max:
        raise DraftFormatError(
            f"{where}: draft max_position_embeddings {draft_max} is below the target's {target_max}; "
            "vLLM would clamp RoPE and acceptance collapses past that position. Export with "
            f"max_position_embeddings >= {target_max}"
        )


# What identifies the target a draft was built for (recorded at export, checked at engine start).
IDENTITY_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "tokenizer_sha256")


def identity_mismatch(recorded: dict[str, Any], fingerprint: dict[str, Any], require: bool = False) -> list[str]:
    """The identity fields on which a draft's recorded target differs from ``fingerprint`` (a
    target's :func:`target_fingerprint`). A field the draft does not record is skipped, unless
    ``require``."""
    return [k for k in IDENTITY_FIELDS
            if (require or recorded.get(k) is not None) and recorded.get(k) != fingerprint.get(k)]


def check_identity(recorded: Any, fingerprint: dict[str, Any], what: str, fix: str, require: bool = False,
                   error: type[Exception] = DraftFormatError) -> None:
    """The one draft/target identity check: raise ``error`` when the target a draft manifest
    records (``recorded``, its "target") differs from ``fingerprint`` (:func:`target_fingerprint`
    of the target at hand) on an identity field, naming ``what`` ("DIR was exported"), each field
    that differs, and ``fix``. ``require``: a field the manifest lacks differs too (a swap into a
    running engine); else it is skipped (a foreign draft records none)."""
    recorded = recorded if isinstance(recorded, dict) else {}
    differ = identity_mismatch(recorded, fingerprint, require)
    if differ:
        detail = ", ".join(f"{k}: draft {recorded.get(k)!r} vs target {fingerprint.get(k)!r}" for k in differ)
        raise error(f"{what} for another target ({detail}); {fix}")


def check_draft_for_target(draft_dir: str | Path, target_dir: str | Path) -> dict[str, Any]:
    """Everything about a draft dir that must hold before an engine is started with it.

    Returns the draft's draftadapt.json (or a minimal one for foreign drafts).
    """
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    config = read_hf_config(draft_dir)
    fmt = detect_format(config)
    meta_path = draft_dir / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"format": fmt}
    tfp = target_fingerprint(target_dir)
    check_identity(meta.get("target"), tfp, f"{draft_dir} was exported",
                   f"initialise a draft for {target_dir} with `draftadapt draft init --target {target_dir}` or re-export it")
    weights = draft_dir / WEIGHTS_FILE
    if meta.get("sha256") and weights.is_file() and file_sha256(weights) != meta["sha256"]:
        raise DraftFormatError(
            f"{weights} does not match the sha256 in {meta_path}; the file is truncated or was "
            "changed after export. Re-export the draft"
        )
    if fmt == "hf":
        if config.get("vocab_size") != tfp["vocab_size"]:
            raise DraftFormatError(
                f"draft LM {draft_dir} has vocab {config.get('vocab_size')}, the target "
                f"{tfp['vocab_size']}; a draft_model must share the target's tokenizer"
            )
        check_max_positions(config.get("max_position_embeddings", 0), tfp["max_position_embeddings"], str(draft_dir))
        tok = tokenizer_digest(draft_dir) if (draft_dir / "tokenizer_config.json").is_file() else None
        if tok is not None and tok != tfp["tokenizer_sha256"]:
            raise DraftFormatError(
                f"draft LM {draft_dir} has a different tokenizer than {target_dir}; a draft_model "
                "must share the target's tokenizer"
            )
    elif fmt == "mtp":
        load_mtp(draft_dir, target_dir)  # the target's MTP layers, shape for shape
    else:
        load_eagle3(draft_dir, target_dir)  # full shape/vocab/aux/positions check
    return meta


# --------------------------------------------------------------------------- MTP layers

def export_mtp(head, out: str | Path, target_dir: str | Path, meta: dict[str, Any] | None = None,
               dtype: str | torch.dtype | None = None) -> Path:
    """Write an MTP head's layers (only ``model.mtp_layers.*``: embed_tokens and lm_head are the
    target's) as a draft directory; the engine serves the target with ``method="mtp"`` and loads
    these tensors into its drafter (docs/design.md, "MTP")."""
    from draftadapt.drafts.mtp import MTPConfig

    out = Path(out)
    fp = target_fingerprint(target_dir)
    want = MTPConfig.from_hf(read_hf_config(target_dir))
    if (head.cfg.hidden_size, head.cfg.vocab_size, head.cfg.num_layers) != (want.hidden_size, want.vocab_size, want.num_layers):
        raise DraftFormatError(
            f"export to {out}: the MTP head (hidden {head.cfg.hidden_size}, vocab {head.cfg.vocab_size}, "
            f"{head.cfg.num_layers} layers) does not fit {target_dir} (hidden {want.hidden_size}, vocab "
            f"{want.vocab_size}, {want.num_layers} layers); start from `draftadapt draft init --method mtp "
            f"--target {target_dir}`"
        )
    sd = head.mtp_state_dict(FLOAT_DTYPES[model_dtype(target_dir) if dtype is None else dtype_name(dtype)])
    config = {"draftadapt_draft": "mtp", "architectures": ["MiMoMTPLayers"], "mtp_config": head.cfg.to_dict(),
              "shared_modules": ["embed_tokens", "lm_head"]}
    info = {"method": "mtp", "format": "mtp", "head_config": head.cfg.to_dict(), "target": fp,
            "shared_modules": ["embed_tokens", "lm_head"], **(meta or {})}
    return _write_draft_dir(out, config, sd, info)


def load_mtp(draft_dir: str | Path, target_dir: str | Path):
    """An MTP draft directory (or, ``draft_dir`` the target itself, its own layers) as an MTP
    head, with the target's embed_tokens and lm_head."""
    from draftadapt.drafts.mtp import head_from_target

    draft_dir = Path(draft_dir)
    head = head_from_target(target_dir)
    if draft_dir.resolve() != Path(target_dir).resolve():
        config = read_hf_config(draft_dir)
        if detect_format(config) != "mtp":
            raise DraftFormatError(f"{draft_dir} is not an MTP draft (its config.json has no "
                                   "draftadapt_draft: mtp); export one with MTPMethod.export")
        try:
            head.load_mtp_state_dict(_read_weights(draft_dir), str(draft_dir))
        except ValueError as exc:
            raise DraftFormatError(str(exc)) from None
    return head


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
