"""``python -m engine serve``: its options and the refusal to serve the network keyless."""

from __future__ import annotations

import io

from engine import cli


def test_serve_options_default_to_this_machine() -> None:
    args = cli.build_parser().parse_args(["serve", "--model", "demo"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 1234, None)
    assert args.handler is cli.serve


def test_serving_the_network_needs_an_api_key(capsys) -> None:
    status = cli.main(["serve", "--model", "demo", "--host", "0.0.0.0"], io.StringIO())
    assert status == 1
    assert "--api-key" in capsys.readouterr().err


def test_the_disk_budget_option(capsys) -> None:
    args = cli.build_parser().parse_args(["serve", "--model", "demo", "--kv-disk-budget", "5"])
    assert args.kv_disk_budget == 5.0
    assert cli.build_parser().parse_args(["serve", "--model", "demo"]).kv_disk_budget is None
    assert cli.main(["serve", "--model", "demo", "--kv-disk-budget", "-1"], io.StringIO()) == 1
    assert "negative" in capsys.readouterr().err
