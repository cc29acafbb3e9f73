"""Human units for bytes, durations and times, shared by the widgets.

Every size the user sees, in memory or on disk, is said by one formatter,
``human_bytes`` (the engine's, so its messages agree): a chat's cache is the
same number in the memory panel and in Stored KV. A size the user types is read
in the same ``GB``.
"""

from __future__ import annotations

import re
import time
import unicodedata

from engine import GB, MODES, KvMode, human_bytes

MODE_SEPARATOR = " · "  # between a reopened chat's title and its mode

__all__ = ["GB", "counted", "human_bytes", "human_duration", "relative_time"]


def counted(n: int, noun: str, plural: str = "") -> str:
    """A count with its noun, singular for one: 1 -> "1 token"; 4096 -> "4,096 tokens".

    ``plural`` where adding "s" is wrong ("1 copy", "2 copies").
    """
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def human_duration(seconds: float | None) -> str:
    """75 -> "1m 15s"; None -> "—"."""
    if seconds is None:
        return "—"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def unbroken(text: str) -> str:
    """``text`` that a wrapping label keeps on one line (a number with its unit): a
    line of figures wraps between them, never inside one ("3,393 / tokens", "tokens/ s":
    a line may break after a slash between two words, which a word joiner forbids)."""
    return re.sub(r"/(?=\w)", "/\u2060", text.replace(" ", "\u00a0"))


def relative_time(timestamp: float, now: float | None = None) -> str:
    """A last-activity label: "just now", "5 min ago", "yesterday", "3 Mar"."""
    delta = (now or time.time()) - timestamp
    if delta < 60:
        return "just now"
    if delta < 3600:
        return f"{int(delta // 60)} min ago"
    if delta < 86400:
        return f"{int(delta // 3600)} h ago"
    if delta < 2 * 86400:
        return "yesterday"
    return time.strftime("%-d %b", time.localtime(timestamp))


def short_tokens(tokens: int) -> str:
    """A token count as the window says it, rounded down: it never reads as more than it
    is, so tokens that fit never read as the whole context. 262,144 → "262k";
    8,192 → "8.1k"; 7,600 → "7.6k"; 4,096 → "4k"; 1,048,576 → "1M"; 500 → "500"."""
    for size, unit in ((10**6, "M"), (10**3, "k")):
        if tokens >= size:
            tenths = tokens * 10 // size
            if tenths >= 100 or tenths % 10 == 0:  # a tenth only below ten units
                return f"{tenths // 10:,}{unit}"
            return f"{tenths // 10}.{tenths % 10}{unit}"
    return str(tokens)


def compact_count(n: int) -> str:
    """93_653_760 -> "93.7 M": three figures, in the next unit where rounding reaches it
    (9,999 -> "10.0 k", 999,999 -> "1.00 M"); small counts stay exact."""
    if n < 1000:
        return f"{n:,}"
    for size, unit in ((10**3, "k"), (10**6, "M")):
        text = _three_figures(n / size)
        if float(text) < 1000:
            return f"{text} {unit}"
    return f"{_three_figures(n / 10**9)} G"


def _three_figures(value: float) -> str:
    """``value`` (at least 1) in three significant figures, counted after rounding:
    9.999 -> "10.0", not "10.00"; 999.9 -> "1000" (the caller takes the next unit)."""
    for digits, below in ((2, 10), (1, 100)):
        text = f"{value:.{digits}f}"
        if float(text) < below:
            return text
    return f"{value:.0f}"


def percent(fraction: float) -> str:
    """A share as a whole percent that says "0%" and "100%" only when exact: 1/256 ->
    "<1%", 255/256 -> ">99%", 0.5 -> "50%"."""
    if 0 < fraction < 0.01:
        return "<1%"
    if 0.99 < fraction < 1:
        return ">99%"
    return f"{fraction:.0%}"


def title_from(text: str, limit: int = 200) -> str:
    """A chat title from its first message: its first line, at most ``limit`` characters.

    No "…" is stored: a title is elided where it is painted, to the width it has
    there; a first line longer than ``limit`` is cut at a word.
    """
    stripped = text.strip()
    line = stripped.splitlines()[0].strip() if stripped else ""
    if len(line) <= limit:
        return line
    cut = line[:limit]
    space = cut.rfind(" ")
    # A cut inside the last word reads as a typo; drop back to the word before it.
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.-")


def reopened_title(title: str, mode: KvMode) -> str:
    """The title of ``title``'s copy in ``mode``: "Notes · q6" reopened in q4 is
    "Notes · q4", not a title that grows by a mode each time."""
    base, separator, last = title.rpartition(MODE_SEPARATOR)
    if separator and last in MODES:
        title = base
    return f"{title}{MODE_SEPARATOR}{mode}"


def short_title(title: str, limit: int = 40) -> str:
    """``title`` for a sentence: whole when short, else cut at a word with "…"."""
    if len(title) <= limit:
        return title
    cut = title[:limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.-") + "…"


# Unicode "format" characters change how the text around them is shown without
# showing themselves: bidirectional overrides, isolates and marks (U+202E makes
# "invoice\u202efdp.exe" read as "invoiceexe.pdf"), zero-width spaces and joiners.
# Controls and line/paragraph separators are no part of a one-line name either.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Zl", "Zp"})


def visible_text(text: str) -> str:
    """``text`` with invisible and control characters shown as ⟨U+XXXX⟩.

    For names shown to the user (attached files, chat titles), so a name reads as
    the characters it is made of; what is stored and sent keeps them.
    """
    return "".join(
        f"⟨U+{ord(ch):04X}⟩" if unicodedata.category(ch) in _HIDDEN_CATEGORIES else ch
        for ch in text)


def api_chat_title(number: int) -> str:
    """How the app names the local server's ``number``-th session (its own id,
    "api-3f2a9c…", means nothing to a reader)."""
    return f"Another app's chat {number}"
