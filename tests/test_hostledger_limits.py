"""gpubudget.hostledger.limits: the limits a pod, an MPS client, a HAMi container, a cgroup's
``dmem`` partition or NVML set on a device, read from variables and files the tests make;
and the ledger sizing shares and checking limits within the smallest, saying which, in its
file, in ``gpubudget top`` and in the refusal."""

from __future__ import annotations

import contextvars
import types
from pathlib import Path
from typing import Any

import pytest

from gpubudget import Budget, gpu_budget, use
from gpubudget.backends import HostBackend
from gpubudget.cli.top import render
from gpubudget.hostledger import LedgerDevice, LedgerError, host_view, limits
from gpubudget.hostledger.limits import HAMI_ENV, MPS_ENV, OutsideLimit, Where, outside_limits
from gpubudget.units import GiB, MiB
from tests.test_hostledger_claims import Worker, workers  # noqa: F401 - a fixture

TOTAL = 8 * GiB
UUID = "GPU-8f3c0000-1111-2222-3333-444455556666"
PCI = "0000:03:00.0"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ledger of the test's own, the host backend as an 8 GiB GPU, no limit from the
    machine the tests run on, and no cgroup but the tests' own."""
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "8GiB")
    monkeypatch.delenv("GPUBUDGET_DEVICE_CAP", raising=False)
    for name in (MPS_ENV, HAMI_ENV, f"{HAMI_ENV}_0", f"{HAMI_ENV}_1"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(limits, "where", Where(cgroup_root=tmp_path / "no-cgroup",
                                               proc_cgroup=tmp_path / "no-proc-cgroup",
                                               nvml=types.SimpleNamespace()))


def read(ordinal: int | None, **environ: str) -> list[tuple[int, str]]:
    return [(limit.nbytes, limit.name)
            for limit in outside_limits(ordinal, where=Where(environ=environ))]


# -- the environment variables ---------------------------------------------------------------


def test_mps_limits_one_device_or_all() -> None:
    assert read(0, **{MPS_ENV: "0=1G,1=512M"}) == [(GiB, MPS_ENV)]
    assert read(1, **{MPS_ENV: "0=1G, 1=512M"}) == [(512 * MiB, MPS_ENV)]
    assert read(2, **{MPS_ENV: "0=1G,1=512M"}) == []
    assert read(3, **{MPS_ENV: "2G"}) == [(2 * GiB, MPS_ENV)]
    assert read(None, **{MPS_ENV: "2G"}) == [(2 * GiB, MPS_ENV)]  # no ordinal: every device
    assert read(None, **{MPS_ENV: "0=2G"}) == []


@pytest.mark.parametrize("text, nbytes", [
    ("1073741824", GiB), ("1024m", GiB), ("1g", GiB), ("1GB", GiB), ("1.5G", 3 * GiB // 2),
    ("1GiB", GiB), ("4096 K", 4 * MiB), ("1T", 1024 * GiB), ("2 GiB", 2 * GiB),
])
def test_sizes_are_read_as_mps_and_hami_write_them(text: str, nbytes: int) -> None:
    assert read(0, **{HAMI_ENV: text}) == [(nbytes, HAMI_ENV)]


def test_hami_limits_every_device_and_one_by_its_ordinal() -> None:
    environ = {HAMI_ENV: "10g", f"{HAMI_ENV}_1": "3g"}
    assert read(1, **environ) == [(10 * GiB, HAMI_ENV), (3 * GiB, f"{HAMI_ENV}_1")]
    assert read(0, **environ) == [(10 * GiB, HAMI_ENV)]


@pytest.mark.parametrize("name, text, message", [
    (MPS_ENV, "lots", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='lots': not a size"),
    (MPS_ENV, "0=1G,one=2G", "'one=2G' is not '<device ordinal>=<size>'"),
    (MPS_ENV, "0=1G,1=much", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0=1G,1=much': not a size"),
    (MPS_ENV, "1=1G,3=much", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='1=1G,3=much': not a size"),
    (HAMI_ENV, "-1g", "CUDA_DEVICE_MEMORY_LIMIT='-1g': not a size"),
])
def test_a_bad_value_is_an_error_naming_the_variable(name: str, text: str, message: str
                                                     ) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        outside_limits(1, where=Where(environ={name: text}))


# -- the cgroup's dmem files -----------------------------------------------------------------


def cgroup(tmp_path: Path, own: str, files: dict[str, str]) -> Where:
    """A cgroup v2 tree under ``tmp_path``: this process in ``own``, ``dmem.max`` files
    written in the cgroups named."""
    root = tmp_path / "cgroup"
    (root / own).mkdir(parents=True)
    for name, text in files.items():
        (root / name / "dmem.max").write_text(text, encoding="utf-8")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::/{own}\n", encoding="utf-8")
    return Where(environ={}, cgroup_root=root, proc_cgroup=proc)


def test_dmem_max_of_the_own_cgroup_and_those_above_it(tmp_path: Path) -> None:
    where = cgroup(tmp_path, "kubepods/pod1/ctr", {
        "kubepods/pod1": f"drm/{PCI}/vram0 4294967296\ndrm/0000:04:00.0/vram0 1073741824\n",
        "kubepods/pod1/ctr": f"drm/{PCI}/vram0 max\n",
        "kubepods": f"drm/{PCI}/vram0 6442450944\n"})
    found = outside_limits(0, pci_bus_id=PCI, where=where)
    assert [(limit.nbytes, limit.name) for limit in found] == [(4 * GiB, "dmem.max"),
                                                               (6 * GiB, "dmem.max")]
    assert str(tmp_path / "cgroup/kubepods/pod1/dmem.max") in found[0].source
    assert f"drm/{PCI}/vram0" in found[0].source
    # the bus id as NVML writes it (8-digit domain), and a region named by the UUID
    assert len(outside_limits(0, pci_bus_id="00000000:03:00.0", where=where)) == 2
    by_uuid = cgroup(tmp_path / "u", "ctr", {"ctr": f"nvidia/{UUID} 2147483648\n"})
    assert [limit.nbytes for limit in outside_limits(0, uuid=UUID, where=by_uuid)] == [2 * GiB]
    assert outside_limits(0, pci_bus_id="0000:05:00.0", where=where) == []


def test_without_a_cgroup_v2_or_its_files_there_is_no_dmem_limit(tmp_path: Path) -> None:
    assert outside_limits(0, pci_bus_id=PCI, where=cgroup(tmp_path, "a", {})) == []
    proc = tmp_path / "v1"
    proc.write_text("12:memory:/docker/abc\n", encoding="utf-8")
    assert outside_limits(0, pci_bus_id=PCI, where=Where(
        environ={}, cgroup_root=tmp_path, proc_cgroup=proc)) == []


def test_a_damaged_dmem_file_is_an_error_naming_it(tmp_path: Path) -> None:
    where = cgroup(tmp_path, "pod", {"pod": f"drm/{PCI}/vram0 lots\n"})
    with pytest.raises(ValueError, match=r"dmem\.max: 'drm/0000:03:00.0/vram0 lots'"):
        outside_limits(0, pci_bus_id=PCI, where=where)


# -- NVML ------------------------------------------------------------------------------------


def fake_nvml(hard: int | None) -> Any:
    """The names of nvidia-ml-py 13.615 for memory limits (below it: no driver here)."""
    class Limits:
        nameSpace, softLimit, hardLimit, currentUsed = None, 0, 0, 0

    def get_limits(handle: str, limits: Limits) -> None:
        assert handle == f"handle of {UUID}"
        if hard is None:
            raise RuntimeError("NVMLError_NotSupported")
        limits.hardLimit = hard

    return types.SimpleNamespace(
        nvmlDeviceGetHandleByUUID=lambda uuid: f"handle of {uuid}",
        nvmlDeviceGetMemoryLimits_v1=get_limits, c_nvmlGetMemoryLimits_v1_t=Limits,
        NVML_DEVICE_MEMORY_LIMIT_MAX=2**64 - 1)


def test_nvmls_hard_limit_where_the_binding_and_driver_have_one() -> None:
    def ask(nvml: Any) -> list[int]:
        return [limit.nbytes for limit in outside_limits(
            0, uuid=UUID, where=Where(environ={}, nvml=nvml))]

    assert ask(fake_nvml(3 * GiB)) == [3 * GiB]
    assert ask(fake_nvml(2**64 - 1)) == []  # no limit
    assert ask(fake_nvml(None)) == []  # not supported by the driver
    assert ask(types.SimpleNamespace()) == []  # a binding without them


# -- the ledger sizing within them -----------------------------------------------------------


def root(limit: str, name: str, backend: object = "host") -> tuple[Budget, contextvars.Context]:
    budget = gpu_budget(limit, name=name, backend=backend)  # type: ignore[arg-type]
    context = contextvars.Context()
    context.run(budget.__enter__)
    return budget, context


def leave(budget: Budget, context: contextvars.Context) -> None:
    context.run(budget.__exit__, None, None, None)


def test_a_share_in_a_limited_pod_is_sized_from_the_limit_and_top_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HAMI_ENV, "2g")
    half, context = root("50%", "half")
    assert half.limit == GiB  # half of the 2 GiB the container may use, not of 8 GiB
    assert half.report().limited_by == "CUDA_DEVICE_MEMORY_LIMIT='2g' (2.00 GiB)"
    assert "sized within the limit CUDA_DEVICE_MEMORY_LIMIT='2g' (2.00 GiB)" in str(
        half.report())
    with use(half), gpu_budget("256MiB", name="child") as child:  # a child: not sized so
        assert child.parent is half and child.report().limited_by is None
    device = host_view(nvml=False).devices[0]
    assert (device.total, device.limit, device.limited_by) == (TOTAL, 2 * GiB, HAMI_ENV)
    assert device.as_dict()["limit"] == 2 * GiB
    text = "\n".join(render(host_view(nvml=False)))
    assert f"limit 2.00 GiB ({HAMI_ENV})" in text and "unclaimed 1.00 GiB" in text
    with pytest.raises(LedgerError, match=r"the limit CUDA_DEVICE_MEMORY_LIMIT='2g' is "
                                          r"2\.00 GiB, 1\.00 GiB of it claimed, 1\.00 GiB "
                                          r"left"):
        root("1.5GiB", "big")
    rest, other = root("rest", "rest")
    assert rest.limit == GiB
    leave(rest, other)
    leave(half, context)
    monkeypatch.delenv(HAMI_ENV)
    again, context = root("50%", "unlimited")  # the limit gone: of the device again
    assert again.limit == TOTAL // 2 and again.report().limited_by is None
    assert host_view(nvml=False).devices[0].limit is None
    leave(again, context)


def test_a_limit_above_the_device_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MPS_ENV, "16G")
    budget, context = root("50%", "half")
    assert budget.limit == TOTAL // 2 and host_view(nvml=False).devices[0].limit is None
    leave(budget, context)


def test_an_mps_limit_counts_this_process_only(monkeypatch: pytest.MonkeyPatch,
                                               workers: list[Worker]) -> None:  # noqa: F811
    other = Worker()
    workers.append(other)
    assert other.ask("enter 4GiB elsewhere") == f"ok {4 * GiB}"  # another MPS client
    monkeypatch.setenv(MPS_ENV, "3G")
    first, context = root("1GiB", "first")
    rest, other_context = root("rest", "rest")
    assert rest.limit == 2 * GiB  # 3 GiB less this process's 1 GiB; not less the other's
    leave(rest, other_context)
    leave(first, context)
    monkeypatch.setenv(MPS_ENV, "0=3G")  # by ordinal: the host backend has none
    monkeypatch.setenv(HAMI_ENV, "6G")  # a container's: every process's claims count
    shared, context = root("rest", "shared")
    assert shared.limit == 2 * GiB  # 6 GiB less the other process's 4 GiB
    leave(shared, context)


class LimitedGpu(HostBackend):
    """Device 0 of the ledger, a GPU with a UUID and a PCI bus id (in host memory)."""

    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice(UUID, "a GPU", TOTAL, hard=False, ordinal=0, pci_bus_id=PCI)


def test_a_gpus_dmem_partition_and_nvml_limit_size_its_shares(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    where = cgroup(tmp_path, "pod/ctr", {"pod": f"drm/{PCI}/vram0 {5 * GiB}\n"})
    monkeypatch.setattr(limits, "where", Where(cgroup_root=where.cgroup_root,
                                               proc_cgroup=where.proc_cgroup,
                                               nvml=fake_nvml(4 * GiB)))
    budget, context = root("rest", "rest", LimitedGpu())
    assert budget.limit == 4 * GiB  # NVML's 4 GiB under dmem.max's 5 GiB
    device = host_view(nvml=False).devices[0]
    assert (device.limit, device.limited_by) == (4 * GiB, "NVML")
    leave(budget, context)
    monkeypatch.setattr(limits, "where", Where(cgroup_root=where.cgroup_root,
                                               proc_cgroup=where.proc_cgroup,
                                               nvml=types.SimpleNamespace()))
    budget, context = root("50%", "half", LimitedGpu())
    assert budget.limit == 5 * GiB // 2
    assert host_view(nvml=False).devices[0].limited_by == "dmem.max"
    leave(budget, context)


def test_a_bad_limit_is_an_error_at_entry_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MPS_ENV, "0=")
    with pytest.raises(ValueError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0='"):
        with gpu_budget("1GiB", backend="host"):
            pass


def test_the_text_of_a_limit() -> None:
    assert OutsideLimit(GiB, "x='1g'", "x").text == "x='1g' (1.00 GiB)"
