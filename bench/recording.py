"""Benchmark: what recording one streamed answer for the response cache costs, per token.

Not a test, and in process: ``proxy.core.recording.Recording`` is fed a whole stream at once (as
the relay tells it at a stream's end) and asked for the answer, as the cache does for every
``temperature: 0`` answer. Streams of 16, 256 and 2000 tokens in four shapes: the simulator's own
chat and completions streams (``engine_sidecar.sim.responses``, one word per event) and vLLM's
(the same events with the fields vLLM's ``model_dump_json(exclude_unset=True)`` adds:
``token_ids: null`` on chat tokens, ``stop_reason``/``prompt_token_ids``/``token_ids`` on
completions tokens).

The baseline is the module at another revision (``--baseline``, default ``main``), loaded from
``git show`` into a throwaway module; both are timed in the same rounds, in alternating order,
best of ``--repeat`` runs each, and every round checks that both give the same answer.

    python -m bench.recording [--baseline main] [--rounds 3] [--repeat 7]

It measures wall time in this process: run it under the benchmark lock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import timeit
import types
from collections.abc import Callable
from typing import Any

import orjson

from engine_sidecar.sim import responses as sim
from proxy.core import recording as current

SIZES = (16, 256, 2000)
SHAPES = ("sim-chat", "sim-completions", "vllm-chat", "vllm-completions")
_MODEL = "meta-llama/Llama-3.1-70B-Instruct"
_ID = "chatcmpl-8f3a2b1c9d7e4f60a1b2c3d4e5f60718"


def baseline_module(ref: str) -> types.ModuleType:
    """``proxy/core/recording.py`` as it is at ``ref``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{ref}:proxy/core/recording.py"], check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    module = types.ModuleType("recording_baseline")
    exec(compile(source, f"{ref}:proxy/core/recording.py", "exec"), module.__dict__)
    return module


def sim_stream(tokens: int, *, chat: bool) -> bytes:
    """The simulator's stream of ``tokens`` words, usage included, as it writes it."""
    kind = "chat" if chat else "completion"
    ident = sim.Identity(kind, _ID, 1764000000, _MODEL, None)
    out = [sim.role_chunk(ident)] if chat else []
    for i in range(tokens):
        out.append(sim.delta_chunk(ident, [i % 256], i, "length" if i == tokens - 1 else None))
    out += [sim.usage_chunk(ident, 200, tokens), sim.DONE]
    return b"".join(out)


def vllm_stream(tokens: int, *, chat: bool) -> bytes:
    """The same answer in the shape vLLM's OpenAI server sends it."""
    head: dict[str, Any] = {"id": _ID,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": 1764000000, "model": _MODEL}  # fmt: skip
    events = []
    if chat:
        events.append({**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                            "delta": {"role": "assistant", "content": ""}}]})
    for i in range(tokens):
        word = sim.VOCAB[i % 256]
        last = i == tokens - 1
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice |= {"delta": {"content": word}, "logprobs": None,
                       "finish_reason": "length" if last else None}  # fmt: skip
            choice |= {"stop_reason": None, "token_ids": None} if last else {"token_ids": None}
        else:
            choice |= {"text": word, "logprobs": None, "finish_reason": "length" if last else None,
                       "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
        events.append({**head, "choices": [choice]})
    usage = {"prompt_tokens": 200, "total_tokens": 200 + tokens, "completion_tokens": tokens}
    events.append({**head, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def stream(shape: str, tokens: int) -> bytes:
    maker = sim_stream if shape.startswith("sim") else vllm_stream
    return maker(tokens, chat=shape.endswith("chat"))


def recorder(module: types.ModuleType, data: bytes, chat: bool) -> Callable[[], object]:
    """One recording as the relay and the cache make it: started, fed once, asked."""

    def run() -> object:
        rec = module.Recording(chat=chat, max_bytes=1 << 24)
        rec.start(200, streamed=True)
        rec.feed(data)
        return rec.response()

    return run


def best_us(fn: Callable[[], object], repeat: int, tokens: int) -> float:
    number = max(1, 20_000 // tokens)
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number / tokens * 1e6


def measure(base: types.ModuleType, rounds: int, repeat: int) -> dict[tuple[str, int], Any]:
    """(shape, tokens) -> per round (baseline µs/token, current µs/token)."""
    out: dict[tuple[str, int], Any] = {}
    for r in range(rounds):
        for shape in SHAPES:
            for tokens in SIZES:
                data, chat = stream(shape, tokens), shape.endswith("chat")
                old, new = recorder(base, data, chat), recorder(current, data, chat)
                if old() != new() or new() is None:
                    sys.exit(f"{shape} {tokens}: the two modules disagree (or store nothing)")
                pair = [0.0, 0.0]
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    pair[which] = best_us((old, new)[which], repeat, tokens)
                out.setdefault((shape, tokens), []).append(tuple(pair))
    return out


def report(results: dict[tuple[str, int], Any], ref: str) -> str:
    lines = [f"| shape | tokens | {ref} µs/token | now µs/token | {ref} ÷ now, by round |",
             "|---|---|---|---|---|"]
    for (shape, tokens), pairs in results.items():
        ratios = sorted(old / new for old, new in pairs)
        old = statistics.median(p[0] for p in pairs)
        new = statistics.median(p[1] for p in pairs)
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else f"{ratios[0]:.2f}"
        lines.append(f"| {shape} | {tokens} | {old:.3f} | {new:.3f} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=7, help="best of this many runs")
    args = parser.parse_args(argv)
    results = measure(baseline_module(args.baseline), args.rounds, args.repeat)
    print(report(results, args.baseline))


if __name__ == "__main__":
    main()
