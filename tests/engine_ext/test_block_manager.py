import pytest

from engine_ext.block_manager import BlockManager, blocks_for


@pytest.mark.parametrize("tokens,size,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (3, 1, 3)])
def test_blocks_for(tokens, size, expected):
    assert blocks_for(tokens, size) == expected


def test_allocate_truncate_free_roundtrip():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = [], []
    assert bm.can_allocate(a, 9)
    bm.allocate(a, 9)
    assert len(a) == 3 and bm.num_free == 3
    bm.allocate(a, 12)  # still fits in 3 blocks
    assert len(a) == 3
    assert not bm.can_allocate(b, 13)
    bm.allocate(b, 12)
    assert bm.num_free == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(a, 13)
    bm.truncate(a, 5)
    assert len(a) == 2 and bm.num_free == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and a == [] and b == []
