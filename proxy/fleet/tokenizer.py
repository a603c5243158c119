"""A pool's tokenizer: the prompt's token ids as the engine computes them, for precise routing.

Rules:
- Loaded once at start-up from ``pools[].tokenizer``: a ``tokenizer.json`` (the ``tokenizers``
  library), or a model directory holding one; the chat template comes from
  ``chat_template.jinja`` beside it, else ``chat_template`` in ``tokenizer_config.json`` (a named
  list picks ``default``), and the ``bos_token`` / ``eos_token`` from there too. A missing or
  unreadable file is a ``ConfigError`` naming the pool's field.
- Chat requests are rendered as vLLM 0.32 renders them with a Hugging Face template: Jinja in a
  sandbox with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, the messages, tools and
  template variables built as vLLM builds them (``chat_render``), in the template's content
  format (``openai``, a list of text parts, when the template loops over a message's content;
  else ``string``), then encoded without special tokens (vLLM's default for chat). Completions
  are encoded with special tokens; token-id prompts are used as they are.
- A chat template that does not compile, or a template file that is not UTF-8, is a
  ``ConfigError`` naming the pool's field, like a missing tokenizer file.
- Work is bounded: at most ``max_chars`` characters are encoded; a longer text is cut and its
  last ``CUT_MARGIN`` tokens dropped (a cut can change only the tokens next to it).
- A conversation resends its history, and a template puts special tokens between messages, so
  a text encoded without special tokens added is split at the tokenizer's own added tokens and
  each piece between them is encoded once and kept (``SegmentCache``: an LRU bounded in
  characters, keyed by the piece itself). That is the library's own first step (added tokens
  are matched before normalizing and pre-tokenizing, each piece between them is encoded alone),
  so the ids are the same; it is used only where that holds: every added token matched on the
  raw text strips nothing around it, and a probe of the loaded tokenizer gives the same ids both
  ways (a pre-tokenizer that treats a text's start specially, such as a Metaspace prefix, fails
  the probe). Otherwise every text is encoded whole.
- A long piece (``2 * SPAN_CHARS`` or more: a document, a resent history in one message) is
  encoded in spans of about ``SPAN_CHARS``, each kept the same way, so a request that shares a
  long text with an earlier one encodes only what is new. A span ends only at a word gap (an
  ASCII letter or digit, one space, an ASCII letter), before the space (byte-level BPE and
  Metaspace tokenizers put it in front of the next word) or, where the probe below finds that
  one wrong, after it (a tokenizer whose words carry the space behind them).
  Spans are cut at fixed distances from the piece's start, so text is shared when it begins a
  piece (a message, a system prompt, a document placed first). Used only where the tokenizer
  has no added token that a piece would not see (every added token is matched on the raw text
  and strips nothing) and a probe with every word gap of a varied text cut gives the same ids;
  and checked while serving: the first piece with spans to encode and every ``AUDIT_EVERY``-th
  after it are encoded whole as well, and one difference turns spans off for good (one warning
  logged).
- Anything a request makes fail (a template that raises, content of the wrong type) gives
  ``None``: the request is routed without precise holdings, never refused for it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer

from proxy.core.errors import ConfigError
from proxy.fleet import chat_render

log = logging.getLogger(__name__)
CUT_MARGIN = 16
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content\b)")


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _special(config: Mapping[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


# Pieces shorter than this are encoded each time (a lookup would cost about as much).
MIN_CACHED_CHARS = 256
# A piece of twice this or more is encoded in spans of about this many characters (about 500
# tokens: an encoder call per span costs a few microseconds, the span itself a few hundred).
SPAN_CHARS = 2048
# One spanned piece in this many is encoded whole as well, to check the spans (module rules).
AUDIT_EVERY = 64
# Where a span may end: before the one space between two words.
_WORD_GAP = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")
# Cut at every word gap, these must encode as they do whole (digits, punctuation, runs of spaces
# and newlines, non-ASCII letters, a contraction next to the gaps).
_SPAN_PROBES = (
    "Hello there, world! The 3 engines' caches  hold 1234 blocks;\nnew text: naive cafe x y z.",
    "it's 2048 tokens a span and 17 spans  in all\n\n  of text x1 y2 z3 don't cut here",
    "na\u00efve caf\u00e9 r\u00e9sum\u00e9 a b c A B C 9 d\te f\r\ng h.I J",
)
_PROBES = ("{a}Hello there,  world!\n{b} x{a}\n\n  y {b}{a}", "{b}  {a}z", "a{a}b{b}c")


class SegmentCache:
    """Token ids of text pieces, most recently used kept, at most ``max_chars`` characters of
    keys in all. Thread-safe: prompts are encoded on a small pool."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, piece: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
            return ids

    def put(self, piece: str, ids: list[int]) -> None:
        if len(piece) > self.max_chars:
            return
        with self._lock:
            if piece in self._ids:
                return
            self._ids[piece] = ids
            self.chars += len(piece)
            while self.chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self.chars -= len(old)

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()
            self.chars = 0


