"""The HTTP shell: the aiohttp application, its handlers, the relay, and the server's lifecycle.

Rules: a handler performs the core's decisions in the order of one request (accept, cache, pool,
admit, pick, relay, account) and nothing clever itself. Exceptions become responses in one
middleware; every background task is named, owned and cancelled on shutdown; ``CancelledError`` is
always re-raised. This is the only package that imports aiohttp's server side.
"""
