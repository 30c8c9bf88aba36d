"""The GPU's SM clock and board power while a benchmark runs, sampled with ``nvidia-smi``.

Why a kernel library's benchmark records them: a GPU's clock is not fixed. An H200 boosts its
SM clock while it is lightly loaded and lowers it when a sustained load reaches the board's
power limit (``nvidia-smi`` then reports the "power cap" clock-event reason), so the same
kernels take longer in a long run than in a short one, and a profile of a few steps after a
pause sees faster kernels than a timing of many steps back to back. Two implementations timed
one after the other can therefore run at different clocks; the clock and power beside each
timing say whether they did.

:class:`ClockSampler` runs ``nvidia-smi --query-gpu=... -lms <interval>`` in the background and
parses its lines into :class:`ClockSample` values; :func:`summarize` reduces the samples that
fall in a time window (``time.time()`` seconds) to medians, extremes and the reasons the driver
gave for holding the clock down. Where ``nvidia-smi`` is missing or refuses the query (a CPU
machine, another vendor), the sampler records nothing and says why in :attr:`ClockSampler.error`;
the benchmark's timings are unaffected.

``power.draw.instant`` is queried where the driver has it (``power.draw`` is an average over
about a second on recent drivers, which lags a window of a few hundred milliseconds);
otherwise ``power.draw``. Field names and reason bits: ``nvidia-smi --help-query-gpu``, NVML's
``nvmlClocksEventReasons`` (``clocks_event_reasons``, formerly ``clocks_throttle_reasons``).

The sampler only reads: it never sets clocks, power limits or any other state of the GPU.
"""
from __future__ import annotations

import datetime
import math
import numbers
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Iterable, NamedTuple, Optional, Sequence

__all__ = ["ClockSample", "ClockSampler", "QUERIES", "REASONS", "decode_reasons", "gpu_id", "parse_line", "smi_env",
           "summarize"]


def smi_env() -> dict:
    """The environment ``nvidia-smi`` runs in: this process's, with ``TZ=UTC0``, so that its
    timestamps are UTC (:func:`parse_line` reads them so)."""
    return {**os.environ, "TZ": "UTC0"}


#: The queries tried in order: the first that ``nvidia-smi`` accepts is used. Each lists the
#: timestamp, the SM clock (MHz), the board power (W), the temperature (C) and the active
#: clock-event reasons (a bit mask).
QUERIES: tuple[tuple[str, ...], ...] = (
    ("timestamp", "clocks.sm", "power.draw.instant", "temperature.gpu", "clocks_event_reasons.active"),
    ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active"),
    ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"),
)

#: NVML's clock-event reason bits -> what they mean.
REASONS: dict[int, str] = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
    0x100: "display clocks setting",
}


class ClockSample(NamedTuple):
    """One line of ``nvidia-smi``: when (``time.time()`` seconds), the SM clock (MHz), board
    power (W), temperature (C) and the active clock-event reasons (NVML's bit mask)."""
    t: float
    sm_mhz: float
    power_w: float
    temperature_c: float
    reasons: int


