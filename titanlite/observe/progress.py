"""Progress lines for long start-up work (data preparation, a large checkpoint load, a
Hugging Face import), so rank 0 says what it is doing, how far it got and how long is left
instead of going silent for minutes.

It logs through the `titanlite` logger, which prints on rank 0 only (see logging.py), at
most one line every `every_s` seconds plus a final line, so it costs nothing measurable
when called per item.
"""

from __future__ import annotations

import time

from titanlite.logging import logger


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """`what: 41% (2.1 GB of 5.1 GB), 12 s elapsed, about 17 s left`.

    `total` may be None (unknown size): then lines give the amount done and the rate only.
    `unit` names the amount ("tokens", "files", "B"); "B" amounts print as KB/MB/GB.
    """

    def __init__(self, what: str, total: float | None = None, unit: str = "", every_s: float = 5.0):
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.done = 0.0
        self.started = self._last = time.monotonic()

    def advance(self, amount: float = 1) -> None:
        """Add `amount` to what is done; log a line when `every_s` passed since the last."""
        self.done += amount
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            logger.info(self.line(now))

    def finish(self) -> float:
        """Log the closing line (amount and time); returns the seconds elapsed."""
        elapsed = time.monotonic() - self.started
        logger.info(f"{self.what}: done, {self._amount(self.done)} in {_duration(elapsed)}")
        return elapsed

    def line(self, now: float | None = None) -> str:
        """The current progress line (also what `update` logs)."""
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        rate = self.done / elapsed
        if not self.total:
            return f"{self.what}: {self._amount(self.done)}, {self._amount(rate)}/s, {_duration(elapsed)} elapsed"
        fraction = min(self.done / self.total, 1.0)
        eta = f"about {_duration((self.total - self.done) / rate)} left" if rate > 0 else "time left unknown"
        return (
            f"{self.what}: {100 * fraction:.0f}% ({self._amount(self.done)} of {self._amount(self.total)}), "
            f"{_duration(elapsed)} elapsed, {eta}"
        )

    def _amount(self, value: float) -> str:
        return amount_text(value, self.unit)


def amount_text(value: float, unit: str = "") -> str:
    """`1,234 files`, or for unit "B" `2.1 GB`: how progress lines print an amount."""
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
            if value >= scale:
                return f"{value / scale:,.1f} {name}"
        return f"{value:,.0f} B"
    return f"{value:,.0f}{' ' + unit if unit else ''}"
