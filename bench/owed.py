"""Benchmark: admission's sum of what the requests in flight still owe, per admission.

Not a test, and in process: ``proxy.core.commitment.Commitments`` for each engine of a pool,
every flight answered and part relayed, asked once per engine per admission (as the KV guard asks
it) at a steady admission rate in simulated time. Two ways, timed in the same rounds in
alternating order, best of ``--repeat`` each: the fresh sum (``owed_blocks`` without the time,
every answered flight summed per call) and the kept one (with the time: summed at most every
``ANSWERED_REFRESH_S``). Each round checks that the kept figure is never below the fresh one.

    python -m bench.owed [--streams 64,1024,2048] [--engines 8] [--rate 300] [--rounds 3]

It measures wall time in this process: run it under the benchmark lock.
"""

from __future__ import annotations

import argparse
import sys
import time

from proxy.core.commitment import Commitments, Flight

BLOCK = 16
BYTES_PER_TOKEN = 50.0


def books(streams: int, engines: int) -> list[Commitments]:
    out = []
    for _ in range(engines):
        book = Commitments()
        for ticket in range(streams // engines):
            flight = book.dispatch(ticket, Flight(200.0, 64.0))
            book.first_byte(ticket)
            flight.relayed = ticket * 37 % 5000  # some produced past their expected length
        out.append(book)
    return out


def per_admission_us(pool: list[Commitments], rate: float, admissions: int, kept: bool) -> float:
    now = 0.0
    start = time.perf_counter()
    for _ in range(admissions):
        now += 1.0 / rate
        for book in pool:
            if kept:
                book.owed_blocks(BLOCK, BYTES_PER_TOKEN, now)
            else:
                book.owed_blocks(BLOCK, BYTES_PER_TOKEN)
    return (time.perf_counter() - start) / admissions * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.owed", description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="64,1024,2048", help="open streams, comma-separated")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--rate", type=float, default=300.0, help="admissions per simulated second")
    p.add_argument("--admissions", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    print("| open streams | round | fresh sum, µs per admission | kept, µs per admission | ratio |")
    print("|---|---|---|---|---|")
    for streams in (int(s) for s in args.streams.split(",")):
        for rnd in range(1, args.rounds + 1):
            fresh, kept = [], []
            for i in range(args.repeat):
                order = (False, True) if i % 2 == 0 else (True, False)
                for use_kept in order:
                    pool = books(streams, args.engines)
                    (kept if use_kept else fresh).append(
                        per_admission_us(pool, args.rate, args.admissions, use_kept))
            pool = books(streams, args.engines)
            for book in pool:
                if book.owed_blocks(BLOCK, BYTES_PER_TOKEN, 1.0) < book.owed_blocks(
                        BLOCK, BYTES_PER_TOKEN) * (1 - 1e-12):
                    raise SystemExit("the kept sum fell below the fresh one")
            f, k = min(fresh), min(kept)
            print(f"| {streams} | {rnd} | {f:.1f} | {k:.1f} | {k / f:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
