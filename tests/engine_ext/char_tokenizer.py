"""A character-level tokenizer (one token per letter) so text-level behaviour can be tested on tiny models."""

import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


def add_char_tokenizer(model_dir: str) -> str:
    vocab = {c: i for i, c in enumerate(ALPHABET)} | {"<unk>": len(ALPHABET), "</s>": len(ALPHABET) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # one character per token, no separators: text index == token index
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(model_dir)
    return model_dir
