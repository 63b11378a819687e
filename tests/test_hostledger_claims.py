"""gpubudget.hostledger.claims: roots register, are sized and capped atomically across
processes, release their claim when they fail or end (``kill -9`` included), and a forked
child never writes its parent's slots."""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import Budget, BudgetError, gpu_budget
from gpubudget.backends import HostBackend
from gpubudget.backends.host import HostReservation
from gpubudget.hostledger import LedgerDevice, LedgerError, claims, host_view, procs
from gpubudget.hostledger.layout import slot_word
from gpubudget.hostledger.sizing import HEADROOM
from gpubudget.units import GiB, MiB
from tests.helpers import RecordingBackend, subprocess_env

TOTAL = 8 * GiB

WORKER = f"{os.path.basename(sys.executable)} -m tests.ledger_worker"
"""How the worker processes look in the ledger: the program without its directory (``python``
in a virtual environment, ``python3`` elsewhere), then its arguments."""


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ledger of the test's own, and the host backend as an 8 GiB GPU."""
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "8GiB")
    monkeypatch.delenv("GPUBUDGET_DEVICE_CAP", raising=False)


class Worker:
    """Another process holding roots on command (tests/ledger_worker.py)."""

    def __init__(self, **env: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.ledger_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=subprocess_env(**env))
        self.pid = self.process.pid

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def answer(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def ask(self, command: str) -> str:
        self.send(command)
        return self.answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def root(limit: str, name: str, backend: object = "host") -> tuple[Budget, contextvars.Context]:
    """A root entered in a context of its own (as in another thread or task)."""
    budget = gpu_budget(limit, name=name, backend=backend)  # type: ignore[arg-type]
    context = contextvars.Context()
    context.run(budget.__enter__)
    return budget, context


def leave(budget: Budget, context: contextvars.Context) -> None:
    context.run(budget.__exit__, None, None, None)


def test_a_root_registers_at_entry_and_is_gone_when_it_releases() -> None:
    with gpu_budget("1GiB", name="model") as model:
        (entry,) = host_view(nvml=False).entries
        assert (entry.name, entry.pid, entry.limit, entry.claim, entry.reserved, entry.state,
                entry.share) == ("model", os.getpid(), GiB, GiB, GiB, "reserved", None)
        with gpu_budget("1MiB", name="child"):  # children share their root's slot
            assert len(host_view(nvml=False).entries) == 1
        assert model.used == 0
    assert host_view(nvml=False).entries == ()


def test_shares_are_sized_at_entry_from_what_is_unclaimed() -> None:
    half, half_context = root("50%", "half")
    rest, rest_context = root("rest - 1GiB", "rest")
    assert (half.limit, rest.limit) == (4 * GiB, 3 * GiB)
    shares = {entry.name: entry.share for entry in host_view(nvml=False).entries}
    assert shares == {"half": 0.5, "rest": 1.0}
    more, more_context = root("rest", "more")
    assert more.limit == GiB
    with pytest.raises(LedgerError, match=r"budget 'none' cannot claim 'rest' of host memory "
                       r"\(a simulated GPU of 8.00 GiB\): the device has 8.00 GiB, 8.00 GiB "
                       r"of it claimed, 0 B left: 'rest' is 100% of it, nothing; held by pid "
                       r"\d+ \(.*\) 'half' 4.00 GiB, pid \d+ .* 'rest' 3.00 GiB, pid .*'more'"):
        root("rest", "none")
    leave(more, more_context)
    leave(rest, rest_context)
    leave(half, half_context)


def test_a_share_as_a_child_or_without_a_ledger_is_an_error(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    with gpu_budget("1GiB", name="pool"):
        with pytest.raises(ValueError, match="budget 'half' was given limit '50%', a share of "
                           "a device's unclaimed memory, but is entered inside 'pool'"):
            gpu_budget("50%", name="half").__enter__()
    with pytest.raises(LedgerError, match=r"budget 'half' asks for a share \('50%'\) of a "
                       r"device's memory, and the host backend's memory \(<tests.helpers."
                       r"RecordingBackend .*\) is not a device the host ledger knows"):
        gpu_budget("50%", name="half", backend=RecordingBackend()).__enter__()
    monkeypatch.setenv("GPUBUDGET_DEVICE_CAP", "1GiB")  # caps devices the ledger knows only
    with gpu_budget("2GiB", name="elsewhere", backend=RecordingBackend()):
        assert host_view(nvml=False).entries == ()
    monkeypatch.delenv("GPUBUDGET_DEVICE_CAP")
    monkeypatch.setenv("GPUBUDGET_LEDGER", "0")
    with pytest.raises(LedgerError, match=r"budget 'half' asks for a share \('50%'\), which "
                       r"needs the host ledger, and GPUBUDGET_LEDGER=0 turns the host ledger off"):
        gpu_budget("50%", name="half").__enter__()
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY")
    with gpu_budget("1GiB", name="unregistered"):
        assert host_view(nvml=False).entries == ()


def test_an_unusable_ledger_warns_once_for_plain_roots_and_refuses_what_needs_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY")  # a host that enforces nothing itself
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "link"))
    monkeypatch.setattr(claims, "_warned", set())
    with pytest.warns(RuntimeWarning, match="root budgets are not registered in the host "
                      "ledger: cannot open the ledger directory '.*link': it is a symbolic"):
        with gpu_budget("1MiB"):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gpu_budget("1MiB"):  # once only
            pass
    with pytest.raises(LedgerError, match="it is a symbolic link"):
        gpu_budget("50%").__enter__()
    assert os.listdir(tmp_path / "real") == []


