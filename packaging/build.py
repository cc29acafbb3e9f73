"""Build Longleaf with PyInstaller: ``python packaging/build.py [--sign ID] [--notarize PROFILE]``.

macOS (Apple Silicon): ``dist/Longleaf.app``; Linux: the one-folder ``dist/Longleaf/``.
Steps: make the .icns from the icon source, run PyInstaller on longleaf.spec,
check the bundle holds what a working app needs (MLX's native library, and on
macOS mlx.metallib; the demo GGUF), then optionally sign and notarize.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bundle_config as config  # noqa: E402  (a sibling file, not an installed package)

MAC = sys.platform == "darwin"


def bundle_root(dist: Path) -> Path:
    """The folder whose contents are the frozen app's files."""
    if MAC:
        return dist / f"{config.APP_NAME}.app" / "Contents"
    return dist / config.APP_NAME


def executable(dist: Path) -> Path:
    """The program to run: ``Longleaf.app/Contents/MacOS/Longleaf`` or ``Longleaf/Longleaf``."""
    if MAC:
        return bundle_root(dist) / "MacOS" / config.APP_NAME
    return bundle_root(dist) / config.APP_NAME


def missing_files(dist: Path) -> list[str]:
    """What a working bundle must hold but this one lacks (empty when complete)."""
    files = {p.name for p in bundle_root(dist).rglob("*") if p.is_file() or p.is_symlink()}
    required = [Path(config.DEMO_GGUF).name]
    required.append("libmlx.dylib" if MAC else "libmlx.so")
    if MAC:
        required.append("mlx.metallib")
    return [name for name in required if name not in files]


def bundled_modules(dist: Path) -> list[str]:
    """Every Python module the bundle's archive holds, by dotted name."""
    from PyInstaller.archive.readers import pkg_archive_contents

    return pkg_archive_contents(str(executable(dist)))


def stray_modules(modules: list[str]) -> list[str]:
    """The modules of the checkout's non-product packages (benchmarks, tests) among ``modules``."""
    return [name for name in modules if name.split(".")[0] in config.NOT_SHIPPED]


def build(dist: Path, work: Path, *, clean: bool = False) -> Path:
    """Run PyInstaller; returns the bundle's executable."""
    icns = work / f"{config.APP_NAME}.icns"
    subprocess.run(
        [sys.executable, str(HERE / "make_icon.py"), str(icns)], check=True, cwd=config.ROOT
    )
    command = [
        sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
        "--distpath", str(dist), "--workpath", str(work / "pyinstaller"),
        str(HERE / "longleaf.spec"),
    ]
    if clean:
        command.insert(3, "--clean")
    environment = {**os.environ, "LONGLEAF_ICNS": str(icns)}
    subprocess.run(command, check=True, cwd=config.ROOT, env=environment)
    missing = missing_files(dist)
    if missing:
        raise SystemExit(f"The bundle is broken, it lacks: {', '.join(missing)}")
    stray = stray_modules(bundled_modules(dist))
    if stray:
        raise SystemExit(f"The bundle holds modules that do not ship: {', '.join(stray)}")
    return executable(dist)


def sign(app: Path, identity: str) -> None:
    """Sign every binary inside, then the app, with the hardened runtime notarization needs."""
    entitlements = HERE / "entitlements.plist"
    subprocess.run(
        ["codesign", "--force", "--deep", "--timestamp", "--options", "runtime",
         "--entitlements", str(entitlements), "--sign", identity, str(app)],
        check=True,
    )
    subprocess.run(["codesign", "--verify", "--deep", "--strict", "--verbose=2", str(app)],
                   check=True)


def notarize(app: Path, profile: str) -> None:
    """Send the app to Apple's notary service and staple the ticket to it."""
    archive = app.with_suffix(".zip")
    subprocess.run(["ditto", "-c", "-k", "--keepParent", str(app), str(archive)], check=True)
    subprocess.run(["xcrun", "notarytool", "submit", str(archive),
                    "--keychain-profile", profile, "--wait"], check=True)
    subprocess.run(["xcrun", "stapler", "staple", str(app)], check=True)
    archive.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the Longleaf app bundle.")
    parser.add_argument("--dist", type=Path, default=config.ROOT / "dist")
    parser.add_argument("--work", type=Path, default=config.PACKAGING / "build")
    parser.add_argument("--clean", action="store_true", help="drop PyInstaller's cache first")
    parser.add_argument("--sign", metavar="IDENTITY",
                        help='macOS: e.g. "Developer ID Application: Name (TEAMID)"')
    parser.add_argument("--notarize", metavar="PROFILE",
                        help="macOS: a `xcrun notarytool store-credentials` profile name")
    args = parser.parse_args(argv)
    if (args.sign or args.notarize) and not MAC:
        parser.error("--sign and --notarize only apply on macOS")
    if args.notarize and not args.sign:
        parser.error("--notarize needs --sign (Apple only notarizes signed apps)")
    started = time.monotonic()
    program = build(args.dist.resolve(), args.work.resolve(), clean=args.clean)
    app = args.dist.resolve() / f"{config.APP_NAME}.app"
    if args.sign:
        sign(app, args.sign)
    if args.notarize:
        notarize(app, args.notarize)
    print(f"built {program} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