def parse_line(line: str) -> Optional[ClockSample]:
    """A :class:`ClockSample` from one line of ``nvidia-smi --format=csv,noheader,nounits`` with
    one of :data:`QUERIES`' field lists, or None for a line that is not one (a header, an error
    message, "[N/A]" values). The timestamp is read as UTC ("2026/12/03 11:09:15.712"):
    :class:`ClockSampler` runs ``nvidia-smi`` with ``TZ=UTC0`` (:func:`smi_env`), since local
    time names one hour twice where daylight saving time ends."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
        t = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
        sm, power, temp = float(parts[1]), float(parts[2]), float(parts[3])
        reasons = int(parts[4], 16)
    except ValueError:
        return None
    if not all(math.isfinite(v) for v in (sm, power, temp)):
        return None
    return ClockSample(t, sm, power, temp, reasons)


def decode_reasons(mask: int) -> list[str]:
    """The names of the reason bits set in ``mask`` (:data:`REASONS`; an unknown bit as its hex value)."""
    out = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    if rest:
        out.append(hex(rest))
    return out


def summarize(samples: Iterable[ClockSample], t0: float, t1: float) -> dict:
    """The samples taken in ``[t0, t1]`` (``time.time()`` seconds), reduced.

    Returns:
        ``{"samples": n}`` and, when n >= 1, ``"sm_mhz"`` (median), ``"sm_mhz_min"``,
        ``"sm_mhz_max"``, ``"power_w"`` (median), ``"power_w_max"``, ``"temperature_c_max"`` and
        ``"reasons"``: each reason named in any sample, with the share of the samples that named
        it (``{"power cap": 0.94}``).

    Raises:
        ValueError: t1 < t0, or either not finite.
    """
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise ValueError(f"the window must be finite with t0 <= t1, got t0={t0!r}, t1={t1!r}")
    sel = [s for s in samples if t0 <= s.t <= t1]
    if not sel:
        return {"samples": 0}
    counts: dict[str, int] = {}
    for s in sel:
        for name in decode_reasons(s.reasons):
            counts[name] = counts.get(name, 0) + 1
    return {
        "samples": len(sel),
        "sm_mhz": statistics.median(s.sm_mhz for s in sel),
        "sm_mhz_min": min(s.sm_mhz for s in sel),
        "sm_mhz_max": max(s.sm_mhz for s in sel),
        "power_w": round(statistics.median(s.power_w for s in sel), 1),
        "power_w_max": round(max(s.power_w for s in sel), 1),
        "temperature_c_max": max(s.temperature_c for s in sel),
        "reasons": {k: round(v / len(sel), 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
    }


def gpu_id(device) -> str:
    """The CUDA device ``device`` (a ``torch.device`` or index) as ``nvidia-smi -i`` takes it:
    "GPU-<uuid>", the same GPU whatever ``CUDA_VISIBLE_DEVICES`` says (its index may not be).

    Raises:
        RuntimeError / AssertionError: from ``torch.cuda.get_device_properties`` (no CUDA, an
            index out of range)."""
    import torch

    text = str(torch.cuda.get_device_properties(device).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class ClockSampler:
    """``nvidia-smi`` sampling one GPU in the background, as a context manager.

    ``with ClockSampler(index) as s: ...`` then ``s.samples()`` (also inside the block: what
    has been written so far). Nothing is sampled, and :attr:`error` says why, where
    ``nvidia-smi`` is missing or accepts none of :data:`QUERIES`.

    Args:
        index: the GPU as ``nvidia-smi -i`` takes it: its index as ``nvidia-smi`` counts them
            (which ``CUDA_VISIBLE_DEVICES`` can make differ from the CUDA device's), or its
            UUID ("GPU-..."), which names the same GPU everywhere (:func:`gpu_id`).
        interval_ms: the sampling interval (``-lms``), an int >= 10.
        command: the ``nvidia-smi`` executable.

    Attributes:
        fields: the query in use (None when nothing is sampled).
        error: why nothing is sampled (None when sampling).
        limits: ``{"power_limit_w", "sm_max_mhz"}``, the board's enforced power limit and top
            SM clock, read once at the start (empty where they cannot be read).

    Raises:
        TypeError: index neither an int nor a str; interval_ms not an int.
        ValueError: index < 0, or an empty str or one with a comma (one GPU only); interval_ms
            < 10.
    """

    def __init__(self, index: int | str = 0, interval_ms: int = 20, command: str = "nvidia-smi") -> None:
        if isinstance(index, bool) or not isinstance(index, (numbers.Integral, str)):
            raise TypeError(f"ClockSampler: index must be an int >= 0 or one GPU's UUID, got "
                            f"{type(index).__name__} {index!r}")
        if isinstance(index, str) and (not index.strip() or "," in index) or (
                isinstance(index, numbers.Integral) and index < 0):
            raise ValueError(f"ClockSampler: index must be an int >= 0 or one GPU's UUID, got {index!r}")
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, numbers.Integral):
            raise TypeError(f"ClockSampler: interval_ms must be an int >= 10, got {type(interval_ms).__name__} "
                            f"{interval_ms!r}")
        if interval_ms < 10:
            raise ValueError(f"ClockSampler: interval_ms must be an int >= 10, got {interval_ms!r}")
        index = index if isinstance(index, str) else int(index)
        interval_ms = int(interval_ms)
        self.index, self.interval_ms, self.command = index, interval_ms, command
        self.fields: Optional[Sequence[str]] = None
        self.error: Optional[str] = None
        self.limits: dict = {}
        self._proc: Optional[subprocess.Popen] = None
        self._out = None
        self._final: Optional[list] = None

    def _args(self, fields: Sequence[str]) -> list[str]:
        return [self.command, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", str(self.index)]

    def __enter__(self) -> "ClockSampler":
        if shutil.which(self.command) is None:
            self.error = f"{self.command} not found"
            return self
        for fields in QUERIES:
            try:
                probe = subprocess.run(self._args(fields), capture_output=True, text=True, timeout=30,
                                       env=smi_env())
            except (OSError, subprocess.SubprocessError) as exc:
                self.error = f"{self.command} failed: {type(exc).__name__}: {exc}"
                return self
            if probe.returncode == 0 and any(parse_line(ln) for ln in probe.stdout.splitlines()):
                self.fields = fields
                break
        else:
            self.error = f"{self.command} accepted none of the queries: {probe.stdout.strip() or probe.stderr.strip()}"[:300]
            return self
        try:
            probe = subprocess.run(self._args(("enforced.power.limit", "clocks.max.sm")), capture_output=True,
                                   text=True, timeout=30, env=smi_env())
            power, sm = (float(v) for v in probe.stdout.strip().splitlines()[0].split(","))
            self.limits = {"power_limit_w": power, "sm_max_mhz": sm}
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass  # (the samples do not need them)
        self._out = tempfile.TemporaryFile(mode="w+b")
        self._proc = subprocess.Popen(self._args(self.fields) + ["-lms", str(self.interval_ms)],
                                      stdout=self._out, stderr=subprocess.DEVNULL, text=True, env=smi_env())
        return self

    def samples(self) -> list[ClockSample]:
        """The samples written so far, in order (complete lines only)."""
        if self._final is not None:
            return list(self._final)
        if self._out is None:
            return []
        # read by position, without moving the file's offset, which nvidia-smi writes at: a seek
        # here would make its next line overwrite the start of the file
        fd = self._out.fileno()
        data = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        complete = data[:data.rfind("\n") + 1]  # (a line still being written is left for later)
        return [s for s in map(parse_line, complete.splitlines()) if s is not None]

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._out is not None:
            self._final = self.samples()  # (kept: the samples stay readable after the block)
            self._out.close()
            self._out = None
