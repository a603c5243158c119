"""CPU cost of precise routing per request: tokenizing the prompt and hashing its blocks.

Used by ``python -m bench.decision`` for its "with tokenization" table.

Rules:
- The tokenizer is a byte-level BPE with a 32,000-token vocabulary (the size class of the Llama 2 /
  Mistral tokenizers) trained here, in a few seconds, on generated word-like text with the
  ``tokenizers`` library (nothing downloaded), wrapped in the proxy's own ``PromptTokenizer`` with
  a chat template, so what is timed is what a request pays: the template rendered, the text
  encoded, the ids hashed as vLLM hashes them (``chain_keys``, 16-token blocks, SHA-256 over CBOR),
  and one exact-index lookup per engine.
- Prompts are chat bodies (a shared system prompt, then the user's turn) of about the requested
  number of tokens; best of several repetitions, microseconds per request.
"""

from __future__ import annotations

import random
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from proxy.core.blockhash import PLAIN_ROOT, ChainMemo
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.kvindex import Batch, ExactIndex, Stored
from proxy.fleet.tokenizer import PromptTokenizer

VOCAB = 32_000
BLOCK_SIZE = 16
MAX_BLOCKS = 8192
SYSTEM_BLOCKS = 24  # about the shared system prompt's length in blocks
DOCUMENTS = 4  # the shared documents of the RAG bodies
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


def _words(rng: random.Random, count: int) -> list[str]:
    """A lexicon of pronounceable-ish words, Zipf-weighted when sampled."""
    return ["".join(rng.choices(_LETTERS, k=rng.randint(2, 9))) for _ in range(count)]


def _text(rng: random.Random, lexicon: list[str], weights: list[float], words: int) -> str:
    picked = rng.choices(lexicon, weights=weights, k=words)
    return " ".join(w.capitalize() if i % 17 == 0 else w for i, w in enumerate(picked)) + "."


