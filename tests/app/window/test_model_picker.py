"""The model picker on its own: discovered folders, the demo, choosing one."""

from __future__ import annotations

from app.window.model_picker import DEMO, ModelPicker


def test_model_picker_lists_discovered_folders(qtbot, tiny_llama) -> None:
    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.discovered, timeout=30_000) as found:
        picker.refresh([str(tiny_llama.parent)])
    assert found.args[0] >= 1
    index = picker.findData(str(tiny_llama))
    assert index > 0
    assert "attention layers" in picker.itemData(index, 3)  # tooltip role
    assert picker.itemData(0) == DEMO
    with qtbot.waitSignal(picker.modelChosen) as chosen:
        picker.activated.emit(index)
    assert chosen.args == [str(tiny_llama)]
    picker.wait()
