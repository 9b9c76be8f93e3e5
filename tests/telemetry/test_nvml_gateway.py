"""collectors/nvml.py against a fake libnvidia-ml.so.1 (C, NVML's return codes and struct layouts).

pynvml itself loads the fake and calls it through ctypes, so everything above the C ABI is the
production path. Expected numbers are computed here from what the fake was told, not from the code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from telemetry_helpers import NVML_VALUE_NOT_AVAILABLE, Child, FakeNvml

from moescope.collectors import nvml
from moescope.collectors.nvml import NA, NO_DRIVER_LINE, NvmlCollector, NvmlGateway, is_na, open_nvml

REPO = Path(__file__).resolve().parents[2]
T0_US = 1_700_000_000_000_000
GIB = 1 << 30
MIB = 1 << 20


def _collector(*, target_pid: int | None = None) -> NvmlCollector:
    collector = open_nvml(target_pid=target_pid)
    assert collector is not None, "the fake NVML should initialise"
    return collector


def test_na_prints_na_and_computes_nan() -> None:
    assert str(NA) == "N/A" and repr(NA) == "N/A"
    assert f"{NA:>8.1f}" == "     N/A"
    assert math.isnan(float(NA)) and math.isnan(NA + 1) and math.isnan(2 * NA) and math.isnan(NA / 3)
    assert not NA and not (NA > 0) and not (NA < 0)
    assert NA == nvml.NotAvailable("other reason")


def test_lazy_init_and_several_gpus(fake_nvml: FakeNvml) -> None:
    fake_nvml.reset(3)
    for i in range(3):
        fake_nvml.set_memory(i, total=(80 + i) * GIB, reserved=(i + 1) * 256 * MIB, used=(10 + i) * GIB)
        fake_nvml.set_utilization(i, gpu_percent=10 * i + 5, mem_percent=i + 1)
    gateway = NvmlGateway()
    collector = NvmlCollector(gateway)
    assert fake_nvml.init_calls == 0, "NVML must not be initialised before the first sample"
    try:
        sample = collector.collect()
        collector.collect()
        assert fake_nvml.init_calls == 1
        assert [g.index for g in sample.gpus] == [0, 1, 2]
        for i, g in enumerate(sample.gpus):
            total, reserved, used = (80 + i) * GIB, (i + 1) * 256 * MIB, (10 + i) * GIB
            assert g.name == "Fake H100 80GB HBM3"
            assert g.uuid == f"GPU-fa4e0000-0000-0000-0000-00000000000{i}"
            assert g.memory_api == "v2"
            assert (g.memory_total_bytes, g.memory_reserved_bytes, g.memory_used_bytes) == (total, reserved, used)
            assert g.memory_free_bytes == total - reserved - used
            assert g.memory_in_use_bytes == reserved + used
            assert (g.utilization_gpu_percent, g.utilization_memory_percent) == (10 * i + 5, i + 1)
            assert g.nvlink_link_count == 0 and g.nvlinks == ()
        assert sample.lost_gpus == ()
        # No target: the fullest GPU is the signal. GPU 2: (0.75 GiB + 12 GiB) / 82 GiB.
        signal = sample.memory_signal()
        assert signal is not None and signal.source == "nvml" and signal.scope.startswith("GPU 2 ")
        assert signal.used_bytes == 3 * 256 * MIB + 12 * GIB and signal.total_bytes == 82 * GIB
        assert signal.ratio == pytest.approx((0.75 + 12) / 82)
    finally:
        collector.close()


def test_nvlink_per_link_rates_supported_and_unsupported(fake_nvml: FakeNvml) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_links(0, 4)
    fake_nvml.set_link(0, 2, supported=False)
    fake_nvml.set_clock_us(T0_US)
    for link in (0, 1, 3):
        fake_nvml.set_link(0, link, tx_kib=1000 * (link + 1), rx_kib=500)
    collector = _collector()
    try:
        first = collector.collect()
        g0 = first.gpus[0]
        assert g0.nvlink_link_count == 4 and [link.link for link in g0.nvlinks] == [0, 1, 2, 3]
        assert all(is_na(link.tx_bytes_per_s) for link in g0.nvlinks), "no rate before a second reading"
        assert g0.nvlinks[1].tx_total_bytes == 2000 * 1024
        # 200 ms later (NVML's timestamps): link 0 sent 2048 KiB, link 1 received 100 KiB, link 3 idle.
        fake_nvml.set_clock_us(T0_US + 200_000)
        fake_nvml.set_link(0, 0, tx_kib=1000 + 2048, rx_kib=500)
        fake_nvml.set_link(0, 1, tx_kib=2000, rx_kib=500 + 100)
        fake_nvml.set_link(0, 3, tx_kib=4000, rx_kib=500)
        g0 = collector.collect().gpus[0]
        links = {link.link: link for link in g0.nvlinks}
        assert links[0].supported and links[0].tx_bytes_per_s == 2048 * 1024 / 0.2
        assert links[0].rx_bytes_per_s == 0.0
        assert links[1].rx_bytes_per_s == 100 * 1024 / 0.2 and links[1].tx_bytes_per_s == 0.0
        assert links[3].tx_bytes_per_s == 0.0
        assert not links[2].supported and links[2].error == "not supported"
        assert is_na(links[2].tx_bytes_per_s) and is_na(links[2].rx_total_bytes)
        g1 = first.gpus[1]
        assert g1.nvlink_link_count == 0 and g1.nvlinks == ()
    finally:
        collector.close()


def test_counter_wrap_64_and_32_bit_and_unrefreshed_timestamp(fake_nvml: FakeNvml) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_links(0, 1, value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
    fake_nvml.set_links(1, 1, value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT)
    fake_nvml.set_clock_us(T0_US)
    fake_nvml.set_link(0, 0, tx_kib=(1 << 64) - 100, rx_kib=0)
    fake_nvml.set_link(1, 0, tx_kib=(1 << 32) - 10, rx_kib=0)
    collector = _collector()
    try:
        collector.collect()
        fake_nvml.set_clock_us(T0_US + 500_000)
        fake_nvml.set_link(0, 0, tx_kib=50, rx_kib=0)  # wrapped: 100 + 50 KiB
        fake_nvml.set_link(1, 0, tx_kib=(1 << 32) + 30, rx_kib=0)  # the fake truncates to 32 bits: 30
        sample = collector.collect()
        assert sample.gpus[0].nvlinks[0].tx_bytes_per_s == 150 * 1024 / 0.5
        assert sample.gpus[1].nvlinks[0].tx_bytes_per_s == 40 * 1024 / 0.5
        # Same NVML timestamp: the value was not refreshed, the last rate stands.
        fake_nvml.set_link(0, 0, tx_kib=10_000, rx_kib=0)
        again = collector.collect()
        assert again.gpus[0].nvlinks[0].tx_bytes_per_s == 150 * 1024 / 0.5
    finally:
        collector.close()


def test_pcie_from_counters_and_from_throughput_function(fake_nvml: FakeNvml) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_clock_us(T0_US)
    fake_nvml.set_pcie(0, counters=True, tx_bytes=10 * MIB, rx_bytes=0)
    fake_nvml.set_pcie(1, counters=False, tx_kbps=1500, rx_kbps=250)
    collector = _collector()
    try:
        first = collector.collect()
        assert is_na(first.gpus[0].pcie_tx_bytes_per_s)
        assert first.gpus[1].pcie_tx_bytes_per_s == 1500 * 1024 and first.gpus[1].pcie_rx_bytes_per_s == 250 * 1024
        fake_nvml.set_clock_us(T0_US + 250_000)
        fake_nvml.set_pcie(0, counters=True, tx_bytes=10 * MIB + 5 * MIB, rx_bytes=MIB)
        second = collector.collect()
        assert second.gpus[0].pcie_tx_bytes_per_s == 5 * MIB / 0.25
        assert second.gpus[0].pcie_rx_bytes_per_s == MIB / 0.25
        # Only the GPU without counters pays the driver's 20 ms sampling calls (TX + RX per sample).
        assert fake_nvml.pcie_throughput_calls == 4
    finally:
        collector.close()


def test_gpu_lost_mid_run_is_reported_once_and_others_continue(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvml.reset(3)
    for i in range(3):
        fake_nvml.set_memory(i, total=80 * GIB, reserved=0, used=(i + 1) * GIB)
    collector = _collector()
    try:
        assert [g.index for g in collector.collect().gpus] == [0, 1, 2]
        fake_nvml.set_lost(1)
        with caplog.at_level(logging.INFO, logger="moescope.nvml"):
            second = collector.collect()
            third = collector.collect()
        for sample in (second, third):
            assert [g.index for g in sample.gpus] == [0, 2]
            assert sample.lost_gpus == (1,)
            assert [g.memory_used_bytes for g in sample.gpus] == [1 * GIB, 3 * GIB]
        lost_lines = [r for r in caplog.records if "lost" in r.getMessage()]
        assert len(lost_lines) == 1 and lost_lines[0].levelno == logging.ERROR
        assert "GPU 1" in lost_lines[0].getMessage()
    finally:
        collector.close()


def test_gpu_lost_at_discovery(fake_nvml: FakeNvml) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_lost(0)
    collector = _collector()
    try:
        sample = collector.collect()
        assert [g.index for g in sample.gpus] == [1] and sample.lost_gpus == (0,)
    finally:
        collector.close()


def test_per_process_memory_of_the_target_tree(fake_nvml: FakeNvml, child: Child) -> None:
    grandchild = int(child.ask("spawn"))
    fake_nvml.reset(2)
    fake_nvml.set_memory(0, total=80 * GIB, reserved=0, used=70 * GIB)  # fuller, but not the target's
    fake_nvml.set_memory(1, total=80 * GIB, reserved=0, used=10 * GIB)
    unrelated = 4_000_000
    fake_nvml.add_process(0, unrelated, 2 * GIB)
    fake_nvml.add_process(0, 4_000_001, NVML_VALUE_NOT_AVAILABLE)
    fake_nvml.add_process(1, child.pid, 3 * GIB)
    fake_nvml.add_process(1, child.pid, 3 * GIB, graphics=True)  # the same allocation, seen in both lists
    fake_nvml.add_process(1, grandchild, 512 * MIB, graphics=True)
    collector = _collector(target_pid=child.pid)
    try:
        sample = collector.collect()
        assert sample.target_pids == {child.pid, grandchild}
        g0, g1 = sample.gpus
        assert g0.target_memory_used_bytes == 0
        assert [(p.pid, p.kind) for p in g0.processes] == [(unrelated, "compute"), (4_000_001, "compute")]
        assert g0.processes[0].used_bytes == 2 * GIB and is_na(g0.processes[1].used_bytes)
        by_pid = {p.pid: p for p in g1.processes}
        assert by_pid[child.pid].kind == "compute+graphics" and by_pid[child.pid].used_bytes == 3 * GIB
        assert by_pid[grandchild].kind == "graphics"
        assert g1.target_memory_used_bytes == 3 * GIB + 512 * MIB
        # The signal follows the GPU the target uses, not the fullest one.
        signal = sample.memory_signal()
        assert signal is not None and signal.scope.startswith("GPU 1 ") and signal.used_bytes == 10 * GIB
    finally:
        collector.close()


def test_unlisted_processes_make_target_memory_na_not_zero(fake_nvml: FakeNvml, child: Child) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_process_lists_supported(0, False)
    fake_nvml.add_process(1, 4_000_000, GIB)
    collector = _collector(target_pid=child.pid)
    try:
        g0, g1 = collector.collect().gpus
        assert g0.processes == () and is_na(g0.target_memory_used_bytes)
        assert [p.pid for p in g1.processes] == [4_000_000] and g1.target_memory_used_bytes == 0
    finally:
        collector.close()


def test_not_supported_is_na_and_said_once(fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml.reset(2)
    fake_nvml.set_utilization(0, supported=False)
    fake_nvml.set_utilization(1, supported=False)
    collector = _collector()
    try:
        with caplog.at_level(logging.INFO, logger="moescope.nvml"):
            for _ in range(3):
                sample = collector.collect()
        assert all(is_na(g.utilization_gpu_percent) for g in sample.gpus)
        assert "util gpu N/A% mem N/A%" in nvml.format_sample(sample)[0]
        said = [r for r in caplog.records if "nvmlDeviceGetUtilizationRates" in r.getMessage()]
        assert len(said) == 1 and "not supported" in said[0].getMessage()
        assert collector.gateway.na_counts["nvmlDeviceGetUtilizationRates"] == 6
    finally:
        collector.close()


def test_no_driver_one_line_and_no_collector(fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml.set_init_result(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with caplog.at_level(logging.INFO, logger="moescope.nvml"):
        assert open_nvml() is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(NO_DRIVER_LINE) and "Driver Not Loaded" in lines[0]


def _run_python(code: str, *, env_extra: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


OLD_DRIVER_RUN = r"""
import ctypes, json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
lib = ctypes.CDLL("libnvidia-ml.so.1")  # found through LD_LIBRARY_PATH, as pynvml will find it
lib.fakeNvmlReset(2)
lib.fakeNvmlSetLinks(0, 3, 3)
lib.fakeNvmlSetPcie.argtypes = [
    ctypes.c_uint, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_uint
]
lib.fakeNvmlSetPcie(0, 1, 0, 0, 800, 400)
lib.fakeNvmlAddProcess.argtypes = [ctypes.c_uint, ctypes.c_int, ctypes.c_uint, ctypes.c_ulonglong]
lib.fakeNvmlAddProcess(1, 0, 4242, 1 << 30)
lib.fakeNvmlAddProcess(1, 1, 4343, 1 << 29)
from moescope.collectors.nvml import open_nvml, is_na
c = open_nvml()
for _ in range(3):
    s = c.collect()
