"""Seeds for the separate random streams of one job, all derived from its one `seed` parameter."""

from __future__ import annotations

import hashlib


def derived_seed(seed: int, *stream: str | int) -> int:
    """A seed in [0, 2^63) for one stream of a job's randomness, named by ``stream`` ("shuffle";
    "projection", layer, k; …), the same in every process and on every machine.

    Hashing (seed, stream) keeps the streams of one seed apart and those of nearby seeds too: with
    ``seed + 1`` for the shuffle, seed 0's shuffle read the same generator as seed 1's data.
    """
    # ints as Python ints: a numpy integer's repr ("np.int64(3)") would hash differently
    key = repr((int(seed),) + tuple(part if isinstance(part, str) else int(part) for part in stream)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
