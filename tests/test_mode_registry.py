"""A mode added to the registry alone is offered and handled everywhere.

A throwaway 5-bit mode (a fifth row and its packing, registered for one test
and removed after it) must reach the CLI, the HTTP API's parsing, the fit
check, the app's menus, tables and blurbs, and a stored snapshot, with no other
file knowing it exists. The distributed followers are the exception, by
nature: they are other processes, which know the registry they import.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from PySide6.QtWidgets import QMenu, QWidget

from app.memory.fit_check import fit_html
from app.memory.panel import MemoryPanel
from app.memory.quality import advice
from app.sessions.reopen import fill_reopen_menu
from app.sessions.session_list import mode_colour
from app.settings import Settings
from app.window.dialogs import NewChatDialog, SettingsDialog
from app.window.models_dialog import columns
from engine.cache import kvquant
from engine.cache.modes import MODES, KvMode, ModeFacts, packed_group
from engine.cli import build_parser, main
from engine.events import QualityReceipt
from engine.memory.fit import fit_report
from engine.server.protocol import mode_from
from engine.snapshots.layers import can_convert
from tests.engine.tinymodels import make_tiny_model_dir

Q5 = KvMode("q5")
BITS = 5
ROW = ModeFacts(Q5, BITS, rotated=True, label="5-bit — a test's own",
                description="a mode only this test knows", colour="#123456",
                aliases=("5", "5bit"))


def _pack(u: mx.array) -> mx.array:
    """Codes as MLX's little-endian bit stream: value ``i`` at bit ``5 * i``."""
    values, nbytes = packed_group(BITS)
    groups = u.reshape(*u.shape[:-1], -1, values).astype(mx.uint16)
    out = []
    for byte in range(nbytes):
        part = mx.zeros(groups.shape[:-1], mx.uint16)
        for i in range(values):
            shift = BITS * i - 8 * byte
            if -BITS < shift < 8:
                code = groups[..., i]
                part = part | (code << shift if shift >= 0 else code >> -shift)
        out.append(part & 0xFF)
    return mx.stack(out, axis=-1).astype(mx.uint8).reshape(*u.shape[:-1], -1)


def _unpack(packed: mx.array) -> mx.array:
    values, nbytes = packed_group(BITS)
    groups = packed.reshape(*packed.shape[:-1], -1, nbytes).astype(mx.uint16)
    out = []
    for i in range(values):
        code = mx.zeros(groups.shape[:-1], mx.uint16)
        for byte in range(nbytes):
            shift = 8 * byte - BITS * i
            if -8 < shift < BITS:
                part = groups[..., byte]
                code = code | (part << shift if shift >= 0 else part >> -shift)
        out.append(code & (2**BITS - 1))
    return mx.stack(out, axis=-1).astype(mx.uint8).reshape(*packed.shape[:-1], -1)


@pytest.fixture
def q5() -> Iterator[KvMode]:
    """The fifth mode, registered for one test."""
    kvquant.register_packing(BITS, _pack, _unpack)
    MODES.add(ROW)
    try:
        yield Q5
    finally:
        MODES.remove(Q5)
        kvquant.unregister_packing(BITS)


def test_the_packing_is_mlx_bit_stream(q5: KvMode) -> None:
    rng = np.random.default_rng(0)
    u = rng.integers(1, 32, size=(3, 64)).astype(np.uint8)
    packed = _pack(mx.array(u))
    bits = np.unpackbits(np.array(packed), axis=-1, bitorder="little")
    expected = np.unpackbits(u[..., None], axis=-1, bitorder="little")[..., :BITS]
    assert np.array_equal(bits, expected.reshape(3, -1))
    assert np.array_equal(np.array(_unpack(packed)), u)


