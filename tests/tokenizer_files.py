"""A small real tokenizer for tests of precise routing: a byte-level BPE trained here in
milliseconds with the ``tokenizers`` library (nothing downloaded), saved as a model directory the
way Hugging Face saves one: ``tokenizer.json``, ``tokenizer_config.json`` (bos and eos tokens) and
``chat_template.jinja`` (the template of the contract tests' tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the router learns what each engine holds in its prefix cache",
    "a shared system prompt and a long document are the prefix of many requests",
    "engines publish stored and removed blocks; the proxy keeps an exact index",
] * 20


def make_tokenizer_dir(root: Path) -> Path:
    """Write the tokenizer files under ``root`` (created) and return it."""
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root
