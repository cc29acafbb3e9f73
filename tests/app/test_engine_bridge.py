"""``EngineBridge.replace_worker``: a new worker takes new requests, the old one's end at
their handlers, and the old one is shut down once the last of them has ended."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import app.controller as controller_module
from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import HistoryStore
from engine import EngineStopped, Failed, Finished, ModelLoaded, PipelineLost, TokenChunk
from tests.app.scripted import ScriptedWorker


class EventfulWorker(ScriptedWorker):
    """A scripted worker that keeps the ``on_event`` it was built with."""

    def __init__(self, on_event) -> None:
        super().__init__()
        self.on_event = on_event


def _factory(made: list[EventfulWorker]):
    def build(on_event, _budget_bytes, _chunk_size, _read_share):
        made.append(EventfulWorker(on_event))
        return made[-1]
    return build


def test_the_old_workers_requests_end_at_their_handlers(qtbot) -> None:
    made: list[EventfulWorker] = []
    bridge = EngineBridge(worker_factory=_factory(made))
    bridge.start()
    seen: list[object] = []
    old_rid = bridge.chat("s", [], None, seen.append)
    bridge.replace_worker()  # the bridge's own factory again: a second worker
    old, new = made
    assert bridge.worker is new and new.alive and old.alive
    new_rid = bridge.chat("s", [], None, seen.append)
    assert new_rid != old_rid  # both workers numbered theirs from 1
    new.on_event(TokenChunk(1, "new", (2,)))
    old.on_event(TokenChunk(1, "old", (1,)))
    old.on_event(Finished(1, "stop"))
    qtbot.waitUntil(lambda: len(seen) == 3)
    assert [(e.request_id, getattr(e, "text", None)) for e in seen] == [
        (new_rid, "new"), (old_rid, "old"), (old_rid, None)]
    qtbot.waitUntil(lambda: not old.alive)  # its last request ended: shut down
    assert new.alive and bridge.pending == 1
    bridge.shutdown(0)


def test_a_claim_sees_only_the_events_of_its_own_worker(qtbot) -> None:
    made: list[EventfulWorker] = []
    bridge = EngineBridge(worker_factory=_factory(made))
    claimed: list[object] = []
    bridge.add_claim(lambda event: claimed.append(event) or True)
    bridge.replace_worker()
    old, new = made
    old.on_event(Finished(7, "done"))
    new.on_event(Finished(7, "done"))
    assert claimed == [Finished(7, "done")] and len(claimed) == 1
    qtbot.wait(20)
    bridge.shutdown(0)


@pytest.fixture
def lost(qtbot, tmp_path, monkeypatch):
    """The controller on a scripted pipeline worker that has loaded "big"."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": [{"ssh": "127.0.0.1"}] * 2}), encoding="utf-8")
    settings = Settings()
    settings.pipeline_enabled, settings.pipeline_hostfile = True, str(hostfile)
    monkeypatch.setattr("app.machines.can_split_model", lambda path: path == "big")
    local: list[EventfulWorker] = []
    remote: list[EventfulWorker] = []
    bridge = EngineBridge(worker_factory=_factory(local))
    store = HistoryStore()
    controller = ChatController(settings, store, bridge)
    controller.machines.remote_worker = lambda on_event, *_a, **_k: remote.append(
        EventfulWorker(on_event)) or remote[-1]
    controller.start("big")
    assert bridge.worker is remote[0]
    for worker in (local[0], remote[0]):  # the stored-KV budget each was given
        worker.on_event(Finished(worker.last("snapshot_budget")[0], "done"))
    rid = remote[0].last("load")[0]
    remote[0].on_event(ModelLoaded(rid, SimpleNamespace(name="big", path="big")))
    remote[0].on_event(Finished(rid, "done"))
    qtbot.waitUntil(lambda: controller.model_ready)
    qtbot.waitUntil(lambda: not local[0].alive)  # nothing owed: shut down
    yield SimpleNamespace(c=controller, bridge=bridge, local=local, remote=remote)
    controller.shutdown(0)
    store.close()


