"""``check_hosts``: each host of an MLX hostfile asked for its Longleaf and model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.distributed.hosts import check_hosts, probe, verdict
from engine.errors import EngineError
from tests.engine.tinymodels import make_tiny_model_dir


def _hostfile(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": host, "ips": ["127.0.0.1"]} for host in hosts]}), encoding="utf-8")
    return path


def test_two_local_ranks_with_the_model_pass(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    checks = check_hosts(_hostfile(tmp_path, ["127.0.0.1", "127.0.0.1"]), model)
    assert [check.ok for check in checks] == [True, True], checks
    assert checks[1].message.startswith("Rank 1 (127.0.0.1): reachable")
    assert "same model" in checks[1].message


def test_an_unreachable_host_is_named(tmp_path: Path) -> None:
    # .invalid never resolves (RFC 2606): ssh fails at once, no network needed.
    checks = check_hosts(_hostfile(tmp_path, ["127.0.0.1", "mac-two.invalid"]), None,
                         connect_timeout=2, timeout=30)
    assert checks[0].ok
    assert not checks[1].ok and checks[1].host == "mac-two.invalid"
    assert checks[1].message.startswith("Rank 1 (mac-two.invalid) cannot be reached by ssh")


def test_the_first_host_must_be_this_machine(tmp_path: Path) -> None:
    checks = check_hosts(_hostfile(tmp_path, ["mac-one.invalid", "127.0.0.1"]), None,
                         connect_timeout=2, timeout=30)
    assert not checks[0].ok and "must be this Mac" in checks[0].message
    assert checks[1].ok


def test_a_model_missing_here_is_refused_before_asking(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="cannot read the model folder"):
        check_hosts(_hostfile(tmp_path, ["127.0.0.1", "127.0.0.1"]), tmp_path / "none")


def test_an_unusable_hostfile_says_the_format(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text("not json", encoding="utf-8")
    with pytest.raises(EngineError, match="An MLX hostfile is JSON"):
        check_hosts(path, None)


def test_other_versions_weights_or_no_folder_are_named(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    here = probe(str(model))
    other = {**here, "version": "0.0.1"}
    assert "runs Longleaf 0.0.1, this Mac runs" in verdict(1, "b", here, other, str(model)).message
    weights = {**here, "model": {"digest": "f" * 64}}
    check = verdict(1, "b", here, weights, str(model))
    assert not check.ok and check.message.startswith(f"Rank 1 (b) has other weights in {model}")
    gone = {**here, "model": {"error": "missing"}}
    assert f"has no folder {model}" in verdict(1, "b", here, gone, str(model)).message
    assert verdict(1, "b", here, dict(here), str(model)).ok


def test_a_ring_address_the_host_does_not_have_is_named(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    # 192.0.2.0/24 is reserved for documentation (RFC 5737): no machine has it.
    path.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
        {"ssh": "127.0.0.1", "ips": ["192.0.2.7"]}]}), encoding="utf-8")
    checks = check_hosts(path, None)
    assert checks[0].ok, checks
    assert not checks[1].ok
    assert checks[1].message.startswith(
        "Rank 1 (127.0.0.1) does not have the address 192.0.2.7 the hostfile gives its link")
    here = probe(None)
    assert "127.0.0.1" in here["addresses"]
    unlisted = {key: value for key, value in here.items() if key != "addresses"}
    assert verdict(1, "b", here, unlisted, None, ["192.0.2.7"]).ok
