"""The communicators' fast paths: Note [Validated buffer cache] (repeated calls reuse the checked Buffers,
and every guarantee of the full checks still holds for a call that follows a cached one) and Note
[Small averages run inline] (the local backend's async average of a small bucket skips the worker)."""
import pytest
import torch

from ncclavg import CommError, Communicator


def _pair(n=64, dtype=torch.float32):
    return [torch.full((n,), 1.0, dtype=dtype), torch.full((n,), 3.0, dtype=dtype)]


def test_repeated_calls_hit_the_cache_and_stay_exact():
    comm = Communicator.local(2)
    xs = _pair()
    for _ in range(3):
        xs[0].fill_(1.0)
        xs[1].fill_(3.0)
        comm.all_reduce_avg(xs)
        assert torch.equal(xs[0], torch.full((64,), 2.0)) and torch.equal(xs[1], xs[0])
    assert len(comm._buffer_cache) == 1
    comm.all_reduce_avg(tuple(xs))          # a tuple of the same tensors: the same key
    assert len(comm._buffer_cache) == 1


@pytest.mark.parametrize("bad,exc,match", [
    (lambda xs: [xs[0], xs[0]], ValueError, "share memory"),
    (lambda xs: [xs[0], xs[1][:32]], ValueError, "has 32 elements"),
    (lambda xs: [xs[0], xs[1].view(8, 8).t()], ValueError, "not contiguous"),
    (lambda xs: [xs[0], xs[1].to(torch.float16)], TypeError, "dtype"),
    (lambda xs: [xs[0], xs[1].to(torch.float64)], TypeError, "dtype"),
    (lambda xs: [xs[0]], ValueError, "local_size 2"),
    (lambda xs: [xs[0], xs[1], xs[1]], ValueError, "local_size 2"),
    (lambda xs: torch.stack(xs), TypeError, "one tensor per local tower"),
    (lambda xs: [xs[0], xs[1].numpy()], TypeError, "torch.Tensor"),
    (lambda xs: [xs[0], xs[1]._neg_view()], ValueError, "negation"),
])
def test_after_a_cached_call_bad_input_is_still_refused_and_nothing_changes(bad, exc, match):
    comm = Communicator.local(2)
    xs = _pair()
    comm.all_reduce_avg(xs)                  # warms the cache with this pair
    args = bad(xs)
    before = [x.clone() for x in xs]
    with pytest.raises(exc, match=match):
        comm.all_reduce_avg(args)
    assert all(torch.equal(a, b) for a, b in zip(xs, before))


def test_moved_or_resized_storage_is_checked_again():
    comm = Communicator.local(2)
    xs = _pair()
    comm.all_reduce_avg(xs)
    xs[1].set_(torch.full((64,), 5.0))       # same tensor object, new storage: a new key
    xs[0].fill_(1.0)
    comm.all_reduce_avg(xs)
    assert torch.equal(xs[0], torch.full((64,), 3.0)) and torch.equal(xs[1], xs[0])
    xs[1].resize_(32)                         # same object, fewer elements: refused, not averaged blindly
    with pytest.raises(ValueError, match="has 32 elements"):
        comm.all_reduce_avg(xs)


def test_memory_handed_to_new_tensors_gives_right_results():
    # Freed buckets and new ones of the same size often land at the same addresses: the cached Buffers
    # (pointer, size, dtype) are then exactly right for the new tensors.
    comm = Communicator.local(3)
    for step in range(20):
        xs = [torch.full((1000,), float(v + step)) for v in (0, 1, 5)]
        comm.all_reduce_avg(xs)
        for x in xs:
            assert torch.equal(x, torch.full((1000,), 2.0 + step))


def test_closed_or_failed_communicator_is_refused_on_the_cached_path():
    comm = Communicator.local(2)
    xs = _pair()
    comm.all_reduce_avg(xs)
    comm.abort("test abort")
    with pytest.raises(CommError, match="test abort"):
        comm.all_reduce_avg(xs)
    comm2 = Communicator.local(2)
    comm2.all_reduce_avg(xs)
    comm2.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm2.all_reduce_avg(xs)


def test_cache_is_bounded_and_holds_no_tensor():
    comm = Communicator.local(2)
    alive = []   # every pair kept alive: distinct addresses, so each call is a new key
    for _ in range(comm._BUFFER_CACHE_SIZE + 44):
        alive.append([torch.ones(8), torch.ones(8)])
        comm.all_reduce_avg(alive[-1])
    assert len(comm._buffer_cache) == comm._BUFFER_CACHE_SIZE
    for key in comm._buffer_cache:
        assert all(not isinstance(v, torch.Tensor) for facts in key for v in facts)


def test_async_path_uses_the_cache_too():
    comm = Communicator.local(2)
    xs = _pair()
    comm.all_reduce_avg_async(xs).wait()
    comm.all_reduce_avg_async(xs).wait()
    assert len(comm._buffer_cache) == 1 and torch.equal(xs[0], torch.full((64,), 2.0))
    comm.close()


def test_small_async_average_runs_inline_large_one_on_the_worker():
    # Note [Small averages run inline]
    from ncclavg.comm.local import INLINE_BYTES

    comm = Communicator.local(2)
    small = _pair(INLINE_BYTES // 4)
    work = comm.all_reduce_avg_async(small)
    assert work.done() and work.elapsed is not None and torch.equal(small[0], torch.full_like(small[0], 2.0))
    big = _pair(INLINE_BYTES // 4 + 1)
    work = comm.all_reduce_avg_async(big)
    work.wait()
    assert not work._job.ran_inline and torch.equal(big[1], torch.full_like(big[1], 2.0))
    comm.close()


def test_small_average_waits_its_turn_behind_a_queued_job():
    import threading

    comm = Communicator.local(2)
    gate = threading.Event()
    comm._submit(lambda: gate.wait(30), "a job holding the worker")
    xs = _pair()
    work = comm.all_reduce_avg_async(xs)     # small, but the worker is busy: queued behind, not inline
    assert not work.done() and torch.equal(xs[0], torch.ones(64))
    gate.set()
    work.wait()
    assert torch.equal(xs[0], torch.full((64,), 2.0))
    comm.close()
