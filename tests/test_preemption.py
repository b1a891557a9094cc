"""PreemptionCallback's signal handling in-process (the torchrun behaviour is in test_fault_injection.py)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from nxd_lc.lightning.preemption import PreemptionCallback, StartupInterrupted, signal_numbers


@pytest.mark.compat
def test_signal_names_are_checked() -> None:
    assert signal_numbers(["SIGTERM", "SIGUSR1"]) == [signal.SIGTERM, signal.SIGUSR1]
    with pytest.raises(ValueError, match=r"exp_manager.preemption_signals: \['SIGKILL'\] not allowed"):
        signal_numbers(["SIGKILL"])


@pytest.mark.compat
def test_handlers_only_set_a_flag_and_are_restored() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    cb = PreemptionCallback(["SIGTERM", "SIGUSR1", "SIGINT"])
    cb.install()
    # again at on_train_start, after Lightning's connector: the originals are still remembered; from here on a
    # signal only sets the flag (the step boundary acts on it)
    cb.on_train_start(SimpleNamespace(global_step=0), None)  # type: ignore[arg-type]
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # default action would end the process
        assert cb.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        assert cb.received == signal.SIGUSR1  # the first signal is what is reported
        os.kill(os.getpid(), signal.SIGINT)  # first Ctrl-C: a flag
        with pytest.raises(KeyboardInterrupt):  # second Ctrl-C: at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        cb.restore()
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.compat
def test_parent_death_is_a_changed_ppid() -> None:
    cb = PreemptionCallback([])
    assert not cb.parent_died()
    cb._ppid = -1  # as if the launcher that started us were gone
    assert cb.parent_died()


@pytest.mark.compat
def test_a_signal_before_training_starts_stops_at_once() -> None:
    """Before on_train_start (tokenizer training, packing, model build) there is no step boundary to wait for:
    the handler raises StartupInterrupted (a BaseException, so ``except Exception`` does not swallow it), and a
    ``finally`` on the way runs (the cache writers remove their temporary files there)."""
    before = signal.getsignal(signal.SIGTERM)
    cb = PreemptionCallback(["SIGTERM"])
    cb.install()
    cleaned = []
    try:
        with pytest.raises(StartupInterrupted, match="SIGTERM before the first training step") as info:
            try:
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                except Exception:  # noqa: BLE001  (what a careless caller would write)
                    pytest.fail("StartupInterrupted was caught as an Exception")
            finally:
                cleaned.append(True)
        assert info.value.signum == signal.SIGTERM and cb.received == signal.SIGTERM and cleaned == [True]
    finally:
        cb.restore()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.compat
def test_install_outside_the_main_thread_installs_nothing_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    """Python delivers signals to the main thread only (signal.signal raises elsewhere): a run inside another thread
    (a worker thread, the multi-device XLA test bed's device threads) keeps the handlers it found, warns once and
    still votes at step boundaries, as Lightning's signal connector does."""
    import threading

    before = signal.getsignal(signal.SIGTERM)
    cb = PreemptionCallback(["SIGTERM"])
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cb.install()
            cb.on_train_start(SimpleNamespace(global_step=0), None)  # type: ignore[arg-type]
            cb.restore()
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            errors.append(e)

    with caplog.at_level("WARNING", logger="nxd_lc.lightning.preemption"):
        t = threading.Thread(target=run, name="worker")
        t.start()
        t.join()
    assert errors == [] and signal.getsignal(signal.SIGTERM) == before
    warnings = [r.getMessage() for r in caplog.records if "not installed" in r.getMessage()]
    assert len(warnings) == 1 and "'worker'" in warnings[0], warnings
    assert cb.owns_sigterm and not PreemptionCallback(["SIGUSR1"]).owns_sigterm