class RefusingBackend(HostBackend):
    """An 8 GiB device of the ledger that cannot reserve more than 1 GiB at a time (as a GPU
    that other programs filled)."""

    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice("GPU-full", "a full GPU", TOTAL, hard=False)

    def reserve(self, nbytes: int) -> HostReservation:
        if nbytes > GiB:
            raise MemoryError("out of memory")
        return super().reserve(nbytes)


def test_a_root_that_cannot_reserve_releases_its_claim_and_names_the_holders() -> None:
    backend = RefusingBackend()
    detector, context = root("1GiB", "detector", backend)
    with pytest.raises(BudgetError, match=r"budget 'late' could not reserve 2.00 GiB from the "
                       r"host backend .*: MemoryError: out of memory \(on a full GPU "
                       r"\(GPU-full\); held by pid \d+ .*'detector' 1.00 GiB\)"):
        root("2GiB", "late", backend)
    assert [entry.name for entry in host_view(nvml=False).entries] == ["detector"]
    leave(detector, context)


def test_a_root_opens_in_one_direction_its_limit_decided_once_its_account_made_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger decides the limit, once; then the core makes the root's account, once, with
    that limit, and reserves it; then the slot is marked reserved with the root's numbers."""
    from gpubudget._core import ledger
    from gpubudget._core import node as node_module
    from gpubudget.hostledger import sizing

    made: list[tuple[object, ...]] = []
    decided: list[object] = []
    account, decide = ledger.Account, sizing.decide

    def counted_account(*args: Any) -> Any:
        made.append(args)
        return account(*args)

    def counted_decide(*args: Any, **kwargs: Any) -> Any:
        decision = decide(*args, **kwargs)
        decided.append(decision.nbytes)
        return decision

    half = gpu_budget("50%", name="half")  # its account before entry: what it asked for
    monkeypatch.setattr(node_module, "Account", counted_account)
    monkeypatch.setattr(claims, "decide", counted_decide)
    with half:
        assert (made, decided, half.limit) == ([("half", 4 * GiB)], [4 * GiB], 4 * GiB)
        block = half.allocate("1MiB", raise_on_denial=True)
        (entry,) = host_view(nvml=False).entries
        assert (entry.name, entry.limit, entry.reserved, entry.state, entry.used) == (
            "half", 4 * GiB, 4 * GiB, "reserved", MiB)
        half.free(block)
    assert host_view(nvml=False).entries == ()


