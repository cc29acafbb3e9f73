"""The bundle's metadata: version, Info.plist, document types, icon."""

from __future__ import annotations

import plistlib
import struct
import tomllib

import pytest
from PySide6.QtGui import QImage

from engine.documents import reader as documents
from tests.packaging.conftest import PACKAGING, load_packaging_module

config = load_packaging_module("bundle_config")
make_icon = load_packaging_module("make_icon")


def test_version_comes_from_the_package() -> None:
    with (config.ROOT / "pyproject.toml").open("rb") as source:
        declared = tomllib.load(source)["project"]["version"]
    assert config.version() == declared
    plist = config.info_plist()
    assert plist["CFBundleShortVersionString"] == plist["CFBundleVersion"] == declared


def test_info_plist_is_a_valid_plist_with_the_keys_macos_needs() -> None:
    plist = plistlib.loads(plistlib.dumps(config.info_plist("1.2.3")))
    assert plist["CFBundleIdentifier"] == "org.longleaf.Longleaf"
    assert plist["NSHighResolutionCapable"] is True
    major, minor = (int(part) for part in plist["LSMinimumSystemVersion"].split("."))
    assert (major, minor) >= (14, 0)  # MLX wheels install on macOS 14+ only
    assert plist["LSArchitecturePriority"] == ["arm64"]


def test_every_document_the_app_reads_can_be_dropped_on_the_icon() -> None:
    types = config.document_types()
    extensions = {ext for kind in types for ext in kind["CFBundleTypeExtensions"]}
    readable = documents.TEXT_SUFFIXES | documents.SOURCE_SUFFIXES
    readable |= documents.PDF_SUFFIXES | documents.DOCX_SUFFIXES
    assert extensions == {suffix.lstrip(".") for suffix in readable}
    assert {"txt", "md", "pdf", "docx", "py", "rs", "swift"} <= extensions
    by_name = {kind["CFBundleTypeName"]: kind for kind in types}
    assert by_name["PDF document"]["LSItemContentTypes"] == ["com.adobe.pdf"]
    assert "net.daringfireball.markdown" in by_name["Text and Markdown"]["LSItemContentTypes"]
    assert "public.source-code" in by_name["Source code"]["LSItemContentTypes"]
    # A viewer that never claims to be the default app for someone's files.
    assert {(k["CFBundleTypeRole"], k["LSHandlerRank"]) for k in types} == {
        ("Viewer", "Alternate")
    }


def test_demo_gguf_is_found_for_bundling() -> None:
    gguf = config.demo_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_icns_holds_every_size_as_png() -> None:
    source = config.icon_source()
    assert source.is_relative_to(config.ROOT)
    elements = make_icon.read_icns(make_icon.icns_bytes(QImage(str(source))))
    assert set(elements) == {kind for kind, _ in make_icon.ICNS_TYPES}
    for kind, pixels in make_icon.ICNS_TYPES:
        assert elements[kind][:8] == b"\x89PNG\r\n\x1a\n", kind
        width, height = struct.unpack(">II", elements[kind][16:24])  # PNG IHDR
        assert (width, height) == (pixels, pixels), kind


def test_icns_refuses_a_small_source() -> None:
    with pytest.raises(ValueError, match="at least 1024"):
        make_icon.icns_bytes(QImage(512, 512, QImage.Format.Format_ARGB32))


def test_icon_source_is_a_square_with_transparent_corners() -> None:
    committed = QImage(str(PACKAGING / "longleaf-icon.png"))
    assert (committed.width(), committed.height()) == (1024, 1024)
    # macOS draws no mask: the rounded square's corners must be see-through.
    assert committed.pixelColor(10, 10).alpha() == 0
    assert committed.pixelColor(512, 200).alpha() == 255
