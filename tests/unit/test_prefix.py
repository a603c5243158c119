from hypothesis import given
from hypothesis import strategies as st

from proxy.core.prefix import canonical_chat, canonical_prompt, prefix_chain

BC = 16


def chain(
    text: str, *, model: str = "m", tenant: str = "t", max_blocks: int = 64
) -> tuple[int, ...]:
    return prefix_chain(text, model=model, tenant=tenant, block_chars=BC, max_blocks=max_blocks)


def test_canonical_chat_roles_and_contents_in_order() -> None:
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
    ]
    text = canonical_chat(msgs)
    assert text.index("be brief") < text.index("hi")
    assert "system" in text and "user" in text
    assert canonical_chat(msgs) != canonical_chat(list(reversed(msgs)))
    # Same contents under another role is another prompt.
    assert canonical_chat([{"role": "user", "content": "x"}]) != canonical_chat(
        [{"role": "system", "content": "x"}]
    )


def test_earlier_turns_are_a_text_prefix() -> None:
    turn1: list[dict[str, object]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
    ]
    turn2: list[dict[str, object]] = [
        *turn1,
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert canonical_chat(turn2).startswith(canonical_chat(turn1))


def test_canonical_prompt() -> None:
    assert canonical_prompt("abc") == "abc"
    assert canonical_prompt(["first", "second"]) == "first"
    assert canonical_prompt([1, 2, 3]) == "1 2 3"
    assert canonical_prompt([]) == ""


def test_known_value_is_stable_across_processes() -> None:
    # blake2b, not hash(): a fixed input gives a fixed key in every process and replica.
    assert chain("hello world, this is a test") == chain("hello world, this is a test")
    assert prefix_chain("abc", model="m", tenant="t", block_chars=4, max_blocks=4) == (
        prefix_chain("abc", model="m", tenant="t", block_chars=4, max_blocks=4)
    )
    assert all(0 <= h < 2**64 for h in chain("x" * 100))


def test_lengths() -> None:
    assert len(chain("")) == 1
    assert len(chain("a")) == 1
    assert len(chain("a" * BC)) == 1
    # A partial trailing block is left out: engines cache only full blocks.
    assert len(chain("a" * (BC + 1))) == 1
    assert len(chain("a" * (2 * BC - 1))) == 1
    assert len(chain("a" * 2 * BC)) == 2
    assert len(chain("a" * 10 * BC, max_blocks=3)) == 3


def test_short_prompts_are_keyed_by_their_whole_text() -> None:
    assert chain("hello") != chain("howdy")
    assert chain("") != chain("x")


@given(st.text(min_size=BC, max_size=200), st.text(max_size=200))
def test_a_growing_conversation_keeps_its_chain(turn1: str, more: str) -> None:
    # What a later turn adds (however long) never changes the blocks an earlier turn produced:
    # every block of turn 1's chain is in turn 2's chain at the same depth.
    first = chain(turn1)
    assert chain(turn1 + more)[: len(first)] == first


@given(st.text(max_size=200), st.text(max_size=200))
def test_equal_prefixes_give_equal_chain_prefixes(a: str, b: str) -> None:
    whole = a[: (len(a) // BC) * BC]
    full = len(whole) // BC
    assert chain(whole + b)[:full] == chain(whole)[:full]


@given(st.text(min_size=1, max_size=100))
def test_tenant_and_model_separate_keys(text: str) -> None:
    base = chain(text)
    assert chain(text, tenant="other") != base
    assert chain(text, model="other") != base
    assert not set(chain(text, tenant="other")) & set(base)


@given(st.text(min_size=BC + 1, max_size=100), st.text(min_size=1, max_size=3))
def test_different_first_block_changes_everything(text: str, prefix: str) -> None:
    changed = prefix + text
    if changed[:BC] != text[:BC]:
        assert chain(changed)[0] != chain(text)[0]
