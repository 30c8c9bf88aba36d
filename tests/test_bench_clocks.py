"""fusedlib.bench.clocks: nvidia-smi's lines parsed, windows summarised, the sampler's life cycle
(against a stand-in nvidia-smi script, so that it runs on any machine)."""
from __future__ import annotations

import datetime
import os
import stat
import sys
import time

import pytest
import torch

from fusedlib.bench import clocks


def _line(t: float, sm: float, w: float, temp: float, mask: int) -> str:
    stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {sm:g}, {w:.2f}, {temp:g}, 0x{mask:016x}"


def test_parse_line_reads_nvidia_smi_and_refuses_the_rest():
    t = 1_796_296_204.25
    s = clocks.parse_line(_line(t, 1620, 690.32, 63, 0x4))
    assert s == clocks.ClockSample(pytest.approx(t, abs=1e-3), 1620.0, 690.32, 63.0, 4)
    for bad in ("timestamp, clocks.sm [MHz], power.draw [W], temperature.gpu, reasons",  # a header
                "Field \"power.draw.instant\" is not a valid field to query.",
                _line(t, 1620, 690, 63, 4).replace("690.00", "[N/A]"),
                _line(t, 1620, 690, 63, 4).replace("690.00", "nan"),
                _line(t, 1620, 690, 63, 4) + ", 1", ""):
        assert clocks.parse_line(bad) is None, bad


@pytest.mark.skipif(not hasattr(time, "tzset"), reason="time.tzset (POSIX)")
def test_parse_line_reads_utc_whatever_the_local_zone(monkeypatch):
    # local time names 01:30 twice on 2026-11-01 in New York (daylight saving time ends): the
    # sampler has nvidia-smi print UTC, and parse_line reads UTC under any local zone
    first, second = 1_793_511_000.0, 1_793_514_600.0  # 05:30 and 06:30 UTC, both 01:30 in New York
    try:
        # POSIX rule strings (no tz database needed): New York's, UTC, and India's
        for zone, offset in (("EST5EDT,M3.2.0,M11.1.0", 5 * 3600), ("UTC0", 0), ("IST-5:30", -19800)):
            monkeypatch.setenv("TZ", zone)
            time.tzset()
            assert time.timezone == offset, zone  # (the zone took effect)
            a, b = clocks.parse_line(_line(first, 1, 1, 1, 0)), clocks.parse_line(_line(second, 1, 1, 1, 0))
            assert (a.t, b.t) == (pytest.approx(first, abs=1e-3), pytest.approx(second, abs=1e-3)), zone
    finally:
        monkeypatch.undo()
        time.tzset()


def test_nvidia_smi_runs_in_utc(monkeypatch):
    monkeypatch.setenv("TZ", "America/New_York")
    monkeypatch.setenv("FUSEDLIB_PROBE", "kept")
    env = clocks.smi_env()
    assert env["TZ"] == "UTC0" and env["FUSEDLIB_PROBE"] == "kept"
    assert os.environ["TZ"] == "America/New_York"  # (this process's zone is left alone)


def test_decode_reasons_names_each_bit():
    assert clocks.decode_reasons(0) == []
    assert clocks.decode_reasons(0x4) == ["power cap"]
    assert clocks.decode_reasons(0x1 | 0x4 | 0x40) == ["idle", "power cap", "thermal (hardware)"]
    assert clocks.decode_reasons(0x4 | 0x1000) == ["power cap", "0x1000"]


def test_summarize_lists_the_reasons_most_frequent_first_as_rounded_shares():
    # the benchmark prints the reasons in this order ("power cap 67%, idle 33%"); the shares are
    # rounded to 3 decimals for the JSON records
    samples = [clocks.ClockSample(10.0 + i, 1500, 600, 60, mask) for i, mask in enumerate((0x1, 0x4, 0x4 | 0x80))]
    got = clocks.summarize(samples, 10.0, 12.0)["reasons"]
    assert list(got.items()) == [("power cap", 0.667), ("idle", 0.333), ("power brake", 0.333)]


def test_gpu_id_is_the_uuid_with_one_gpu_prefix(monkeypatch):
    # torch reports the UUID with or without nvidia-smi's "GPU-" prefix, by version: either way
    # nvidia-smi -i must get it once
    import types

    uuid = "6d1d3c56-0000-1111-2222-333344445555"
    for text in (uuid, f"GPU-{uuid}"):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, text=text: types.SimpleNamespace(uuid=text))
        assert clocks.gpu_id(0) == f"GPU-{uuid}"


