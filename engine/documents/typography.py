"""Typesetting undone in text taken from a page layout (a PDF's text layer).

A PDF's text is the glyphs a typesetter placed, so it keeps what only printing
needed: ligature characters ("ﬁnd", which a model and a search read as another
word), soft hyphens, and words broken across a line end ("exam-⏎ple"). These
are undone conservatively; any other text is left exactly as it is.
"""

from __future__ import annotations

import re
import unicodedata

# The Latin ligatures (U+FB00–FB06: ff, fi, fl, ffi, ffl, long s t, st) as the
# letters they join; NFKC only on them, as on the whole text it would also change
# superscripts, fractions, full-width forms and more.
_LIGATURES = range(0xFB00, 0xFB07)
SOFT_HYPHEN = "\u00ad"
_PLAIN = str.maketrans({**{code: unicodedata.normalize("NFKC", chr(code)) for code in _LIGATURES},
                        ord(SOFT_HYPHEN): None})
# A hyphen ending a line after two letters, with a lowercase letter starting the
# next: a word the typesetter broke ("exam-⏎ple"). A dash after a space, a list's
# "-", a hyphen after a digit or one letter ("X-⏎ray"), or a line going on with a
# capital or a digit are kept. A compound broken at its own hyphen ("well-⏎known")
# is joined too ("wellknown"): a PDF's text cannot tell the two apart, and broken
# words are far more common.
_BROKEN_WORD = re.compile(r"(?<=[^\W\d_]{2})-\n(?=[^\W\d_])")


def untypeset(text: str) -> str:
    """``text`` with ligatures spelt out, soft hyphens dropped and words broken across
    a line end joined."""
    # A soft hyphen at a line end marks a break inside a word: the line end goes too.
    text = text.replace(SOFT_HYPHEN + "\n", "").translate(_PLAIN)
    return _BROKEN_WORD.sub(_joined, text)


def _joined(match: re.Match[str]) -> str:
    following = match.string[match.end()]
    return "" if following.islower() else match.group()
