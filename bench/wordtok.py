"""A real tokenizer for the benchmark prompts, for precise routing: one token per prompt word.

Rules:
- ``bench.prompts`` builds prompts from three-letter words each followed by a space, four
  characters a token, which is how the simulated engines count tokens without a tokenizer. This
  tokenizer (the ``tokenizers`` library's ``WordLevel`` model, nothing downloaded) makes each such
  word one token, so a simulated engine given it counts the same tokens, fills the same KV blocks
  and takes the same time as one without: a run in precise mode (engines publishing KV events,
  the proxy tokenizing) is comparable with the approximate runs of the same workload.
- Anything else (the chat template's role markers, punctuation) is ``[UNK]``, one token per
  character, the same in the engines and the proxy. No token spans more than one word and its
  space, as in the byte-level tokenizers of real models, so the proxy can encode a long prompt
  in spans cut between words (``proxy.fleet.tokenizer``) as it would for them.
- Saved as a model directory the way Hugging Face saves one: ``tokenizer.json``,
  ``tokenizer_config.json`` (bos and eos), ``chat_template.jinja``.
"""

from __future__ import annotations

import json
import string
from itertools import product
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

SPECIAL = ["[UNK]", "<s>", "</s>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_word_tokenizer(root: Path) -> Path:
    """Write the tokenizer under ``root`` (created) and return it."""
    root.mkdir(parents=True, exist_ok=True)
    words = ["".join(p) + " " for p in product(string.ascii_lowercase, repeat=3)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # A word with its space is one piece; any other character is a piece of its own.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[a-z]{3} |[\\s\\S]"), behavior="isolated")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]"}))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root