def test_a_slot_let_go_before_its_root_is_written_no_more() -> None:
    """At interpreter exit the slots go before the roots do (``atexit``): a root still used
    then (by a daemon thread) must not store into a slot that another process may claim."""
    others = set(claims._claims)  # claims of roots that earlier tests still hold
    with gpu_budget("1GiB", name="late", initial=0) as late:  # growable: its mapped word too
        (claim,) = set(claims._claims) - others
        words = claim.book.words
        at = [slot_word(claim.slot, "used") + i for i in range(3)]
        at.append(slot_word(claim.slot, "reserved"))
        claim.release()
        before = [words[i] for i in at]
        block = late.allocate("64MiB", raise_on_denial=True)
        assert late.allocate("2GiB") is None and late.mapped
        assert [words[i] for i in at] == before
        assert late.free(block)


def test_kill_9_of_a_holder_frees_its_entry_for_the_next_process(workers: list[Worker]) -> None:
    holder, late = Worker(), Worker()
    workers += [holder, late]
    assert holder.ask("enter 6GiB trainer") == f"ok {6 * GiB}"
    refused = late.ask("enter 4GiB server")
    assert refused.startswith("denied budget 'server' cannot claim 4.00 GiB on host memory")
    assert f"held by pid {holder.pid} ({WORKER}) 'trainer' 6.00 GiB" \
        in refused
    holder.process.kill()  # SIGKILL: no exit handler, no release
    holder.process.wait()
    assert late.ask("enter 4GiB server") == f"ok {4 * GiB}"
    (entry,) = host_view(nvml=False).entries
    assert (entry.pid, entry.name) == (late.pid, "server")


def test_processes_sizing_themselves_at_the_same_instant_never_overlap(
        workers: list[Worker]) -> None:
    team = [Worker() for _ in range(3)]
    workers += team
    for round_ in range(100):
        spec = "50%" if round_ % 2 else "rest"
        at = time.time() + 0.05
        for index, worker in enumerate(team):
            worker.send(f"enter {spec} w{index} {at}")
        answers = [worker.answer() for worker in team]
        granted = sorted(int(answer.split()[1]) for answer in answers if answer.startswith("ok"))
        claimed = sum(entry.holds for entry in host_view(nvml=False).entries)
        if spec == "50%":  # each took half of what the ones before it left
            assert granted == [GiB, 2 * GiB, 4 * GiB], answers
        else:  # the first took everything; the others were told who holds it
            assert granted == [TOTAL], answers
            assert sum("denied" in answer and "'rest' is 100% of it, nothing" in answer
                       for answer in answers) == 2, answers
        assert claimed == sum(granted) <= TOTAL
        for worker in team:
            assert worker.ask("exit") == "ok"
    assert host_view(nvml=False).entries == ()


def test_the_cap_holds_across_processes(workers: list[Worker]) -> None:
    first, second = Worker(GPUBUDGET_DEVICE_CAP="6GiB"), Worker(GPUBUDGET_DEVICE_CAP="75%")
    workers += [first, second]
    assert first.ask("enter 4GiB a") == f"ok {4 * GiB}"
    denied = second.ask("enter 3GiB b")
    assert denied.startswith("denied budget 'b' cannot claim 3.00 GiB on host memory (a "
                             "simulated GPU of 8.00 GiB): the device cap is 6.00 GiB, "
                             "4.00 GiB of it claimed, 2.00 GiB left; held by pid "
                             f"{first.pid} ({WORKER}) 'a' 4.00 GiB")
    assert second.ask("enter 2GiB b") == f"ok {2 * GiB}"
    assert second.ask("enter 50% c").startswith("denied")  # nothing left under the cap
    from gpubudget.hostledger import set_device_cap

    assert second.ask("exit") == "ok"
    set_device_cap("5GiB", backend="host")  # for every process, with or without the variable
    third = Worker()
    workers.append(third)
    assert third.ask("enter 2GiB d").startswith("denied budget 'd' cannot claim 2.00 GiB on "
                                                "host memory (a simulated GPU of 8.00 GiB): "
                                                "the device cap is 5.00 GiB")
    assert third.ask("enter 50% d") == f"ok {GiB // 2}"
    set_device_cap(None, backend="host")
    assert third.ask("enter 2GiB e") == f"ok {2 * GiB}"