def test_a_lost_pipeline_reloads_the_model_here_when_it_fits(qtbot, lost, monkeypatch) -> None:
    monkeypatch.setattr(controller_module, "fits_here", lambda path: "")
    notices: list[str] = []
    lost.c.notice.connect(notices.append)
    lost.remote[0].on_event(PipelineLost("The pipeline lost rank 1 (mac2)."))
    qtbot.waitUntil(lambda: len(lost.local) == 2)
    assert lost.bridge.worker is lost.local[1]
    assert lost.local[1].last("load")[1] == ("big",)  # here, not on a new pipeline
    assert notices == ["The pipeline lost rank 1 (mac2). Longleaf goes on with big on this "
                       "Mac alone; your chats are kept."]
    qtbot.waitUntil(lambda: not lost.remote[0].alive)


def test_a_lost_pipeline_takes_no_message_before_the_model_is_loaded_here(
        qtbot, lost, monkeypatch) -> None:
    monkeypatch.setattr(controller_module, "fits_here", lambda path: "")
    errors: list[str] = []
    lost.c.errorRaised.connect(errors.append)
    # A job still in line when the pipeline goes: the load here waits for it.
    job = lost.c.activity.add("other", "quality", "Other", lambda job: None,
                              lambda job: None)
    lost.remote[0].on_event(PipelineLost("The pipeline lost rank 1 (mac2)."))
    qtbot.waitUntil(lambda: len(lost.local) == 2)
    assert "load" not in lost.local[1].names()
    # Meanwhile no message goes to the engine that has no model yet.
    assert not lost.c.model_ready
    lost.c.activity.end(job)
    assert lost.local[1].last("load")[1] == ("big",)
    assert not lost.c.send("Still there?")
    assert errors[-1].startswith("The model is still loading; your message is kept")


