"""Signatures of collectives: what each moves, as an integer every rank computes alike, and how a signature sits
beside its collective's number in a rank's announcement slot (see announcements.py)."""

from __future__ import annotations

import zlib
from typing import Any, Sequence

REFUSED = 1  # the signature of a collective a rank announces but will not make (`refuse`); `signature` never is
SIGNATURE_BITS = 47  # a signature beside 16 bits of its collective's number fits a slot's signed 8-byte cell
NUMBER = (1 << 16) - 1  # the bits of the number stored beside a signature in a slot

_CODES: dict[str, int] = {}


def signature(what: str, parts: Sequence[tuple[int, Any]], key: int = 0) -> int:
    """What a collective moves, as an integer equal on every rank that makes the same collective (`Channel.run`
    compares them), whichever route each rank's values take to it: `what`, each buffer's element count and dtype,
    and `key` (an all-reduce plan's `identity`: its values' shapes and dtypes, and whether it averages; or whether
    a lone all-reduce averages). Built from integers only, since a str's hash differs from process to process;
    never 0 (none) or REFUSED."""
    code = _CODES.get(what) or _CODES.setdefault(what, zlib.crc32(what.encode()))
    if len(parts) == 1:  # the usual call, in fewer steps (it runs right after a transfer has left the caches cold)
        count, dtype = parts[0]
        value = hash((code, key, count, ord(dtype.kind), dtype.itemsize)) & ((1 << SIGNATURE_BITS) - 1)
    else:
        value = hash((code, key, *[x for count, dtype in parts for x in (count, ord(dtype.kind), dtype.itemsize)])
                     ) & ((1 << SIGNATURE_BITS) - 1)
    return value if value > REFUSED else value + 2


def differs(cell: int, sequence: int, signature: int) -> bool:
    """Whether a peer's slot cell holds collective `sequence` with a nonzero signature other than `signature` (a
    cell that holds another collective's, a later one, cannot tell)."""
    return cell_signature(cell, sequence) not in (0, signature)


def cell_word(signature: int, sequence: int) -> int:
    """What a slot's cell holds for collective `sequence` announced with `signature`."""
    return signature << 16 | sequence & NUMBER


def cell_signature(cell: int, sequence: int) -> int:
    """The signature a slot's cell holds for collective `sequence`; 0 where it holds another collective's."""
    return cell >> 16 if cell & NUMBER == sequence & NUMBER else 0
