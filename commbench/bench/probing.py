"""The run-wide sampler on rank 0: started with the run, marked at each phase, written at the end."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commbench.probes import host
from commbench.probes.nvml import Nvml
from commbench.probes.sampler import Sampler


class RunProbe:
    """Rank 0's sampler (host counters on the run's interface, and NVML where there is one).

    The probe only watches: where it fails (a device that stops answering NVML, a thread that
    does not stop) it says so in one line and stops, and the run goes on; its records are kept,
    without the probe's timeline.
    """

    def __init__(self, interval_s: float, nic: str | None = None) -> None:
        """``nic``: the interface to sample (``wirecount.agreed_nic``'s); ``host.selected_nic()``'s
        where None."""
        # Before NVML is opened: a bad $COMMBENCH_NIC leaves nothing open.
        self.nic = host.selected_nic() if nic is None else nic
        self.nvml, self.nvml_note = Nvml.open_with_reason()
        try:
            self.sampler = Sampler(interval_s=interval_s, nvml=self.nvml, nic=self.nic).start()
        except BaseException:
            if self.nvml is not None:
                self.nvml.close()
            raise
        self._marks = 0
        self.error: BaseException | None = None

    def describe(self) -> str:
        """One line for the table header: what is probed, and what is not and why."""
        gpu = f"{len(self.nvml.devices)} GPU(s) through NVML" if self.nvml is not None else self.nvml_note
        if self.nvml is not None and len(self.nvml.devices) > 1:
            # NVML numbers every GPU of the host, CUDA those $CUDA_VISIBLE_DEVICES leaves, in its
            # order: the timeline's "GPU 2" can be the rank lines' cuda:0, told apart by address
            gpu += " (" + ", ".join(f"GPU {d.index} [{d.pci or '?'}]" for d in self.nvml.devices) + ")"
        return f"# probes: every {self.sampler.interval_s:g} s on {self.nic}; {gpu}"

    def mark(self, label: str) -> None:
        if self.error is not None:
            return
        self._marks += 1
        try:
            self.sampler.mark(f"{self._marks}: {label}")
        except Exception as exc:  # the run's own work is not the probe's to stop
            self._failed(exc)

    def finish(self) -> dict[str, Any] | None:
        """Stop sampling; the timeline as a ``probe`` record (None where the probe failed)."""
        try:
            timeline = self.sampler.stop()
        except RuntimeError as exc:
            self._failed(exc.__cause__ or exc)
        finally:
            if self.nvml is not None:
                self.nvml.close()
        if self.error is not None:
            return None
        return {"type": "probe", "nvml": self.nvml_note, **timeline.to_json()}

    def _failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            print(
                f"commbench: the probe stopped ({type(exc).__name__}: {exc}); the run goes on, and its "
                "records are kept without the probe's timeline",
                file=sys.stderr,
                flush=True,
            )


def overhead_line(record: dict[str, Any]) -> str:
    """The sampler's own cost, as printed under a run's table."""
    return (
        f"# probe: {len(record['samples'])} samples in {record['wall_s']:.1f} s; the sampler used "
        f"{100 * record['overhead_core_fraction']:.2f}% of one core"
    )


PROBE_INTERVAL_S = (0.001, 60.0)  # the sampler's interval: from 1 ms to a minute


def probe_interval(text: str) -> float:
    """``--probe-interval``: seconds within :data:`PROBE_INTERVAL_S` (checked before any rank starts)."""
    low, high = PROBE_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not low <= value <= high:  # NaN too
        raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g} s, got {text}")
    return value


def add_probe_args(p: argparse.ArgumentParser, counted: str) -> None:
    """``--no-probe`` and ``--probe-interval``; ``counted`` says what the byte count runs around."""
    p.add_argument(
        "--no-probe",
        action="store_true",
        help=f"skip the probes: interface bytes counted around {counted}, and the rank-0 sampler",
    )
    p.add_argument(
        "--probe-interval",
        type=probe_interval,
        default=0.1,
        help="sampler interval in seconds, 0.001 to 60 (default 0.1)",
    )
