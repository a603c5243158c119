"""The precise-routing cost measure: real tokenization of chat bodies of growing size, the
block keys hashed, lookups against indexes that hold the shared system prompt."""

from __future__ import annotations

from bench import tokencost


def test_rows_grow_with_the_prompt_and_the_table_shows_them() -> None:
    rows = tokencost.run(decisions=20, reps=1, vocab=600, sizes=(50, 2_000))
    assert [int(r["engines"]) for r in rows] == [8, 64, 8, 64]
    small, large = rows[0], rows[2]
    assert 0 < small["prompt_tokens"] < large["prompt_tokens"]
    for r in rows:
        assert r["tokenize_us"] > 0 and r["hash_us"] > 0 and r["lookup_us"] > 0
    for r in rows[::2]:  # the shared documents' hashing, remembered and not, on the same ids
        assert r["shared_hash_us"] > 0 and r["shared_hash_plain_us"] > 0
    table = "\n".join(tokencost.markdown(rows))
    assert "| 64 |" in table and "tokenize µs" in table and "its hashing µs" in table