def test_a_bad_cap_is_an_error_at_entry_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUBUDGET_DEVICE_CAP", "lots")
    with pytest.raises(ValueError, match="GPUBUDGET_DEVICE_CAP='lots'"):
        gpu_budget("1GiB").__enter__()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_forked_child_never_writes_its_parents_slot() -> None:
    with gpu_budget("64MiB", name="parent") as parent:
        assert parent.allocate(MiB) is not None
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its copy of the budget must not reach the parent's slot
            try:
                parent.allocate(32 * MiB)
                mine, _ = root("16MiB", "child")  # a root of the child's own: registered
                mine.allocate(MiB)
                names = sorted((e.name, e.pid == os.getpid())
                               for e in host_view(nvml=False).entries)
                os.write(write, repr(names).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as answer:
            seen = answer.read()
        assert seen == "[('child', True), ('parent', False)]"
        ((name, used),) = [(e.name, e.used) for e in host_view(nvml=False).entries]
        assert (name, used) == ("parent", MiB)


class SlowGpu(HostBackend):
    """A GPU whose free memory is what its reservations left, and whose reservations take a
    while (as ``cuMemAlloc`` of many GiB does) after the memory is gone."""

    def __init__(self) -> None:
        super().__init__(noreserve=True)
        self.taken = 0
        self.reserving = threading.Event()
        self.lock = threading.Lock()

    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice("GPU-slow", "a slow GPU", TOTAL, hard=False, free=self.free)

    def free(self) -> int:
        with self.lock:
            return TOTAL - self.taken

    def reserve(self, nbytes: int) -> HostReservation:
        with self.lock:
            self.taken += nbytes  # gone from the device's free memory now...
        self.reserving.set()
        time.sleep(0.3)  # ...while the claim is not yet marked reserved
        return super().reserve(nbytes)


def test_a_share_waits_for_reservations_under_way_instead_of_counting_them_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims, "SETTLE_SECONDS", 600.0)  # however slow the machine: waited for
    gpu = SlowGpu()
    first: list[tuple[Budget, contextvars.Context]] = []
    thread = threading.Thread(target=lambda: first.append(root("50%", "first", gpu)))
    thread.start()
    assert gpu.reserving.wait(120)
    second, context = root("50%", "second", gpu)  # its free-memory reading already lacks 'first'
    thread.join()
    first_limit = (TOTAL - HEADROOM) // 2  # a GPU's share leaves the headroom
    assert (first[0][0].limit, second.limit) == (
        first_limit, (TOTAL - first_limit - HEADROOM) // 2)  # not 50% of (8 - 4 - 4)
    leave(second, context)
    leave(*first[0])


def test_a_claim_that_never_settles_is_counted_as_taken(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(claims, "SETTLE_SECONDS", 0.3)
    gpu = SlowGpu()
    book = claims.book_for(gpu.ledger_device())
    me = procs.myself()
    with book.current():  # a process that claimed 2 GiB and is stuck before reserving
        book.claim({"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot,
                    "claim": 2 * GiB}, "stuck", "me")
    started = time.monotonic()
    half, context = root("50%", "half", gpu)
    assert time.monotonic() - started >= 0.3
    assert half.limit == (6 * GiB - HEADROOM) // 2  # half of the 8 GiB free less the 2 GiB
    # it may take and the headroom
    leave(half, context)


class DriverLikeGpu(HostBackend):
    """A GPU whose free memory is what its reservations and its "context" left, and whose
    driver, like CUDA's, cannot hand out all of what it calls free in one allocation (on an
    H200 the most one ``cuMemAlloc`` got was the free memory less 3 to 4 MiB)."""

    DRIVER_KEEPS = 4 * MiB

    def __init__(self, free: int) -> None:
        super().__init__(noreserve=True)
        self.free_bytes = free

    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice("GPU-driver-like", "a GPU", TOTAL, hard=False,
                            free=lambda: self.free_bytes)

    def reserve(self, nbytes: int) -> HostReservation:
        if nbytes > self.free_bytes - self.DRIVER_KEEPS:
            raise MemoryError(f"out of memory ({nbytes} asked, {self.free_bytes} free)")
        self.free_bytes -= nbytes
        return _Counted(self, nbytes)  # type: ignore[return-value]


class _Counted:
    """A reservation of :class:`DriverLikeGpu` whose release gives its bytes back."""

    def __init__(self, gpu: DriverLikeGpu, nbytes: int) -> None:
        self._gpu = gpu
        self._inner: HostReservation | None = HostReservation(nbytes, noreserve=True)
        self.address = self._inner.address
        self.nbytes = nbytes

    def release(self) -> None:
        if self._inner is not None:
            self._inner.release()
            self._inner = None
            self._gpu.free_bytes += self.nbytes


def test_rest_on_a_gpu_after_fixed_shares_enters_and_leaves_the_headroom() -> None:
    gpu = DriverLikeGpu(free=TOTAL - 300 * MiB)  # a CUDA context holds some already
    shares = [root("25%", "a", gpu), root("25%", "b", gpu)]
    rest, context = root("rest", "rest", gpu)  # the driver would refuse all of the free memory
    assert HEADROOM <= gpu.free_bytes < HEADROOM + MiB  # what the docs say it leaves
    block = rest.allocate(rest.limit)
    assert block is not None and rest.free(block)
    leave(rest, context)
    for budget, entered in reversed(shares):
        leave(budget, entered)
    assert gpu.free_bytes == TOTAL - 300 * MiB


def test_the_headroom_can_be_set_and_is_never_taken_from_a_plain_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = DriverLikeGpu(free=4 * GiB)
    monkeypatch.setenv("GPUBUDGET_HEADROOM", "1GiB")
    rest, context = root("rest - 512MiB", "rest", gpu)
    assert rest.limit == 4 * GiB - GiB - 512 * MiB
    leave(rest, context)
    half, context = root("50%", "half", gpu)
    assert half.limit == (4 * GiB - GiB) // 2
    leave(half, context)
    plain, context = root(f"{4 * GiB - 8 * MiB}B", "plain", gpu)  # the device answers for it
    assert plain.limit == 4 * GiB - 8 * MiB and gpu.free_bytes == 8 * MiB
    with pytest.raises(LedgerError, match=r"cannot claim '1%' of a GPU \(GPU-driver-like\): "
                       r"the device has 8.00 MiB free of 8.00 GiB total, less 1.00 GiB of "
                       r"headroom, 0 B left"):
        root("1%", "nothing", gpu)
    leave(plain, context)
    for value, message in (("lots", r"GPUBUDGET_HEADROOM='lots'.* is not a size"),
                           ("1MiB", r"GPUBUDGET_HEADROOM='1MiB' is less than 8.00 MiB")):
        monkeypatch.setenv("GPUBUDGET_HEADROOM", value)
        with pytest.raises(ValueError, match=message):
            root("rest", "bad", gpu)
    assert host_view(nvml=False).entries == ()


@pytest.mark.parametrize("limit", [2**63, 2**64, 10**400])
def test_a_root_past_what_a_slot_holds_is_refused_clearly(limit: int) -> None:
    with pytest.raises(LedgerError, match="cannot claim .* more than any device holds") as info:
        with gpu_budget(limit, name="vast", backend="host"):
            pass  # pragma: no cover - refused at entry
    assert isinstance(info.value, BudgetError) and "'vast'" in str(info.value)
    assert not [entry for entry in host_view(nvml=False).entries if entry.name == "vast"]
