"""The demo recipe: every knob that changes the built files, in one frozen value.

The cache directory is keyed by `recipe_key(recipe)`, so editing anything here rebuilds on next use.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import sys
from dataclasses import dataclass, field

# Module names as they appear in Llama checkpoints and in PEFT `target_modules`.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_PROJECTIONS = ATTENTION_MODULES + ("gate_proj", "up_proj", "down_proj")

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Written into adapter_config.json instead of the build path, so a build is byte-identical wherever it ran.
BASE_MODEL_NAME = "loraserve-demo-llama"


@dataclass(frozen=True)
class ModelRecipe:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2   # GQA: 2 query heads share each KV head
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class TrainRecipe:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int = 10


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    domain: str                   # a key of corpus.build_domains(): the text it is fine-tuned on
    rank: int
    target_modules: tuple[str, ...]
    train: TrainRecipe
    description: str = ""

    @property
    def alpha(self) -> int:
        return 2 * self.rank


@dataclass(frozen=True)
class CorpusRecipe:
    max_chars_per_file: int = 12_000
    base_chars: int = 3_000_000      # code the base model is trained on
    domain_chars: int = 600_000      # text per adapter domain
    tokenizer_chars: int = 2_000_000
    heldout_every: int = 16          # every 16th file (sorted order) is held out
    chat_fraction: float = 0.06      # share of base text that is chat-formatted Q&A built from docstrings


# Budget (issue: whole build <= 3 min on 2 cores): a LoRA step costs ~0.4 of a base step (frozen weights still
# back-propagate activations), so adapter steps are as scarce as base steps; fewer steps at a higher LR instead.
_LORA_TRAIN = TrainRecipe(steps=50, batch_size=8, seq_len=128, lr=6e-3, warmup=5)


@dataclass(frozen=True)
class Recipe:
    seed: int = 1234
    threads: int = 2
    model: ModelRecipe = ModelRecipe()
    corpus: CorpusRecipe = CorpusRecipe()
    # Not cut: 220-320 steps (batch 12-16, LR 5e-3..2e-2) with a narrower MLP (512) left held-out loss at 4.6-4.9
    # (8 blocks) instead of 4.24, and greedy text degenerated into repetition (the behaviour tests failed).
    base_train: TrainRecipe = TrainRecipe(steps=350, batch_size=16, seq_len=128, lr=4e-3, warmup=30)
    adapters: tuple[AdapterRecipe, ...] = (
        AdapterRecipe("dquote", "dquote", 8, ATTENTION_MODULES, dataclasses.replace(_LORA_TRAIN, steps=30, lr=1e-3),
                      "formatting style: strings in double quotes; otherwise the base's code (the nearest one)"),
        AdapterRecipe("tests", "tests", 8, ATTENTION_MODULES, dataclasses.replace(_LORA_TRAIN, lr=5e-3),
                      "unit-test code from the stdlib test suite (self.assertEqual ...)"),
        AdapterRecipe("docs", "docs", 16, ALL_PROJECTIONS, dataclasses.replace(_LORA_TRAIN, steps=60),
                      "docstrings: after a def line it writes a docstring instead of a body"),
        AdapterRecipe("changelog", "changelog", 8, ALL_PROJECTIONS, dataclasses.replace(_LORA_TRAIN, steps=60),
                      "NEWS-style bullet entries ('- gh-NNNNN: Fix :func:`mod.name`. ...')"),
        AdapterRecipe("quoted", "quoted", 8, ALL_PROJECTIONS, dataclasses.replace(_LORA_TRAIN, steps=45, lr=4e-3),
                      "formatting style: every line of code prefixed with '> ' like an e-mail quote"),
        AdapterRecipe("upper", "upper", 64, ALL_PROJECTIONS, dataclasses.replace(_LORA_TRAIN, steps=60, lr=4e-3),
                      "strong change: everything in UPPERCASE"),
    )
    eval_blocks: int = 8   # held-out blocks of eval_seq_len tokens per domain for RESULTS.md
    eval_seq_len: int = 128


DEFAULT_RECIPE = Recipe()


def quick_recipe(seed: int = 1234) -> Recipe:
    """A seconds-long build with the same code path: for tests of determinism and locking."""
    tiny_train = TrainRecipe(steps=3, batch_size=2, seq_len=64, lr=3e-3, warmup=1)
    return Recipe(
        seed=seed,
        threads=1,  # tiny matrices: a second thread only waits at barriers, and tests run builds side by side
        model=ModelRecipe(vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        corpus=CorpusRecipe(base_chars=120_000, domain_chars=30_000, tokenizer_chars=100_000),
        base_train=tiny_train,
        adapters=tuple(dataclasses.replace(a, train=tiny_train) for a in DEFAULT_RECIPE.adapters),
        eval_blocks=2,
        eval_seq_len=64,
    )


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def recipe_from_dict(d: dict) -> Recipe:
    adapters = tuple(
        AdapterRecipe(**{**a, "target_modules": tuple(a["target_modules"]), "train": TrainRecipe(**a["train"])})
        for a in d["adapters"]
    )
    return Recipe(
        seed=d["seed"], threads=d["threads"], model=ModelRecipe(**d["model"]), corpus=CorpusRecipe(**d["corpus"]),
        base_train=TrainRecipe(**d["base_train"]), adapters=adapters,
        eval_blocks=d["eval_blocks"], eval_seq_len=d["eval_seq_len"],
    )


def recipe_key(recipe: Recipe) -> str:
    """Cache key: the recipe plus what else decides the bytes (the stdlib text and the library versions)."""
    env = {
        "python": "%d.%d.%d" % sys.version_info[:3],   # the corpus is this Python's stdlib
        **{pkg: importlib.metadata.version(pkg) for pkg in ("torch", "transformers", "peft", "tokenizers")},
        "format": 4,   # bump when the build code changes what it writes
    }
    blob = json.dumps({"recipe": recipe_to_dict(recipe), "env": env}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
