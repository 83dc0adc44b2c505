"""ncclavg.errors.is_timeout, the one rule for "did a wait run out": ncclavg's errors by their type or
flag whatever their text says; torch's gloo and store errors, which have one type for every failure, by
their text."""
import pytest

from ncclavg.errors import CommError, CommTimeoutError, is_timeout


def test_ncclavg_errors_by_type_not_text():
    from ncclavg.process_group.face import BackendError, BackendMismatchError, BackendTimeoutError

    assert is_timeout(CommTimeoutError("all_reduce_avg timed out"))
    assert is_timeout(BackendTimeoutError("the group's timeout expired"))
    # refusals that quote an earlier timeout are not timeouts themselves
    assert not is_timeout(BackendError("refused: an earlier collective failed (timed out after 2 s)"))
    assert not is_timeout(BackendMismatchError("collectives out of step (timeout 30 s)"))


def test_a_flag_wins_over_the_text():
    e = CommError("shared-memory collective timed out")
    e.is_timeout = False
    assert not is_timeout(e)
    e.is_timeout = True
    assert is_timeout(e)


@pytest.mark.parametrize("text,want", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 2000ms for recv", True),
    ("Socket Timeout", True),
    ("Connection closed by peer [127.0.0.1]:4242", False),
])
def test_torch_errors_by_their_text(text, want):
    import torch.distributed as dist

    assert is_timeout(dist.DistBackendError(text)) is want
    assert is_timeout(RuntimeError(text)) is want
    assert is_timeout(TimeoutError("x"))
