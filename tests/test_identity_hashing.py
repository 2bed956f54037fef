"""BlockIdentity equality and hashing: equal by every field, never hashable (it holds the
token ndarray), and the constructor takes exactly its five fields."""

import numpy as np
import pytest

from pagedkv.identity import BlockIdentity


def _ident(tokens=(1, 2, 3), parent=7, digest=0, salt=0, index=0):
    return BlockIdentity(np.asarray(tokens, np.uint32), parent, digest, salt, index)


def test_fields_are_exactly_the_five_declared():
    assert BlockIdentity._fields == ("tokens", "parent_hash", "extra_keys_digest",
                                     "cache_salt", "block_index")
    with pytest.raises(TypeError):
        BlockIdentity(np.zeros(1, np.uint32), 0, 0, 0, 0, None)  # no hidden 6th field


def test_equality_compares_every_field():
    assert _ident() == _ident()
    assert not (_ident() != _ident())  # noqa: SIM202 - __ne__ itself is under test
    assert _ident() != _ident(tokens=(1, 2, 4))
    assert _ident() != _ident(parent=8)
    assert _ident() != _ident(digest=1)
    assert _ident() != _ident(salt=1)
    assert _ident() != _ident(index=1)
    assert _ident() != (np.asarray((1, 2, 3), np.uint32), 7, 0, 0, 0)


def test_unhashable_with_a_message():
    ident = _ident()
    with pytest.raises(TypeError, match="unhashable type: 'BlockIdentity'"):
        hash(ident)
    with pytest.raises(TypeError):
        _ = {ident}
    # Equal identities must never land in a set/dict as different keys by accident.
    assert _ident() == _ident()
