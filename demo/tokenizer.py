"""Byte-level BPE tokenizer for the demo model, saved so `AutoTokenizer.from_pretrained(dir)` works."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .recipe import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, ROLE_TOKENS

SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN) + ROLE_TOKENS


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """BPE over bytes (no unknown tokens), special tokens first so their ids are 0..4.

    Encoding a plain string prepends <s> (like Llama), which is also how every training document starts.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                      special_tokens=[(BOS_TOKEN, bos_id)]),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS), chat_template=CHAT_TEMPLATE,
        model_max_length=512, clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json, with the chat template inside tokenizer_config.json."""
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") != CHAT_TEMPLATE:
        raise RuntimeError("transformers did not write chat_template into tokenizer_config.json")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_documents(tokenizer: PreTrainedTokenizerFast, docs: list[str] | tuple[str, ...]) -> list[int]:
    """One flat stream: <s> doc </s> <s> doc </s> ... (what the model is trained and evaluated on)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(docs), add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return ids
