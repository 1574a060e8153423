"""Character-level tokenizer for the toy task, built locally as a ``PreTrainedTokenizerFast``.

One token per character of ``task.ALPHABET`` after four specials (``<pad>`` 0, ``<s>`` 1,
``</s>`` 2, ``<unk>`` 3). Encoding adds ``<s>`` in front, never ``</s>``; decoding joins
characters with nothing in between. Because every token is one character,
``encode(prompt + response) == encode(prompt) + encode(response, add_special_tokens=False)``,
so prompt and response token ids can be concatenated freely (RL rollouts rely on it).

``save_pretrained`` writes ``tokenizer.json`` + ``tokenizer_config.json``, which
``AutoTokenizer.from_pretrained(dir)`` and vLLM load without this package.

The space character is stored as ``Ġ`` (U+0120, byte-level BPE's symbol for a space), with a
normalizer and a decoder that map it to and from " ". transformers 5 ignores a directory's own
tokenizer class for some model types and loads its registered one instead: for ``model_type``
``qwen2`` (the MTP toy, whose config vLLM's MiMo path needs) that is ``Qwen2Tokenizer``, a
byte-level BPE that reads the same vocabulary but pre-tokenizes bytes, so a space becomes ``Ġ``.
With a vocabulary that says " ", that loader dropped every space: the MTP toy solved 0.33 of
its held-out problems in the build and 0.03-0.09 as loaded by vLLM or transformers, and every
MTP run before this had trained on the mangled prompts (docs/design.md, "MTP"). With ``Ġ`` both
loaders give the ids this one does, and the ids themselves are unchanged.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from draftadapt.toy.task import ALPHABET

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
SPACE_SYMBOL = "\u0120"  # "Ġ": how byte-level BPE writes a space (see the module docstring)


def vocab() -> dict[str, int]:
    """Token -> id: the specials, then each character of the alphabet in order (a space as ``Ġ``)."""
    symbols = list(SPECIALS) + [SPACE_SYMBOL if c == " " else c for c in ALPHABET]
    return {s: i for i, s in enumerate(symbols)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    tok.normalizer = normalizers.Replace(" ", SPACE_SYMBOL)
    # Every character becomes its own pre-token, newline and space included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_SYMBOL, " "), decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # batched generation pads prompts on the left
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
