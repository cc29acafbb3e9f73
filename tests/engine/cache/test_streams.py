"""KV heads split over CPU streams."""

from __future__ import annotations

from engine.cache import streams


def test_head_groups_cover_every_head_once(monkeypatch) -> None:
    monkeypatch.setattr(streams, "cpu_cores", lambda: 3)
    many = streams.SPLIT_MIN_VALUES
    groups = streams.head_groups(8, many)
    assert [(g.start, g.stop) for g, _ in groups] == [(0, 2), (2, 5), (5, 8)]
    assert len({id(stream) for _, stream in groups}) == 3
    assert streams.head_groups(8, many - 1) == [(slice(0, 8), None)]  # too little work
    monkeypatch.setattr(streams, "cpu_cores", lambda: 1)
    assert streams.head_groups(8, many) == [(slice(0, 8), None)]