def test_a_lost_pipeline_says_when_the_model_does_not_fit_here(qtbot, lost,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(controller_module, "fits_here",
                        lambda path: "Loading big needs about 40 GB of memory.")
    errors: list[str] = []
    states: list[tuple[str, bool]] = []
    lost.c.errorRaised.connect(errors.append)
    lost.c.modelStateChanged.connect(lambda text, ready: states.append((text, ready)))
    lost.remote[0].on_event(PipelineLost("The pipeline lost rank 1 (mac2)."))
    qtbot.waitUntil(lambda: bool(errors))
    assert errors[0].startswith("The pipeline lost rank 1 (mac2). big does not fit on this "
                                "Mac alone, so no model is loaded: Loading big needs")
    assert states[-1] == ("No model (big does not fit on this Mac alone)", False)
    assert not lost.c.model_ready and "load" not in lost.local[1].names()
    # A late failure of a request the pipeline still owed reaches no one twice.
    lost.remote[0].on_event(Failed(99, "gone", "GroupLost"))
    qtbot.wait(20)
    assert len(errors) == 1
    assert states[-1] == ("No model (big does not fit on this Mac alone)", False)


def test_turning_other_macs_off_loads_the_model_here(qtbot, lost) -> None:
    lost.c.settings.pipeline_enabled = False
    lost.c.machines_changed()
    assert lost.bridge.worker is lost.local[1] and lost.c.machines.pipeline is None
    assert lost.local[1].last("load")[1] == ("big",)
    lost.c.machines_changed()  # nothing changed since: no second load
    assert lost.local[1].names().count("load") == 1


def test_a_save_after_a_lost_pipeline_loads_nothing_again(qtbot, lost, monkeypatch) -> None:
    # Fallen back here under unchanged settings: a Save of any other setting started
    # the pipeline again (all chats' caches closed, minutes of loading on the Macs).
    monkeypatch.setattr(controller_module, "fits_here", lambda path: "")
    lost.remote[0].on_event(PipelineLost("The pipeline lost rank 1 (mac2)."))
    qtbot.waitUntil(lambda: len(lost.local) == 2)
    rid = lost.local[1].last("load")[0]
    lost.local[1].on_event(ModelLoaded(rid, SimpleNamespace(name="big", path="big")))
    lost.local[1].on_event(Finished(rid, "done"))
    qtbot.waitUntil(lambda: lost.c.model_ready)
    lost.c.machines_changed()  # Settings saved, nothing of the Macs changed
    assert len(lost.remote) == 1 and lost.bridge.worker is lost.local[1]
    # A host taken out of the hostfile in place is a change: loaded where it now runs.
    hostfile = Path(lost.c.settings.pipeline_hostfile)
    hostfile.write_text(json.dumps({"hosts": [{"ssh": "127.0.0.1"}] * 3}), encoding="utf-8")
    lost.c.machines_changed()
    assert len(lost.remote) == 2 and lost.bridge.worker is lost.remote[1]


def test_a_missing_hostfile_loads_on_this_mac_and_says_why(qtbot, lost, tmp_path) -> None:
    errors: list[str] = []
    lost.c.errorRaised.connect(errors.append)
    lost.c.settings.pipeline_hostfile = str(tmp_path / "gone.json")
    lost.c.load_model("big")
    assert lost.bridge.worker is lost.local[1]
    assert "gone.json" in errors[0] and errors[0].endswith("on this Mac alone.")
    assert lost.local[1].last("load")[1] == ("big",)


def test_settings_unchanged_are_not_sent_again(qtbot) -> None:
    # Settings' OK with nothing changed sends nothing: a change of settings may
    # hold new chats back while others answer.
    made: list[EventfulWorker] = []
    bridge = EngineBridge(budget_bytes=None, chunk_size=512, read_share=0.5,
                          worker_factory=_factory(made))
    bridge.start()
    (worker,) = made
    assert bridge.configure(None, 512, 0.5) is None
    assert bridge.configure(None, 512, 0.25) is not None
    assert bridge.configure(None, 512, 0.25) is None
    assert worker.names() == ["configure"]
    bridge.shutdown(0)


class StoppedWorker(ScriptedWorker):
    """A worker whose engine thread stopped on a bug: it takes no request."""

    def chat(self, *args, **kwargs) -> int:
        raise EngineStopped("The engine stopped on an unexpected error (RuntimeError: x).")

    close_session = chat


def test_a_request_the_stopped_engine_refuses_fails_at_its_handler(qtbot) -> None:
    bridge = EngineBridge(worker_factory=lambda *_: StoppedWorker())
    bridge.start()
    seen: list[object] = []
    rid = bridge.chat("s", [], None, seen.append)
    failed: list[object] = []
    bridge.failed.connect(failed.append)
    bridge.close_session("s")  # no handler: the window's banner says it
    qtbot.waitUntil(lambda: bool(seen) and bool(failed))
    assert seen == [Failed(rid, "The engine stopped on an unexpected error (RuntimeError: x).",
                           "EngineStopped")]
    assert bridge.pending == 0
    bridge.shutdown(0)


def test_the_apps_stored_kv_counts_the_local_servers_against_one_budget(qtbot) -> None:
    """The app's stored KV and the local server's live in two folders under one
    disk budget: the app counts the server's too (as the server counts the app's),
    and its listing says how much of the budget the server's takes."""
    from engine import StoredKv, server_snapshots_dir

    (server_snapshots_dir() / "api-x.0.p1.safetensors").write_bytes(b"\0" * 4096)
    bridge = EngineBridge()
    bridge.start()
    try:
        with qtbot.waitSignal(bridge.storedKv, timeout=30_000,
                              check_params_cb=lambda e: isinstance(e, StoredKv)) as listed:
            bridge.set_snapshot_budget(1 << 20)
    finally:
        assert bridge.shutdown(10.0)
    assert listed.args[0].elsewhere_bytes == 4096