def _splitter(tokenizer: Tokenizer) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """The added tokens matched on the raw text, as one pattern (longest first, as the library
    matches them) and their ids; None when one of them strips around itself or there is none."""
    raw = {i: t for i, t in tokenizer.get_added_tokens_decoder().items() if not t.normalized}
    if not raw or any(t.lstrip or t.rstrip or t.single_word for t in raw.values()):
        return None
    ids = {t.content: i for i, t in raw.items()}
    pattern = "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
    return re.compile(f"({pattern})"), ids


class PromptTokenizer:
    """Token ids of OpenAI requests, as the pool's engines compute them."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, *, bos_token: str = "",
                 eos_token: str = "", max_chars: int = 262_144,
                 cache_chars: int = 8 * 1024 * 1024) -> None:
        self._tok = tokenizer
        env = _environment()
        self._template = env.from_string(template) if template else None
        # The variables the template reads: the request's chat_template_kwargs pass only these.
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template))
                                    if template else ())
        self._continues = bool(template and "content" in template)
        self._openai_format = bool(template and _CONTENT_LOOP.search(template))
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        self.max_chars = max_chars
        self.cache = SegmentCache(cache_chars)
        self._split = _splitter(tokenizer)
        if self._split is not None and not self._probe_agrees():
            self._split = None
        whole_tokens = self._split is not None or not tokenizer.get_added_tokens_decoder()
        # Which side of a word gap's space a span ends on: before it where words carry their
        # leading space (byte-level BPE, Metaspace), after it where they carry the space behind.
        self._after_space = False
        self._spans = whole_tokens and self._spans_agree()
        if whole_tokens and not self._spans:
            self._after_space = True
            self._spans = self._spans_agree()
        self._spanned_pieces = 0

    @property
    def vocab_size(self) -> int:
        """Token ids below this are in the vocabulary (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def segmented(self) -> bool:
        """Whether texts are encoded piece by piece between added tokens (module rules)."""
        return self._split is not None

    @property
    def spans(self) -> bool:
        """Whether long pieces are encoded in spans cut at word gaps (module rules)."""
        return self._spans

    def _whole(self, text: str, special: bool) -> list[int]:
        # The batch form skips the character offsets ``encode`` computes and nothing here reads.
        ids: list[int] = self._tok.encode_batch_fast([text], add_special_tokens=special)[0].ids
        return ids

    def _probe_agrees(self) -> bool:
        assert self._split is not None
        tokens = sorted(self._split[1])
        a, b = tokens[0], tokens[-1]
        probes = [p.format(a=a, b=b) for p in _PROBES]
        return all(self._segmented(p, cache=False) == self._whole(p, False) for p in probes)

    def _spans_agree(self) -> bool:
        for probe in _SPAN_PROBES:
            whole = self._whole(probe, False)
            for gap in _WORD_GAP.finditer(probe):
                cut = gap.end() if self._after_space else gap.start()
                if self._whole(probe[:cut], False) + self._whole(probe[cut:], False) != whole:
                    return False
        return True

    def _segmented(self, text: str, *, cache: bool = True) -> list[int]:
        if self._split is None:
            return self._piece(text, cache)
        pattern, token_ids = self._split
        ids: list[int] = []
        for n, piece in enumerate(pattern.split(text)):
            if n % 2:  # the captured added tokens sit at the odd places
                ids.append(token_ids[piece])
            elif piece:
                ids += self._piece(piece, cache)
        return ids

    def _piece(self, piece: str, cache: bool) -> list[int]:
        if not cache or len(piece) < MIN_CACHED_CHARS:
            return self._whole(piece, False)
        if self._spans and len(piece) >= 2 * SPAN_CHARS:
            return self._spanned(piece)
        return self._kept(piece)

    def _kept(self, piece: str) -> list[int]:
        found = self.cache.get(piece)
        if found is None:
            found = self._whole(piece, False)
            self.cache.put(piece, found)
        return found

    def _spanned(self, piece: str) -> list[int]:
        """``piece`` encoded span by span, each kept (the last one too: a history is resent
        whole; shared spans are used again before the cache's least recent end reaches them).
        The spans not kept yet are encoded in one call."""
        spans: list[str] = []
        start, end = 0, len(piece)
        while end - start >= 2 * SPAN_CHARS:
            gap = _WORD_GAP.search(piece, start + SPAN_CHARS)
            if gap is None:
                break
            cut = gap.end() if self._after_space else gap.start()
            spans.append(piece[start:cut])
            start = cut
        spans.append(piece[start:])
        found = [self.cache.get(span) for span in spans]
        missing = [n for n, kept in enumerate(found) if kept is None]
        if missing:
            encoded = self._tok.encode_batch_fast([spans[n] for n in missing],
                                                  add_special_tokens=False)
            for n, encoding in zip(missing, encoded, strict=True):
                found[n] = encoding.ids
                self.cache.put(spans[n], encoding.ids)
        out: list[int] = []
        for ids in found:
            out += ids or ()
        if not missing:
            return out
        # Checked only where spans were encoded: the check then costs a fraction of the
        # encoding a text pays anyway, never a whole encoding where every span was kept.
        self._spanned_pieces += 1
        if self._spanned_pieces % AUDIT_EVERY == 1:
            whole = self._whole(piece, False)
            if whole != out:
                self._spans = False
                log.warning("prompt spans encode differently from the whole text: spans off "
                            "for this tokenizer")
                return whole
        return out

    def encode(self, text: str, *, special: bool) -> list[int]:
        cut = len(text) > self.max_chars
        text = text[: self.max_chars]
        ids = (self._segmented(text) if (self._split is not None or self._spans) and not special
               else self._whole(text, special))
        return ids[:-CUT_MARGIN] if cut else ids

    def request_ids(self, chat: bool, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids for a chat or completions body; None when not computable."""
        try:
            return self._chat(body) if chat else self._completion(body)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            log.debug("prompt not tokenized: %s", type(exc).__name__)
            return None

    def _completion(self, body: Mapping[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        special = body.get("add_special_tokens", True)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # a batch goes where its first prompt goes
        if isinstance(prompt, str):
            return self.encode(prompt, special=special is not False)
        if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
            return list(prompt)
        return None

    def _chat(self, body: Mapping[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        conversation = [chat_render.message(m, self._openai_format) for m in messages]
        kwargs = chat_render.template_kwargs(body, self._variables)
        final = None
        if body.get("continue_final_message"):
            if not self._continues:
                raise ValueError("the template never reads a message's content")
            final = chat_render.mark_final(conversation)
        tools = body.get("tools")
        text = self._template.render(
            messages=conversation,
            tools=[chat_render.tool(t) for t in tools] if isinstance(tools, list) else None,
            **(self._specials | kwargs))
        if final is not None:
            text = chat_render.continue_text(text, final)
        return self.encode(text, special=body.get("add_special_tokens") is True)


def load_tokenizer(path: str, field: str) -> PromptTokenizer:
    """The tokenizer at ``path`` (see the module rules); ``field`` names the setting in errors."""
    given = Path(path)
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        raise ConfigError(field, f"no tokenizer file at {path} (want tokenizer.json or its "
                                 "directory)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own untyped errors
        raise ConfigError(field, f"{file} is not a tokenizer.json ({type(exc).__name__})") from None
    config: dict[str, Any] = {}
    cfg_file = file.parent / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ConfigError(field, f"{cfg_file} is not readable JSON") from None
        config = loaded if isinstance(loaded, dict) else {}
    try:
        template = _template(file.parent, config)
        return PromptTokenizer(tokenizer, template, bos_token=_special(config, "bos_token"),
                               eos_token=_special(config, "eos_token"))
    except (OSError, UnicodeDecodeError):
        raise ConfigError(field, f"the chat template beside {file} is not readable UTF-8 "
                                 "text") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(field, f"the chat template beside {file} does not compile: "
                                 f"{exc.message} (line {exc.lineno})") from None


def loaded_tokenizers(pools: Sequence[Any]) -> dict[str, PromptTokenizer]:
    """Every configured pool tokenizer, by pool name (start-up: errors name the pool's field)."""
    return {pool.name: load_tokenizer(pool.tokenizer, f"pools[{i}].tokenizer")
            for i, pool in enumerate(pools) if pool.tokenizer is not None}