def test_summarize_takes_the_window_only():
    t = 1000.0
    samples = [clocks.ClockSample(t + i * 0.1, sm, w, 50 + i, mask) for i, (sm, w, mask) in enumerate(
        [(1980, 200, 0x0), (1700, 500, 0x4), (1620, 690, 0x4), (1650, 700, 0x4), (1980, 90, 0x1)])]
    got = clocks.summarize(samples, t + 0.05, t + 0.35)  # the three middle samples
    assert got == {"samples": 3, "sm_mhz": 1650, "sm_mhz_min": 1620, "sm_mhz_max": 1700, "power_w": 690.0,
                   "power_w_max": 700.0, "temperature_c_max": 53, "reasons": {"power cap": 1.0}}
    got = clocks.summarize(samples, t, t + 0.4)
    assert got["samples"] == 5 and got["reasons"] == {"power cap": 0.6, "idle": 0.2}
    assert clocks.summarize(samples, t + 5, t + 6) == {"samples": 0}
    # the window is closed at both ends: t0 == t1 on a sample's time takes that sample
    assert clocks.summarize(samples, samples[2].t, samples[2].t)["samples"] == 1
    for t0, t1 in ((2.0, 1.0), (float("nan"), 1.0), (0.0, float("inf"))):
        with pytest.raises(ValueError, match="window"):
            clocks.summarize(samples, t0, t1)


@pytest.fixture
def fake_smi(tmp_path):
    """A stand-in nvidia-smi: refuses the first query (as a driver without power.draw.instant
    does), answers the others once, and with -lms prints a line every 10 ms until killed."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f"""#!{sys.executable}
import sys, time, datetime
args = " ".join(sys.argv[1:])
if "enforced.power.limit" in args:
    print("700.00, 1980"); sys.exit(0)
if "power.draw.instant" in args:
    print('Field "power.draw.instant" is not a valid field to query.'); sys.exit(2)
def line():
    t = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{{t}}, 1620, 690.50, 63, 0x0000000000000004"
if "-lms" not in args:
    print(line()); sys.exit(0)
while True:
    print(line(), flush=True); time.sleep(0.01)