def test_storage_sizes_and_round_trip(q5: KvMode) -> None:
    sizes = [kvquant.project_kv_bytes(2, 2, 64, 100, m) for m in ("q6", q5, "q4")]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    x = mx.random.normal((4, 64), key=mx.random.key(1))
    codes, scales = kvquant.quantize_rows(x, BITS)
    back = kvquant.dequantize_rows(codes, scales, BITS, 64)
    error = np.abs(np.array(back) - np.array(x))
    assert (error <= np.array(scales.astype(mx.float32)) / 2 + 1e-6).all()


def test_the_cli_and_the_api_take_it(q5: KvMode) -> None:
    for command, extra in (("generate", ["--prompt", "hi"]), ("serve", [])):
        args = build_parser().parse_args([command, "--model", "demo", "--kv", "5bit", *extra])
        assert args.kv == q5
    assert mode_from("demo@q5", {}) == q5 and mode_from("demo", {"kv_mode": "5"}) == q5


def test_a_chat_in_it_is_stored_and_reused(q5: KvMode, tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    argv = ["generate", "--model", str(folder), "--kv", "q5", "--page-size", "16", "--temp",
            "0", "--max-tokens", "4", "--prompt", "A long enough prompt. " * 8, "--json",
            "--session", "doc", "--session-dir", str(tmp_path / "kv")]
    first, again = (json.loads(_generate(argv)) for _ in range(2))
    assert first["kv_mode"] == again["kv_mode"] == q5
    manifest = json.loads((tmp_path / "kv" / "cli-doc.json").read_text(encoding="utf-8"))
    assert manifest["mode"] == "q5"
    assert again["reused_tokens"] == again["prompt_tokens"] - 1
    assert again["tokens"] == first["tokens"]
    assert can_convert(KvMode("q6"), q5) and not can_convert(q5, KvMode("q6"))


def _generate(argv: list[str]) -> str:
    out = io.StringIO()
    assert main(argv, out=out) == 0
    return out.getvalue()


def test_the_fit_check_projects_it(q5: KvMode) -> None:
    report = fit_report(token_count=1000, attention_layers=2, kv_heads=2, head_dim=64,
                        max_context=4096, page_size=16, available_bytes=2**30,
                        session_mode=q5)
    assert [entry.mode for entry in report.modes] == list(MODES)
    assert report.for_mode(q5).fits
    html, fits = fit_html(report, q5, 1000)
    assert fits and "<b>q5 " in html


def test_the_app_offers_it(q5: KvMode, qtbot) -> None:
    chooser = NewChatDialog(q5, None)
    qtbot.addWidget(chooser)
    assert chooser.mode() == q5 and "5-bit — a test's own" in chooser.buttons[q5].text()
    settings = SettingsDialog(Settings())
    qtbot.addWidget(settings)
    assert q5 in [settings.mode.itemText(i) for i in range(settings.mode.count())]
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    rows = [panel.table.verticalHeaderItem(i).text() for i in range(panel.table.rowCount())]
    assert rows == list(MODES)
    assert "q5" in columns() and mode_colour(q5).name() == "#123456"


def test_the_reopen_menu_and_the_quality_advice_name_it(q5: KvMode, qtbot) -> None:
    parent = QWidget()
    qtbot.addWidget(parent)
    menu = QMenu(parent)
    controller = SimpleNamespace(current=SimpleNamespace(kv_mode="q8"))
    fill_reopen_menu(menu, controller, parent)
    tips = {a.text(): a.toolTip() for a in menu.actions()}
    assert tips["Reopen in q5…"].endswith("a mode only this test knows")
    close = QualityReceipt(mode=KvMode("q6"), rotated=True, window_tokens=1024,
                           context_tokens=1024, positions=1024, top1=1.0, kl_mean=0.0,
                           kl_p99=0.0, model="m", measured_at=0.0)
    assert "try q5" in advice(close)
    far = replace(close, mode=q5, kl_mean=9.0)
    assert advice(far) == "Reopen this chat in q6: its answers stay closer to fp16."
