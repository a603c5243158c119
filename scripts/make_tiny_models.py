"""Generate the tiny test models: a random-weight Llama target and a smaller draft model that share
one locally trained tokenizer. Nothing is downloaded.

Run it with an interpreter that has ``torch``, ``transformers`` and ``tokenizers`` (the vLLM
environment has them)::

    .venv-vllm/bin/python scripts/make_tiny_models.py [--root .cache/kvproxy-models]

It prints a JSON object with the two model directories. Output is deterministic and cached under
``ROOT/VERSION``; bump VERSION whenever what is generated changes.

The target's extra layers are initialised with a small output projection, so the target mostly
agrees with the draft (its first layers are the draft's own): speculative decoding then accepts a
useful share of draft tokens, and acceptance metrics move in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VERSION = "tiny-llama-v1"
VOCAB_SIZE = 2048
HIDDEN = 128
HEADS = 2  # head_dim 64: supported by every CPU and GPU attention backend
KV_HEADS = 1
INTERMEDIATE = 256
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
MAX_POSITIONS = 4096
EXTRA_LAYER_SCALE = 0.05
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = [
    "the",
    "a",
    "an",
    "cache",
    "engine",
    "token",
    "prefix",
    "block",
    "route",
    "proxy",
    "model",
    "draft",
    "target",
    "request",
    "stream",
    "queue",
    "load",
    "shed",
    "critical",
    "standard",
    "fleet",
    "server",
    "client",
    "answer",
    "question",
    "system",
    "user",
    "assistant",
    "write",
    "read",
    "fast",
    "slow",
    "memory",
    "page",
    "hash",
    "chain",
    "key",
    "value",
    "priority",
    "tenant",
    "metric",
    "scrape",
    "health",
    "ready",
    "drain",
    "warm",
    "start",
    "stop",
    "time",
    "step",
    "batch",
    "decode",
    "prefill",
    "accept",
    "reject",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "and",
    "or",
    "not",
    "with",
    "from",
    "into",
    "over",
    "under",
    "is",
    "are",
    "was",
    "be",
    "have",
    "has",
    "do",
    "does",
    "can",
    "will",
    "should",
    "may",
    "must",
    "this",
    "that",
    "these",
    "those",
    "it",
    "they",
    "we",
    "you",
    "he",
    "she",
    "of",
    "to",
    "in",
    "on",
    "at",
    "by",
    "for",
    "as",
    "about",
    "hello",
    "world",
    "story",
    "once",
    "upon",
    "there",
    "lived",
]


def corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 30))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(sentence + " " + str(rng.randint(0, 9999)))
    return out


def train_tokenizer(out_dir: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(20000, seed=1), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _config(layers: int, vocab: int, bos: int, eos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_models(tok_dir: Path, target_dir: Path, draft_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(tokenizer)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(0)
    draft = LlamaForCausalLM(_config(DRAFT_LAYERS, vocab, *ids))
    target = LlamaForCausalLM(_config(TARGET_LAYERS, vocab, *ids))
    # The target's first layers, embeddings, norm and head are the draft's own; the extra layers
    # only nudge the residual stream, so the two agree often but not always.
    state = target.state_dict()
    state.update(draft.state_dict())
    for layer in range(DRAFT_LAYERS, TARGET_LAYERS):
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            state[f"model.layers.{layer}.{proj}.weight"].mul_(EXTRA_LAYER_SCALE)
    target.load_state_dict(state)
    for model, out in ((target, target_dir), (draft, draft_dir)):
        model.generation_config.do_sample = False
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)


def ensure_models(root: Path) -> dict[str, str]:
    final = root / VERSION
    paths = {"target": str(final / "target"), "draft": str(final / "draft"), "version": VERSION}
    if (final / "DONE").exists():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=root))
    try:
        train_tokenizer(work / "tokenizer")
        build_models(work / "tokenizer", work / "target", work / "draft")
        shutil.rmtree(work / "tokenizer")
        (work / "DONE").write_text(VERSION + "\n", encoding="utf-8")
        try:
            os.rename(work, final)
        except OSError:
            # A concurrent generator finished first; its output is identical.
            if not (final / "DONE").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_root = Path(__file__).resolve().parent.parent / ".cache" / "kvproxy-models"
    parser.add_argument("--root", type=Path, default=default_root)
    args = parser.parse_args()
    print(json.dumps(ensure_models(args.root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
