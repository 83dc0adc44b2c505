"""The NCCL host logic (NcclComm: csrc/cuda/comm*.cpp, nccl_api.cpp) run on the CPU, over the emulated
CUDA runtime and the stand-in NCCL of csrc/cuda/emu (docs/cuda_emulation.md, "The host logic on the CPU").

Each case runs one scenario of the harness in its own process, with the faults of the stand-in chosen by
environment variables. The harness is built from the csrc/ of THIS checkout with ASan + UBSan, into the
pytest cache; the stand-in once per NCCL feature set (Note [Stand-in feature sets] in build_host.py).
No GPU and no ncclavg._C needed: only g++ and the CUDA headers.
"""
import pytest

from _paths import ROOT, load_script

EMU = ROOT / "csrc" / "cuda" / "emu"
build_host = load_script(EMU / "build_host.py", "ncclavg_build_host")


def _skip_reason():
    if build_host.build_emu.find_cxx() is None:
        return "no g++ on PATH: the host-logic harness is compiled with g++"
    inc, why = build_host.build_emu.find_cuda_include()
    return None if inc is not None else f"no CUDA headers ({why}); set CUDA_HOME to a CUDA toolkit"


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")

NONBLOCKING = {"NCCLAVG_NCCL_COLLECTIVES": "nonblocking"}
# rank 1 freezes in its first collective, and an abort waits until every peer closed (NCCL's proxy join)
FROZEN_PEER_HOLDS_ABORT = {"NCCLEMU_ABORT_BLOCKS": "1", "NCCLEMU_HANG": "1:1"}
# (scenario, extra environment): every scenario of the harness at least once (see
# test_every_scenario_runs). The faults are the stand-in's NCCLEMU_* variables (nccl_standin.h).
CASES = {
    "init_all_properties": ("init_all_properties", {}),
    "init_all_properties-nonblocking": ("init_all_properties", NONBLOCKING),
    # NCCL 2.21 reported (the 2.28.9 feature set): a split, but connections made at init anyway
    "init_all_properties-2.21": ("init_all_properties", {"NCCLEMU_VERSION": "22100"}),
    "init_arguments": ("init_arguments", {}),
    "bad_collective_mode": ("bad_collective_mode_names_the_variable", {}),
    "init_rank_threads": ("init_rank_threads", {}),
    "init_ranks_processes_2_2": ("init_ranks_processes_2_2", {}),
    "init_ranks_processes_1_2": ("init_ranks_processes_1_2", {}),
    "init_peer_never_starts": ("init_peer_never_starts", {}),
    "init_never_finishes": ("init_that_never_finishes_times_out", {"NCCLEMU_INIT_HANG": "1"}),
    "init_never_finishes-nonblocking": ("init_that_never_finishes_times_out", {"NCCLEMU_INIT_HANG": "1", **NONBLOCKING}),
    "init_slow_is_polled": ("init_slow_is_polled", {"NCCLEMU_INIT_DELAY_S": "0.3"}),
    "split_fails": ("split_failure_is_an_error", {"NCCLEMU_SPLIT": "fail"}),
    "split_gives_no_comm": ("split_failure_is_an_error", {"NCCLEMU_SPLIT": "null"}),
    "all_reduce_reductions": ("all_reduce_reductions", {}),
    "all_reduce_reductions-nonblocking": ("all_reduce_reductions", NONBLOCKING),
    "forced-avg": ("all_reduce_reductions", {"NCCLAVG_TEST_REDUCTION": "avg"}),
    "forced-premulsum:3": ("all_reduce_reductions", {"NCCLAVG_TEST_REDUCTION": "premulsum:3"}),
    "forced-sum_divide:3": ("all_reduce_reductions", {"NCCLAVG_TEST_REDUCTION": "sum_divide:3"}),
    "reduce_scatter_and_all_gather": ("reduce_scatter_and_all_gather", {}),
    "reduce_scatter_and_all_gather-nonblocking": ("reduce_scatter_and_all_gather", NONBLOCKING),
    "ordering": ("ordering_after_the_callers_stream_and_before_the_readers", {}),
    "ordering-nonblocking": ("ordering_after_the_callers_stream_and_before_the_readers", NONBLOCKING),
    "bad_input": ("bad_input_names_the_argument_and_keeps_the_comm_usable", {}),
    "several_threads": ("collectives_from_several_threads", {}),
    "error_at_the_call": ("enqueue_error_is_reported_and_the_comm_stays_usable", {"NCCLEMU_FAIL_CALL": "1"}),
    "error_at_group_end": ("enqueue_error_is_reported_and_the_comm_stays_usable", {"NCCLEMU_FAIL_GROUPEND": "1"}),
    "wait_done_pending": ("wait_done_pending", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.3"}),
    "destroy": ("destroy_and_refuse", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.1"}),
    "peer_hangs": ("timeout_when_a_peer_hangs", {"NCCLEMU_HANG": "1:1"}),
    "peer_hangs-nonblocking": ("timeout_when_a_peer_hangs", {"NCCLEMU_HANG": "1:1", **NONBLOCKING}),
    "peer_skips": ("timeout_when_a_peer_skips_the_collective", {}),
    "async_error": ("async_error_aborts", {"NCCLEMU_ASYNC_ERROR_AFTER_S": "0.1:0", "NCCLEMU_SLOW_COLLECTIVE_S": "1"}),
    # the teardown and threading cases of csrc/cuda/emu/host_faults.cpp
    "capture_elsewhere": ("capture_in_another_thread_survives_the_watchdog", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.2"}),
    "no_context_on_gpu0": ("no_context_on_a_device_the_comm_does_not_use", {}),
    "sticky_cuda_error": ("sticky_cuda_error_aborts", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.3"}),
    "destroy_vs_enqueue": ("destroy_refuses_collectives_enqueued_meanwhile", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.005"}),
}
# waits kTeardownWaitMaxS (10 s) by design: with the slow tests
SLOW_CASES = {   # each over ~10 s on 2 cores: the slow step runs them
    "abort_held_by_a_frozen_peer": ("abort_held_by_a_frozen_peer_is_bounded", FROZEN_PEER_HOLDS_ABORT),
    "abort_ends_a_wait": ("abort_from_another_thread_ends_a_wait", {}),
    "abort": ("abort_then_every_call_says_so", {}),
    "destructor_wait_is_bounded": ("destructor_wait_is_bounded", {"NCCLEMU_HANG": "1:1"}),
}
# The scenarios that take every version gate: run against each stand-in feature set.
VERSIONED = ("init_all_properties", "all_reduce_reductions", "init_peer_never_starts", "peer_hangs", "wait_done_pending",
             "reduce_scatter_and_all_gather")


@pytest.fixture(scope="module")
def cache(request, tmp_path_factory):
    c = getattr(request.config, "cache", None)
    return c.mkdir("nccl_host_emu") if c is not None else tmp_path_factory.mktemp("nccl_host_emu")


_built = {}


def _harness(cache, api=build_host.DEFAULT_API, sanitize="address", mutations=None):
    key = (api, sanitize, repr(mutations))
    if key not in _built:
        _built[key] = build_host.build(ROOT, cache, sanitize=sanitize, api=api, mutations=mutations, jobs=2)
    return _built[key]


def _run(cache, scenario, env, api=build_host.DEFAULT_API, sanitize="address", mutations=None):
    exe, lib = _harness(cache, api, sanitize, mutations)
    return build_host.run(exe, lib, scenario, env=env, sanitize=sanitize)


def _report(r):
    return f"rc={r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


@pytest.mark.parametrize("case", sorted(CASES) + [pytest.param(c, marks=pytest.mark.slow) for c in sorted(SLOW_CASES)])
def test_host_logic(cache, case):
    scenario, env = {**CASES, **SLOW_CASES}[case]
    r = _run(cache, scenario, env)
    assert r.returncode == 0 and f"PASS {scenario}" in r.stdout, _report(r)


# The oldest feature set and the one with a non-blocking init but no split are quick; the other two
# (which only add PreMulSum / last error, and several ranks per GPU) run with the slow tests.
QUICK_APIS = (20909, 21701)


@pytest.mark.parametrize("api", [pytest.param(a, marks=() if a in QUICK_APIS else pytest.mark.slow)
                                 for a in build_host.API_LEVELS if a != build_host.DEFAULT_API])
@pytest.mark.parametrize("case", VERSIONED)
def test_host_logic_on_each_nccl_feature_set(cache, case, api):
    scenario, env = CASES[case]
    r = _run(cache, scenario, env, api=api)
    assert r.returncode == 0 and f"PASS {scenario}" in r.stdout, _report(r)


def test_every_scenario_runs(cache):
    exe, _ = _harness(cache)
    listed = set(build_host.scenarios(exe))
    run = {s for s, _ in [*CASES.values(), *SLOW_CASES.values(), *PLANTED_SCENARIOS]}
    assert listed <= run, f"scenarios no test runs: {sorted(listed - run)}"
    assert run <= listed, f"scenarios the harness lacks: {sorted(run - listed)}"


# Planted defects: (source relative to csrc/, old text, new text, scenario, env, what the run must show).
PLANTED = {
    # the timeout path that raises without aborting: the peers' kernels would stay stuck
    "timeout_without_abort": ("cuda/comm.cpp", "          abort_locked(reason);\n          throw TimeoutError(",
                              "          throw TimeoutError(", "timeout_when_a_peer_hangs", {"NCCLEMU_HANG": "1:1"},
                              "the timeout path did not abort"),
    # a non-blocking group end whose ncclInProgress is not polled: the done event is recorded before NCCL
    # enqueued the collective, so wait() returns early and the data are wrong (or NCCL is called in progress)
    "group_end_not_polled": ("cuda/comm_collectives.cpp", "if (in_progress) poll_ready_locked(deadline, p.what + \" (enqueue)\");",
                             "", "all_reduce_reductions", NONBLOCKING, "FAIL all_reduce_reductions"),
    # the comm stream not ordered after the caller's stream: the collective reads the input too early
    "no_ordering_event": ("cuda/comm_collectives.cpp", "NCCLAVG_CUDA_CHECK(cudaStreamWaitEvent(d.stream, d.ready, 0));", "",
                          "ordering_after_the_callers_stream_and_before_the_readers", {}, "the reader's copy"),
    # an init whose ncclInProgress is not polled: the communicators are used before they exist
    "init_not_polled": ("cuda/comm_init.cpp", "if (nonblocking_init) poll_ready_locked(deadline, what);", "",
                        "init_slow_is_polled", {"NCCLEMU_INIT_DELAY_S": "0.3"}, "FAIL init_slow_is_polled"),
    # the abort run under mu_ (joined at once): a frozen peer holds it, the timeout is never raised
    "abort_under_the_lock": ("cuda/comm.cpp", "  }).detach();\n}", "  }).join();\n}",
                             "abort_held_by_a_frozen_peer_is_bounded", FROZEN_PEER_HOLDS_ABORT,
                             "FAIL abort_held_by_a_frozen_peer_is_bounded"),
    # event queries in the caller's (global) capture mode: another thread's capture is invalidated
    "queries_break_a_capture": ("cuda/comm.cpp", "  RelaxedCapture relaxed;\n", "",
                                "capture_in_another_thread_survives_the_watchdog", {"NCCLEMU_SLOW_COLLECTIVE_S": "0.2"},
                                "the watchdog failed during another thread's capture"),
    # a capturing stream accepted: the collective becomes graph nodes no host wait can see
    "capturing_stream_accepted": ("cuda/comm_collectives.cpp", "  check_not_capturing(after);", "",
                                  "capture_in_another_thread_survives_the_watchdog",
                                  {"NCCLEMU_SLOW_COLLECTIVE_S": "0.2"}, "did not throw"),
    # the destructor waits the communicator's full timeout (600 s) for a dead peer
    "destructor_waits_the_timeout": ("cuda/comm.cpp", "destroy_within(std::min(timeout_s_, kTeardownWaitMaxS));",
                                     "destroy_within(timeout_s_);", "destructor_wait_is_bounded", {"NCCLEMU_HANG": "1:1"},
                                     "FAIL destructor_wait_is_bounded"),
    # pending() queries events with no device guard: a context on cuda:0 from a fresh thread
    "pending_without_guard": ("cuda/comm.cpp", "    cuda::DeviceGuard guard(devices_[0]);  // See Note [Device guard "
                              "without a current context]\n    prune_locked();\n    return ops_.size();",
                              "    prune_locked();\n    return ops_.size();", "no_context_on_a_device_the_comm_does_not_use",
                              {}, "pending made a context on cuda:0"),
    # a sticky CUDA error raised without aborting: destroy() later flushes NCCL on a broken context
    "sticky_error_without_abort": ("cuda/comm.cpp", "        abort_locked(reason);\n        detail::fail<CudaError>",
                                   "        detail::fail<CudaError>", "sticky_cuda_error_aborts",
                                   {"NCCLEMU_SLOW_COLLECTIVE_S": "0.3"}, "left the communicator usable"),
    # destroy() that does not refuse new collectives first: one enqueued meanwhile is destroyed in flight
    "destroy_without_closing": ("cuda/comm.cpp", "    closing_ = true;", "", "destroy_refuses_collectives_enqueued_meanwhile",
                                {"NCCLEMU_SLOW_COLLECTIVE_S": "0.005"}, "FAIL destroy_refuses_collectives_enqueued_meanwhile"),
}
PLANTED_SCENARIOS = [(v[3], v[4]) for v in PLANTED.values()]
QUICK_PLANTED = ("timeout_without_abort",)   # the others (~4 s each) with the slow tests


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK_PLANTED else pytest.mark.slow)
                                  for n in sorted(PLANTED)])
def test_a_planted_defect_fails_the_host_logic(cache, name):
    path, old, new, scenario, env, shows = PLANTED[name]
    r = _run(cache, scenario, env, mutations={path: [(old, new)]})
    assert r.returncode != 0 and shows in r.stdout + r.stderr, _report(r)


# ThreadSanitizer over the mu_ / wait / abort threading: the scenarios where several threads meet on one
# communicator (or a helper thread aborts it), in a build with -fsanitize=thread (the stand-in and the
# emulated runtime are built with it too, so their threads count).
TSAN_CASES = ("several_threads", "abort_ends_a_wait", "abort_held_by_a_frozen_peer", "destroy_vs_enqueue", "peer_hangs",
              "peer_hangs-nonblocking", "sticky_cuda_error", "async_error", "capture_elsewhere", "wait_done_pending",
              "all_reduce_reductions-nonblocking", "init_rank_threads", "no_context_on_gpu0", "peer_skips")


@pytest.mark.slow
@pytest.mark.parametrize("case", TSAN_CASES)
def test_host_logic_under_thread_sanitizer(cache, case):
    scenario, env = {**CASES, **SLOW_CASES}[case]
    r = _run(cache, scenario, env, sanitize="thread")
    assert r.returncode == 0 and f"PASS {scenario}" in r.stdout and "ThreadSanitizer" not in r.stderr, _report(r)


@pytest.mark.slow
def test_a_planted_race_fails_the_thread_sanitizer(cache):
    # aborted() read without mu_ while a timeout aborts on another thread: a data race TSan must report
    lockless = {"cuda/comm.cpp": [("bool NcclComm::aborted() const {\n  std::lock_guard<std::mutex> lock(mu_);\n",
                                   "bool NcclComm::aborted() const {\n")]}
    scenario, env = SLOW_CASES["abort_held_by_a_frozen_peer"]
    r = _run(cache, scenario, env, sanitize="thread", mutations=lockless)
    assert r.returncode != 0 and "ThreadSanitizer: data race" in r.stderr and "NcclComm::aborted" in r.stderr, _report(r)


@pytest.mark.slow
def test_several_ranks_on_one_gpu_with_nccl_2_30(cache):
    # NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 lets a device be listed twice (Note [Several ranks on one
    # GPU] in csrc/cuda/nccl_api.cpp): init_arguments then builds two ranks on cuda:1 and averages over them.
    r = _run(cache, "init_arguments", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, api=23007)
    assert r.returncode == 0 and "PASS init_arguments" in r.stdout, _report(r)


def test_every_communicator_source_is_built_by_the_harness():
    # a new comm*.cpp (or a rename) must reach the emulated build, or its host logic would run nowhere
    on_disk = {f"cuda/{p.name}" for p in (ROOT / "csrc" / "cuda").glob("comm*.cpp")} | {"cuda/nccl_api.cpp"}
    assert on_disk <= set(build_host.PROJECT_SOURCES), sorted(on_disk - set(build_host.PROJECT_SOURCES))
