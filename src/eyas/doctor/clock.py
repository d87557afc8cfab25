"""Log timestamps as seconds: ISO dates and times, glog stamps (month and day, no year) and bare times of day,
mixed in one log; `Clock` adds the days that pass (a new date, the time of day wrapping past midnight).
"""

from __future__ import annotations

import datetime
import re

ISO_TS = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
GLOG_TS = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s")
TIME_TS = re.compile(r"^\[?(\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?\]?\s")


class Clock:
    """Log timestamps -> seconds: time of day plus whole days, so stamps with and without dates mix."""

    def __init__(self):
        self.date: datetime.date | None = None
        self.guessed = False  # the date's year is a guess (glog stamps carry month and day only)
        self.days = 0
        self.last: float | None = None
        self.tod = 0.0
        self._day: tuple | None = None  # the last ISO date read, as text
        self.end = 0  # where the stamp ended in the text last read (0: no stamp)

    def read(self, text: str) -> float | None:
        """The timestamp at the start of `text` in seconds, or None; updates `last`."""
        head = text[:48]
        self.end = 0
        m = ISO_TS.search(head)
        if m:
            self.end = m.end()
            day = m.group(1, 2, 3)
            if day != self._day:  # a new date (most stamps repeat the last one)
                if not self._date(int(day[0]), int(day[1]), int(day[2]), guessed=False):
                    return None
                self._day = day
            return self._time(int(m.group(4)), int(m.group(5)), int(m.group(6)), m.group(7))
        m = GLOG_TS.match(head) or TIME_TS.match(head)
        if not m:
            return None
        self._day, self.end = None, m.end()
        g = m.groups()
        if len(g) == 6:  # glog: month, day, h, m, s, fraction (no year)
            if not self._date(self.date.year if self.date else 2000, int(g[0]), int(g[1]), guessed=True):
                return None
            g = g[2:]
        return self._time(int(g[0]), int(g[1]), int(g[2]), g[3])

    def _date(self, y: int, mo: int, d: int, guessed: bool) -> bool:
        try:
            date = datetime.date(y, mo, d)
            seen = self.date
            if seen is not None and (guessed or self.guessed):  # compare month and day only
                seen = seen.replace(year=y)
        except ValueError:
            return False
        if seen is not None and date != seen:
            delta = (date - seen).days
            if delta < -300:  # December -> January with a guessed year
                delta += 365
            self.days += max(-1, min(366, delta))
        if not (guessed and self.date is not None and not self.guessed):  # keep a real year once known
            self.date, self.guessed = date, guessed
        else:
            self.date = date.replace(year=self.date.year)
        return True

    def _time(self, h: int, mi: int, s: int, frac: str | None) -> float | None:
        if h > 23 or mi > 59 or s > 60:
            return None
        self.tod = h * 3600 + mi * 60 + s + (float("0." + frac) if frac else 0.0)  # time of day, writer's zone
        t = self.days * 86400 + self.tod
        if self.last is not None and t < self.last - 43200:  # time of day wrapped past midnight
            self.days += 1
            t += 86400
        self.last = t
        return t
