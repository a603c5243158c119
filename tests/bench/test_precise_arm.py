"""The routing suite's precise-mode arm: the word tokenizer counts the prompts' tokens as the
simulated engines do without one, and the kvproxy it starts is configured for precise routing."""

from __future__ import annotations

import random
from pathlib import Path

from bench.fleet import FleetSpec
from bench.peers import Router, _kvproxy, parse_router_list
from bench.prompts import random_tokens, token_count
from bench.routing import precise_fleet
from bench.wordtok import make_word_tokenizer
from proxy.core.configload import load_config
from proxy.fleet.tokenizer import load_tokenizer


def test_one_token_per_prompt_word_as_the_engines_count_them(tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_word_tokenizer(tmp_path / "tok")), "tokenizer")
    text = random_tokens(random.Random(3), 300)
    ids = tok.encode(text, special=False)
    assert len(ids) == token_count(text) == 300
    assert 0 not in ids  # no word falls into [UNK]
    chat = tok.request_ids(True, {"messages": [{"role": "user", "content": text}]})
    # The template's markers around the words, a token per character.
    head, tail = len("<s><|user|>"), len("<|assistant|>")
    assert chat is not None and len(chat) == head + len(ids) + tail
    assert chat[head:-tail] == ids and set(chat[:head] + chat[-tail:]) == {0}
    assert tok.spans  # a long prompt is encoded in spans (between words)
    long_text = random_tokens(random.Random(4), 3000)
    assert tok.encode(long_text, special=False) == tok._whole(long_text, False)


def test_the_precise_arm_starts_engines_and_proxy_on_the_same_events(tmp_path: Path) -> None:
    [router] = parse_router_list("kvproxy/expected_ttft+precise")
    assert router.precise and not Router("kvproxy", "expected_ttft").precise
    spec, events = precise_fleet(FleetSpec(engines=3), tmp_path)
    argv = spec.argv(9000)
    assert argv[argv.index("--tokenizer") + 1] == str(tmp_path / "tokenizer")
    assert argv[argv.index("--kv-events-endpoint") + 1] == events[0]
    assert len(events) == 3 and all(e.startswith("tcp://127.0.0.1:") for e in events)
    argv, _env, _ready, _headers = _kvproxy(
        router, ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"], "m", 9100,
        tmp_path, events)
    cfg = load_config(argv[argv.index("--config") + 1], {}, [])
    [pool] = cfg.pools
    assert cfg.routing.policy == "expected_ttft" and pool.tokenizer == str(tmp_path / "tokenizer")
    for engine, endpoint in zip(pool.engines, events, strict=True):
        assert engine.kv_events is not None
        assert engine.kv_events.endpoint == endpoint and engine.kv_events.bind