def build_tokenizer(rng: random.Random,
                    vocab: int = VOCAB) -> tuple[PromptTokenizer, list[str], list[float]]:
    lexicon = _words(rng, 20_000)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    corpus = [_text(rng, lexicon, weights, 200) for _ in range(3_000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PromptTokenizer(tok, TEMPLATE, bos_token="<s>", eos_token="</s>"), lexicon, weights


def measure(tokenizer: PromptTokenizer, bodies: list[dict[str, object]], engines: int,
            reps: int, shared: list[dict[str, object]] | None = None) -> dict[str, float]:
    """µs per request: template + encode (tokenize), block hashing (hash), index lookups; and,
    with ``shared``, encoding those bodies after each one's document was seen once."""
    indexes = [ExactIndex(capacity=100_000) for _ in range(engines)]
    # Half the engines hold the shared system prompt's blocks, so lookups walk a real prefix.
    system = PreciseHoldings(tokenizer.request_ids(True, bodies[0]) or [], PLAIN_ROOT, MAX_BLOCKS)
    held = tuple(system.keys(BLOCK_SIZE)[:SYSTEM_BLOCKS])
    for index in indexes[::2]:
        index.apply(Batch(0.0, (Stored(held, BLOCK_SIZE),), 0))
    best = {"tokenize_us": float("inf"), "hash_us": float("inf"), "lookup_us": float("inf"),
            "resent_us": float("inf"), "shared_us": float("inf") if shared else float("nan")}
    for _ in range(reps):
        # Each repetition starts with nothing kept: only the shared system prompt is seen again
        # (after the first body); the second pass is every body resent (a conversation's history).
        tokenizer.cache.clear()
        t0 = time.perf_counter()
        ids = [tokenizer.request_ids(True, body) or [] for body in bodies]
        t1 = time.perf_counter()
        for body in bodies:
            tokenizer.request_ids(True, body)
        best["resent_us"] = min(best["resent_us"], 1e6 * (time.perf_counter() - t1) / len(bodies))
        t1 = time.perf_counter()
        found = [PreciseHoldings(i, PLAIN_ROOT, MAX_BLOCKS) for i in ids]
        for f in found:
            f.keys(BLOCK_SIZE)
        t2 = time.perf_counter()
        for f in found:
            for n, index in enumerate(indexes):
                f.add(f"e{n}", index, BLOCK_SIZE, 0.0)
        t3 = time.perf_counter()
        for name, spent in (("tokenize_us", t1 - t0), ("hash_us", t2 - t1),
                            ("lookup_us", t3 - t2)):
            best[name] = min(best[name], 1e6 * spent / len(bodies))
        if shared:
            tokenizer.cache.clear()
            memo = ChainMemo()
            for body in shared[:DOCUMENTS]:  # each document seen once, with its own question
                PreciseHoldings(tokenizer.request_ids(True, body) or [], PLAIN_ROOT, MAX_BLOCKS,
                                memo=memo).keys(BLOCK_SIZE)
            t4 = time.perf_counter()
            shared_ids = []
            for body in shared[DOCUMENTS:]:
                shared_ids.append(tokenizer.request_ids(True, body) or [])
                PreciseHoldings(shared_ids[-1], PLAIN_ROOT, MAX_BLOCKS,
                                memo=memo).keys(BLOCK_SIZE)
            best["shared_us"] = min(best["shared_us"], 1e6 * (time.perf_counter() - t4)
                                    / max(1, len(shared) - DOCUMENTS))
            for name, kept in (("shared_hash_us", memo), ("shared_hash_plain_us", None)):
                best[name] = min(best.get(name, float("inf")), _hashing_us(shared_ids, kept))
    best["prompt_tokens"] = sum(len(i) for i in ids) / len(ids)
    return best


def _hashing_us(prompts: list[list[int]], memo: ChainMemo | None) -> float:
    """µs per prompt to hash ``prompts``' blocks, through ``memo`` (already holding their
    documents) or without one: the same ids both ways, so the two figures compare directly."""
    t0 = time.perf_counter()
    for ids in prompts:
        PreciseHoldings(ids, PLAIN_ROOT, MAX_BLOCKS, memo=memo).keys(BLOCK_SIZE)
    return 1e6 * (time.perf_counter() - t0) / max(1, len(prompts))


def bodies(rng: random.Random, lexicon: list[str], weights: list[float], words: int,
           count: int) -> list[dict[str, object]]:
    system = _text(rng, lexicon, weights, 400)
    return [{"messages": [{"role": "system", "content": system},
                          {"role": "user", "content": _text(rng, lexicon, weights, words)}]}
            for _ in range(count)]


def document_bodies(rng: random.Random, lexicon: list[str], weights: list[float], words: int,
                    count: int) -> list[dict[str, object]]:
    """RAG bodies: one user message, one of ``DOCUMENTS`` documents then a new question (the
    first ``DOCUMENTS`` bodies hold each document once)."""
    docs = [_text(rng, lexicon, weights, words) for _ in range(DOCUMENTS)]
    return [{"messages": [{"role": "user", "content": docs[n % DOCUMENTS] + "\n\nQuestion: "
                           + _text(rng, lexicon, weights, 30)}]}
            for n in range(DOCUMENTS + count)]


def run(decisions: int, reps: int, vocab: int = VOCAB,
        sizes: tuple[int, ...] = (400, 6_000, 24_000)) -> list[dict[str, float]]:
    """Rows per user-turn size (words) and engine count; ``vocab`` smaller only in tests."""
    rng = random.Random(11)
    tokenizer, lexicon, weights = build_tokenizer(rng, vocab)
    rows = []
    for words in sizes:
        count = max(decisions // (1 + words // 2000), 20)
        batch = bodies(rng, lexicon, weights, words, count)
        docs = document_bodies(rng, lexicon, weights, words, count)
        for engines in (8, 64):
            shared = docs if engines == 8 else None  # encoding does not depend on the engines
            rows.append({"engines": engines, **measure(tokenizer, batch, engines, reps, shared)})
    return rows


def markdown(rows: list[dict[str, float]]) -> list[str]:
    lines = [
        "## With tokenization (precise mode)", "",
        "What precise routing adds per request, before the decision above: the chat template "
        "rendered and the prompt encoded by a byte-level BPE with a 32,000-token vocabulary "
        "(trained at run time on generated word-like text, wrapped in the proxy's "
        "`PromptTokenizer`), the token ids hashed into 16-token blocks as vLLM hashes them, and "
        "one exact-index lookup per engine. Precise mode pays these on top of the "
        "character-based chain above (the approximate index still answers for engines whose "
        "events are not in sync); long prompts are tokenized on a thread pool, off the event "
        "loop, so the figure is CPU spent, not a pause of other streams. The template puts "
        "special tokens between messages, so each message is encoded once and kept "
        "(`SegmentCache`): *tokenize* is a new user message after a shared system prompt, "
        "*resent* the same request again (a conversation resending its history). A long "
        "message is encoded in spans cut at word gaps, each kept, and runs of block keys "
        "hashed before are remembered: *shared document* is a user message holding one of four "
        "documents (each seen once before) and a new question (RAG), tokenized and hashed; "
        "*its hashing* is the hashing part alone, with those runs remembered and (in brackets) "
        "without, on the same ids.", "",
        "| engines | prompt tokens | tokenize µs | resent µs | shared document µs | "
        "its hashing µs | block hashing µs | index lookups µs | total µs |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["tokenize_us"] + r["hash_us"] + r["lookup_us"]
        lines.append(f"| {int(r['engines'])} | {int(r['prompt_tokens']):,} | "
                     f"{r['tokenize_us']:.1f} | {r.get('resent_us', float('nan')):.1f} | "
                     f"{_or_dash(r.get('shared_us', float('nan')))} | "
                     f"{_shared_hashing(r)} | "
                     f"{r['hash_us']:.1f} | {r['lookup_us']:.1f} | "
                     f"{total:.1f} |")
    return lines


def _or_dash(us: float) -> str:
    return "—" if us != us else f"{us:.1f}"


def _shared_hashing(row: dict[str, float]) -> str:
    kept, plain = row.get("shared_hash_us"), row.get("shared_hash_plain_us")
    if kept is None or plain is None:
        return "—"
    return f"{kept:.1f} ({plain:.1f})"


if __name__ == "__main__":  # a quick look without the rest of bench.decision
    print("\n".join(markdown(run(50, 2))))

