"""Caption tokenizers: the checkpoint's own from a local directory, or a small debug one built here.

Nothing downloads. The debug tokenizer is a WordPiece over a fixed vocabulary (RoBERTa's special-token ids
<s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4, then single characters, then common caption words), so it is identical on
every rank and every machine without training or shared files; unknown words fall back to characters.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ds_core.errors import ConfigError, InputNotFound

from .configs import DEBUG_VOCAB_SIZE, ModelArgs

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]

# Common caption words (COCO-like); the vocabulary is padded with "[unusedN]" up to DEBUG_VOCAB_SIZE.
_WORDS = """
a an the of on in with and at to from by for near next under over behind front top side its his her their
is are was sitting standing walking running riding holding looking playing lying eating flying parked
man woman person people men women boy girl child children player group couple crowd
dog dogs cat cats horse bird birds cow cows sheep elephant giraffe zebra bear animal animals
car cars truck bus train plane boat bike bicycle motorcycle street road city building house room kitchen table
chair bed couch window door wall floor field grass tree trees water beach sky snow mountain hill park sign
food pizza plate sandwich cake bowl cup glass bottle phone laptop computer tv book umbrella bag ball frisbee
kite surfboard skateboard skis tennis racket baseball bat game
red blue green yellow white black brown gray grey orange pink purple dark light bright colorful striped
big small large little tall short long old young many two three four some several one other
circle circles square squares triangle triangles stripe stripes dot dots shape shapes pattern background
image photo picture view close up down out into there this that it very has have while
""".split()


def _debug_vocab(size: int = DEBUG_VOCAB_SIZE) -> dict[str, int]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    seen = set(tokens)
    for w in _WORDS:
        if w not in seen:
            tokens.append(w)
            seen.add(w)
    if len(tokens) > size:
        raise ValueError(f"debug vocabulary has {len(tokens)} tokens > vocab size {size}")
    tokens += [f"[unused{i}]" for i in range(size - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens)}


def debug_tokenizer(model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """The debug preset's tokenizer: lower-cased WordPiece over a fixed vocabulary, <s> text </s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = _debug_vocab()
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>", model_max_length=model_max_length)


def load_tokenizer(args: ModelArgs, model_max_length: int = 128) -> PreTrainedTokenizerBase:
    """--tokenizer_name_or_path, else --model_name_or_path, else (debug preset only) the built-in one."""
    path = args.tokenizer_name_or_path or args.model_name_or_path
    if path:
        if not Path(path).is_dir():
            raise InputNotFound(f"tokenizer directory {path} does not exist (tokenizers load from a local "
                                    f"directory only; nothing is downloaded)")
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:  # TypeError: transformers 4.55's slow tokenizer without files
            raise InputNotFound(f"no tokenizer files in {path} ({e}); pass --tokenizer_name_or_path to a "
                                    f"directory holding the model's tokenizer (e.g. roberta-large's)") from e
    if args.preset != "debug":
        raise ConfigError(f"preset {args.preset!r} needs the model's tokenizer: pass --model_name_or_path or "
                         f"--tokenizer_name_or_path (a local directory); only the debug preset builds its own")
    return debug_tokenizer(model_max_length)


def expected_padded_length(tokenizer, captions: Sequence[str], micro_batch: int, max_length: int,
                           pad_to_max: bool = False, sample: int = 2048) -> int:
    """Caption tokens the model actually runs per sample: max_length when padding to it, else the mean over
    consecutive micro batches of their longest caption (batches pad to their longest), from the first `sample`
    captions. Used for FLOPs per sample; never for shapes."""
    if pad_to_max or not len(captions):
        return int(max_length)
    caps = [str(c) for c in captions[:sample]]
    lengths = [len(ids) for ids in tokenizer(caps, truncation=True, max_length=max_length)["input_ids"]]
    b = max(1, int(micro_batch))
    longest = [max(lengths[i:i + b]) for i in range(0, len(lengths), b)]
    return max(1, round(sum(longest) / len(longest)))