""")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_sampler_samples_with_the_first_accepted_query(fake_smi):
    t0 = time.time()
    with clocks.ClockSampler(0, interval_ms=10, command=fake_smi) as smp:
        deadline = time.time() + 30  # (a loaded machine may start the stand-in's interpreter slowly)
        while len(smp.samples()) < 5 and time.time() < deadline:
            time.sleep(0.05)
        inside = smp.samples()
    t1 = time.time()
    assert smp.error is None and list(smp.fields) == list(clocks.QUERIES[1])
    assert smp.limits == {"power_limit_w": 700.0, "sm_max_mhz": 1980.0}
    assert smp._proc is None  # the background process is gone
    assert len(inside) >= 5 and all(s.sm_mhz == 1620 and s.power_w == 690.5 and s.reasons == 4 for s in inside)
    got = clocks.summarize(smp.samples(), t0 - 1, t1 + 1)
    assert got["samples"] >= len(inside) and got["reasons"] == {"power cap": 1.0}


def test_sampler_without_nvidia_smi_samples_nothing_and_says_why(tmp_path):
    with clocks.ClockSampler(command=str(tmp_path / "no-such-smi")) as smp:
        assert smp.samples() == []
    assert smp.fields is None and "not found" in smp.error
    refusing = tmp_path / "refusing-smi"
    refusing.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    refusing.chmod(0o755)
    with clocks.ClockSampler(command=str(refusing)) as smp:
        assert smp.samples() == []
    assert smp.fields is None and "No devices were found" in smp.error and smp.limits == {}


def test_sampler_reads_complete_lines_only(tmp_path):
    # nvidia-smi may be half-way through a line when samples() reads: "..., 0x0000000000000004" cut
    # before its last digit would parse as a sample without the power cap; the line is left for a
    # later read
    line = _line(1_796_296_204.25, 1620, 690.5, 63, 0x4)
    smp = clocks.ClockSampler()
    smp._out = open(tmp_path / "smi.csv", "w+b")
    try:
        smp._out.write((line + "\n" + line[:-1]).encode())
        smp._out.flush()
        got = smp.samples()
        assert len(got) == 1 and got[0].reasons == 4
        smp._out.write(line[-1:].encode() + b"\n")
        smp._out.flush()
        assert smp.samples() == [got[0], got[0]]
    finally:
        smp._out.close()


def test_sampler_takes_no_query_that_nvidia_smi_fails(tmp_path):
    # a query whose run exits non-zero failed, whatever it printed before failing
    failing = tmp_path / "failing-smi"
    failing.write_text(f"#!/bin/sh\necho '{_line(1_796_296_204.25, 1620, 690.5, 63, 0x4)}'\nexit 3\n")
    failing.chmod(0o755)
    with clocks.ClockSampler(command=str(failing)) as smp:
        assert smp.samples() == []
    assert smp.fields is None and "accepted none of the queries" in smp.error


@pytest.mark.parametrize("kw, exc", [(dict(index=-1), ValueError), (dict(index=True), TypeError),
                                     (dict(index=1.0), TypeError), (dict(index=""), ValueError),
                                     (dict(index="0,1"), ValueError), (dict(interval_ms=5), ValueError),
                                     (dict(interval_ms=20.0), TypeError)])
def test_sampler_refuses_bad_arguments(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        clocks.ClockSampler(**kw)
    import numpy as np

    smp = clocks.ClockSampler(np.int64(1), interval_ms=np.int32(50))  # numpy ints are ints
    assert (smp.index, smp.interval_ms) == (1, 50) and type(smp.index) is int


def test_samples_are_whole_lines_read_without_moving_the_writer(fake_smi):
    # the stand-in writes every 10 ms while samples() is read in a tight loop: a read that moved the
    # file's offset made nvidia-smi overwrite the file's start (lost and garbled samples)
    with clocks.ClockSampler(0, interval_ms=10, command=fake_smi) as smp:
        deadline = time.time() + 30
        while len(smp.samples()) < 40 and time.time() < deadline:
            smp.samples()
        got = smp.samples()
    after = smp.samples()  # (kept after the block; the file is closed)
    assert len(got) >= 40 and after[:len(got)] == got and smp._out is None
    assert all(b.t >= a.t for a, b in zip(after, after[1:]))  # in order: none overwritten


@pytest.fixture
def smi_calls(fake_smi, monkeypatch):
    """The argument lists of every run of the stand-in nvidia-smi (subprocess.run and Popen);
    ``.envs``: the environment each run was given."""
    import subprocess

    seen = _Seen()
    real_run, real_popen = subprocess.run, subprocess.Popen

    def spy(real):
        def call(args, *a, **kw):
            if args[0] == fake_smi:
                seen.append(args)
                seen.envs.append(kw.get("env"))
            return real(args, *a, **kw)
        return call

    monkeypatch.setattr(subprocess, "run", spy(real_run))
    monkeypatch.setattr(subprocess, "Popen", spy(real_popen))
    return seen


class _Seen(list):
    def __init__(self):
        super().__init__()
        self.envs = []


def test_sampler_never_runs_a_command_that_changes_the_gpu(fake_smi, smi_calls):
    # only queries: no -pl, -lgc, -ac, -r, -pm ... (the card's settings are left alone)
    seen = smi_calls
    with clocks.ClockSampler(command=fake_smi):
        pass
    assert seen and all(a[1].startswith("--query-gpu=") and set(a[2:]) <= {"--format=csv,noheader,nounits", "-i", "0",
                                                                           "-lms", "20"} for a in seen)
    assert os.path.basename(seen[0][0]) == "nvidia-smi"
    assert len(seen.envs) == len(seen) and all(e is not None and e["TZ"] == "UTC0" for e in seen.envs)


def test_sampler_names_the_gpu_by_uuid(fake_smi, smi_calls):
    seen = smi_calls
    with clocks.ClockSampler("GPU-6d1d3c56-0000-1111-2222-333344445555", command=fake_smi) as smp:
        pass
    assert smp.error is None and seen
    assert all(a[a.index("-i") + 1] == "GPU-6d1d3c56-0000-1111-2222-333344445555" for a in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's id")
def test_gpu_id_of_a_cuda_device():
    got = clocks.gpu_id(torch.device("cuda", 0))
    assert (isinstance(got, str) and got.startswith("GPU-") and len(got) > 10) or got == 0
    assert clocks.gpu_id(0) == got
