"""Make Longleaf's macOS icon: draw the source PNG (once) and build the .icns.

``python packaging/make_icon.py --draw`` redraws ``packaging/longleaf-icon.png``;
``python packaging/make_icon.py OUT.icns`` writes the .icns from the first
source image found (see ``bundle_config.ICON_SOURCES``). Qt's QImage does the
drawing and scaling, and the .icns container is written here (PNG payloads,
which macOS 10.7+ reads), so no Mac tools are needed and Linux builds match.
"""

from __future__ import annotations

import argparse
import math
import struct
import sys
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QImage, QLinearGradient, QPainter, QPainterPath, QPen

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bundle_config  # a sibling file, not an installed package

# icns element type -> pixel size (the @2x types hold the doubled size).
ICNS_TYPES: tuple[tuple[str, int], ...] = (
    ("icp4", 16),
    ("icp5", 32),
    ("icp6", 64),
    ("ic07", 128),
    ("ic08", 256),
    ("ic09", 512),
    ("ic10", 1024),
    ("ic11", 32),
    ("ic12", 64),
    ("ic13", 256),
    ("ic14", 512),
)


def draw_icon(size: int = 1024) -> QImage:
    """Draw the icon: a fan of longleaf pine needles over three KV pages."""
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    unit = size / 1024
    # macOS icon grid: an 824 px rounded square centred on the 1024 canvas.
    body = QRectF(100 * unit, 100 * unit, 824 * unit, 824 * unit)
    background = QLinearGradient(body.topLeft(), body.bottomLeft())
    background.setColorAt(0.0, QColor("#2f6b4a"))
    background.setColorAt(1.0, QColor("#123326"))
    outline = QPainterPath()
    outline.addRoundedRect(body, 185 * unit, 185 * unit)
    painter.fillPath(outline, background)
    _draw_pages(painter, unit)
    _draw_needles(painter, unit)
    painter.end()
    return image


def _draw_pages(painter: QPainter, unit: float) -> None:
    colors = ("#f2c879", "#e7a94f", "#d98b2b")
    for index, color in enumerate(colors):
        page = QRectF((292 + index * 78) * unit, (700 - index * 34) * unit, 284 * unit, 150 * unit)
        painter.setPen(QPen(QColor("#123326"), 10 * unit))
        painter.setBrush(QColor(color))
        painter.drawRoundedRect(page, 26 * unit, 26 * unit)


def _draw_needles(painter: QPainter, unit: float) -> None:
    base = QPointF(512 * unit, 600 * unit)
    painter.setBrush(Qt.BrushStyle.NoBrush)
    for index in range(11):
        angle = math.radians(-150 + index * 12)
        length = (430 - abs(index - 5) * 22) * unit
        tip = QPointF(base.x() + length * math.cos(angle), base.y() + length * math.sin(angle))
        bend = QPointF(
            base.x() + 0.55 * length * math.cos(angle) - 30 * unit * math.sin(angle),
            base.y() + 0.55 * length * math.sin(angle),
        )
        needle = QPainterPath(base)
        needle.quadTo(bend, tip)
        shade = QColor("#b8e07a") if index % 2 else QColor("#8fcf5e")
        painter.setPen(QPen(shade, 22 * unit, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
        painter.drawPath(needle)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QColor("#6b4226"))
    painter.drawEllipse(base, 34 * unit, 34 * unit)


def png_bytes(image: QImage) -> bytes:
    """Encode a QImage as PNG."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise RuntimeError("Qt could not encode the icon as PNG")
    buffer.close()
    return bytes(data.data())


def icns_bytes(source: QImage) -> bytes:
    """Build an .icns container holding every standard size as PNG."""
    square = min(source.width(), source.height())
    if square < 1024:
        raise ValueError(f"The icon source must be at least 1024x1024, not {square}x{square}")
    elements = []
    for kind, pixels in ICNS_TYPES:
        scaled = source.scaled(
            pixels,
            pixels,
            Qt.AspectRatioMode.IgnoreAspectRatio,
            Qt.TransformationMode.SmoothTransformation,
        )
        payload = png_bytes(scaled)
        elements.append(kind.encode("ascii") + struct.pack(">I", 8 + len(payload)) + payload)
    body = b"".join(elements)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def read_icns(data: bytes) -> dict[str, bytes]:
    """Split an .icns container into its elements (for checks)."""
    if data[:4] != b"icns" or struct.unpack(">I", data[4:8])[0] != len(data):
        raise ValueError("not an icns file")
    elements, offset = {}, 8
    while offset < len(data):
        kind = data[offset : offset + 4].decode("ascii")
        (length,) = struct.unpack(">I", data[offset + 4 : offset + 8])
        elements[kind] = data[offset + 8 : offset + length]
        offset += length
    return elements


def write_icns(out: Path, source: Path | None = None) -> Path:
    """Write ``out`` from ``source`` (default: the first icon source that exists)."""
    source = source or bundle_config.icon_source()
    image = QImage(str(source))
    if image.isNull():
        raise ValueError(f"Qt cannot read the icon image {source}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(icns_bytes(image))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="the .icns file to write")
    parser.add_argument("--draw", action="store_true", help="redraw packaging/longleaf-icon.png")
    args = parser.parse_args(argv)
    if args.draw:
        target = bundle_config.ICON_SOURCES[-1]
        draw_icon().save(str(target), "PNG")
        print(f"drew {target}")
    if args.out:
        print(f"wrote {write_icns(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
