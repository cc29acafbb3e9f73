"""The macOS CI workflow: valid YAML, an arm64 runner, and the steps it promises."""

from __future__ import annotations

from pathlib import Path

import yaml

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "macos-app.yml"


def steps() -> list[dict]:
    document = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert isinstance(document, dict) and document.get("name")
    # YAML 1.1 reads the bare key `on` as True.
    assert document.get("on", document.get(True)), "the workflow has no trigger"
    (job,) = document["jobs"].values()
    assert job["runs-on"] == "macos-14"  # Apple Silicon
    return job["steps"]


def run_of(name: str) -> str:
    step = next((s for s in steps() if s.get("name") == name), None)
    assert step is not None, f"no step named {name!r}"
    return step.get("run", "")


def test_the_workflow_builds_self_tests_and_tests_the_app() -> None:
    assert "scripts/setup.sh" in run_of("Install Longleaf")
    assert "packaging/build.py" in run_of("Build Longleaf.app")
    assert "Longleaf.app/Contents/MacOS/Longleaf --self-test" in run_of("Self-test the built app")
    assert "run-tests.sh" in run_of("Run the test suite")
    assert "screencapture" in run_of("Screenshot the app")


def test_the_app_and_the_screenshot_are_kept_as_artifacts() -> None:
    uploads = [s for s in steps() if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    paths = {s["with"]["path"] for s in uploads}
    assert paths == {"Longleaf.app.zip", "screenshots/"}
    assert all(s.get("if") == "always()" for s in uploads)
    assert "ditto" in run_of("Zip the app") and "Longleaf.app" in run_of("Zip the app")
