"""Prefix keys: the canonical prompt text cut into blocks and hashed as a chain.

Rules:
- Canonical text depends only on what reaches the engine's KV cache first: the roles and contents of
  chat messages in order (text parts only for multimodal content), or the completion prompt.
  Each message ends with a separator, so a conversation's earlier turns are a text prefix of its
  later turns.
- Hashes are 64-bit blake2b, never Python's ``hash()`` (salted per process, so replicas would
  disagree). The first block is keyed with model and tenant: equal prefixes give equal chain
  prefixes, and two tenants never share a key.
- Only full blocks are hashed: an engine caches only full KV blocks, and a partial trailing block
  changes with every new turn of a conversation, so it must be neither a routing key nor remembered
  in the routing index. A prompt shorter than one block has no full block; it gets a one-element
  chain hashing all of it, so short prompts still spread by content (an empty prompt included).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

_ROLE_SEP = "\x1f"
_MSG_END = "\x1e"


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                parts.append(text if isinstance(text, str) else "")
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def canonical_chat(messages: Sequence[dict[str, object]]) -> str:
    """Roles and contents of chat messages in order, each message terminated."""
    out: list[str] = []
    for msg in messages:
        role = msg.get("role")
        out.append(role if isinstance(role, str) else "")
        out.append(_ROLE_SEP)
        out.append(_content_text(msg.get("content")))
        out.append(_MSG_END)
    return "".join(out)


def canonical_prompt(prompt: str | Sequence[object]) -> str:
    """The completion prompt; a list of strings is joined, a list of token ids is spelt out."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, int) for p in prompt):
        return " ".join(str(p) for p in prompt)
    pieces: list[str] = []
    for p in prompt:
        if isinstance(p, str):
            pieces.append(p)
        elif isinstance(p, list):
            pieces.append(" ".join(str(t) for t in p))
        else:
            pieces.append(str(p))
    # Only the first prompt of a batch decides where the batch goes; the rest follow it.
    return pieces[0] if pieces else ""


def _seed(model: str, tenant: str) -> bytes:
    return blake2b(f"{model}\x00{tenant}".encode(), digest_size=16).digest()


def prefix_chain(
    text: str, *, model: str, tenant: str, block_chars: int, max_blocks: int
) -> tuple[int, ...]:
    """64-bit chained hashes of ``text`` in ``block_chars`` blocks (at most ``max_blocks``)."""
    if block_chars <= 0 or max_blocks <= 0:
        raise ValueError("block_chars and max_blocks must be positive")
    end = min(len(text), block_chars * max_blocks)
    data: str | bytes = text[:end]
    if text.isascii():
        # One encode for the whole prompt (characters are bytes); otherwise encode block by block
        # so that blocks stay cut at character boundaries.
        data = text[:end].encode("ascii")
    prev = _seed(model, tenant)
    chain: list[int] = []
    # Full blocks only; a prompt shorter than one block is its own (short) block.
    full_end = end - end % block_chars if end >= block_chars else max(end, 1)
    # One constructor call per block over ``prev + block`` (the same bytes, so the same hashes
    # as an update after the seed): a long prompt has hundreds of blocks, and the separate
    # ``update`` call was a tenth of this function's time.
    for start in range(0, full_end, block_chars):
        block = data[start : start + block_chars]
        raw = block if isinstance(block, bytes) else block.encode("utf-8", "surrogatepass")
        prev = blake2b(prev + raw, digest_size=8).digest()
        chain.append(int.from_bytes(prev, "big"))
    return tuple(chain)
