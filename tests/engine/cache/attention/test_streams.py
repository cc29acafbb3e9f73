"""Attention work split over CPU streams: KV heads, and a batch's rows."""

from __future__ import annotations

from engine.cache.attention import streams


def test_head_groups_cover_every_head_once(monkeypatch) -> None:
    monkeypatch.setattr(streams, "cpu_cores", lambda: 3)
    many = streams.SPLIT_MIN_VALUES
    groups = streams.head_groups(8, many)
    assert [(g.start, g.stop) for g, _ in groups] == [(0, 2), (2, 5), (5, 8)]
    assert len({id(stream) for _, stream in groups}) == 3
    assert streams.head_groups(8, many - 1) == [(slice(0, 8), None)]  # too little work
    monkeypatch.setattr(streams, "cpu_cores", lambda: 1)
    assert streams.head_groups(8, many) == [(slice(0, 8), None)]


def test_a_long_decode_step_splits_its_heads_but_a_batch_row_does_not(monkeypatch) -> None:
    monkeypatch.setattr(streams, "cpu_cores", lambda: 2)
    long = streams.DECODE_SPLIT_MIN_VALUES
    assert len(streams.decode_groups(4, long)) == 2
    assert streams.decode_groups(4, long - 1) == [(slice(0, 4), None)]
    with streams.on_row_stream(None):
        assert streams.decode_groups(4, long) == [(slice(0, 4), None)]
    assert len(streams.decode_groups(4, long)) == 2  # only inside the row


def test_a_batchs_rows_spread_over_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(streams, "cpu_cores", lambda: 2)
    rows = streams.row_streams(3)
    assert rows[0] is not None and rows[1] is not None
    assert rows[0] != rows[1] and rows[2] == rows[0]
    monkeypatch.setattr(streams, "cpu_cores", lambda: 1)
    assert streams.row_streams(3) == [None, None, None]


def test_a_model_on_another_thread_attends_alike_with_its_heads_split(
    tmp_path, monkeypatch
) -> None:
    # The streams belong to the thread that makes them: an engine-like worker
    # thread runs a tiny llama's prefill chunks and decode steps with every layer's
    # heads split over two streams, and gets the logits one stream gives.
    import threading

    import mlx.core as mx
    import numpy as np

    from engine.cache import adapter
    from tests.engine.tinymodels import load_tiny

    model = load_tiny(tmp_path, "llama")[0]
    prompt = mx.random.randint(0, model.args.vocab_size, (1, 70), key=mx.random.key(3))

    def run(cores: int, out: list[np.ndarray]) -> None:
        monkeypatch.setattr(streams, "cpu_cores", lambda: cores)
        cache = adapter.make_cache(model, "q6", page_size=16)
        for start in range(0, 64, 32):
            mx.eval(model(prompt[:, start : start + 32], cache=cache))
        for step in range(64, 70):  # decode steps: the packed path
            logits = model(prompt[:, step : step + 1], cache=cache)
            out.append(np.array(logits[0, -1].astype(mx.float32)))

    monkeypatch.setattr(streams, "SPLIT_MIN_VALUES", 0)
    monkeypatch.setattr(streams, "DECODE_SPLIT_MIN_VALUES", 0)
    alone: list[np.ndarray] = []
    run(1, alone)
    split: list[np.ndarray] = []
    worker = threading.Thread(target=run, args=(2, split))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive() and len(split) == len(alone) == 6
    for one, other in zip(alone, split, strict=True):
        np.testing.assert_allclose(other, one, atol=1e-4 * float(np.abs(one).max()))
