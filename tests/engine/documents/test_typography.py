"""Typesetting undone in a PDF's text (engine.documents.typography), and what it keeps."""

from __future__ import annotations

import pytest

from engine.documents.typography import untypeset


@pytest.mark.parametrize(("typeset", "plain"), [
    ("ﬁnd the ﬁrst ﬂow: ﬀ ﬃ ﬄ ﬅ ﬆ", "find the first flow: ff ffi ffl st st"),
    ("infor\u00admation, infor\u00ad\nmation", "information, information"),
    ("An exam-\nple, a naïve-\nté", "An example, a naïveté"),
], ids=["ligatures", "soft hyphens", "broken words"])
def test_typesetting_is_undone(typeset: str, plain: str) -> None:
    assert untypeset(typeset) == plain


@pytest.mark.parametrize("text", [
    "Items:\n- one\n- two",  # a list
    "the cost -\nthat is, the price",  # a dash after a space
    "pages 1-\n2",  # after a digit
    "an X-\nray",  # after one letter
    "Jean-\nPaul, Covid-\n19",  # a capital or a digit next
    "½ of x² in ｆｕｌｌ width",  # other compatibility characters NFKC would change
])
def test_other_text_is_kept_as_it_is(text: str) -> None:
    assert untypeset(text) == text
