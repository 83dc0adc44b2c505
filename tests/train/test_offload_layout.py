"""The bucket layout of the CPU-master pipeline for GPU towers (ncclavg/train/offload.py), checked on the
CPU: the pipeline itself needs a GPU, but which element goes where is plain arithmetic."""
import pytest

from ncclavg.train.offload import bucket_layout


@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize("counts", [(1,), (2,), (4,), (1, 1), (2, 2), (1, 3), (3, 1, 2)])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 65537])
def test_every_process_covers_the_bucket_and_the_shards_tile_it(numel, itemsize, counts):
    total = sum(counts)
    several = len(counts) > 1
    for p, here in enumerate(counts):
        padded, shard, parts = bucket_layout(numel, itemsize, total, here, several)
        # padded: room for the bucket, total shards of whole 256-byte blocks
        assert padded >= numel and padded % total == 0 and shard * total == padded
        assert (shard * itemsize) % 256 == 0
        # the local towers' host copies partition [0, padded) in order: the host gets the whole bucket
        # (one process: each tower's part is its own shard; several: the all-reduced bucket in T pieces)
        assert parts[0][0] == 0 and parts[-1][1] == padded
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(lo <= hi for lo, hi in parts)
        if not several:
            assert parts == [(t * shard, (t + 1) * shard) for t in range(here)]