c.close()
out = [{"api": g.memory_api, "reserved_na": is_na(g.memory_reserved_bytes), "in_use": g.memory_in_use_bytes,
        "links": g.nvlink_link_count, "link_rates_na": [is_na(l.tx_bytes_per_s) for l in g.nvlinks],
        "pcie_tx": g.pcie_tx_bytes_per_s, "procs": [[p.pid, p.used_bytes, p.kind] for p in g.processes]}
       for g in s.gpus]
print(json.dumps(out))
"""


def test_old_driver_missing_functions_fall_back_with_one_warning_each(old_driver_library: Path) -> None:
    result = _run_python(OLD_DRIVER_RUN, env_extra={"LD_LIBRARY_PATH": str(old_driver_library.parent)})
    assert result.returncode == 0, result.stderr
    gpus = json.loads(result.stdout)
    assert [g["api"] for g in gpus] == ["v1", "v1"] and all(g["reserved_na"] for g in gpus)
    # v1 in-use is total - free, which includes the fake's default 512 MiB reserved.
    assert gpus[0]["in_use"] == 512 * MIB
    assert gpus[0]["links"] == 3 and gpus[0]["link_rates_na"] == [True, True, True]
    assert gpus[1]["links"] == 0
    assert gpus[0]["pcie_tx"] == 800 * 1024
    assert gpus[1]["procs"] == [[4242, GIB, "compute"], [4343, 512 * MIB, "graphics"]]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    expected = {
        "nvmlDeviceGetMemoryInfo_v2 missing",
        "nvmlDeviceGetFieldValues missing",
        "nvmlDeviceGetComputeRunningProcesses_v3 missing",
        "nvmlDeviceGetGraphicsRunningProcesses_v3 missing",
    }
    assert len(warnings) == len(expected), result.stderr
    for prefix in expected:
        assert sum(prefix in w for w in warnings) == 1, (prefix, warnings)


def test_no_library_agent_runs_on_host_signal(child: Child) -> None:
    """No libnvidia-ml at all: one line, and the supervisor still delivers the host memory signal."""
    code = (
        "import sys; from moescope.collectors.registry import main; "
        f"sys.exit(main(['--pid', '{child.pid}', '--seconds', '0.6', '--json', "
        "'--nvml-library', '/nonexistent/libnvidia-ml.so.1']))"
    )
    result = _run_python(code, env_extra={})
    assert result.returncode == 0, result.stderr
    no_driver = [line for line in result.stderr.splitlines() if NO_DRIVER_LINE in line]
    assert len(no_driver) == 1 and "/nonexistent/libnvidia-ml.so.1" in no_driver[0]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["unavailable"] == {"nvml": "no NVIDIA driver"}
    assert summary["memory_signal"]["source"] in ("cgroup", "rss")
    assert summary["memory_signal"]["used_bytes"] > 0
    host = [json.loads(line) for line in result.stdout.splitlines()[:-1]]
    assert host and all(item["collector"] == "host" and item["sample"]["pid"] == child.pid for item in host)
