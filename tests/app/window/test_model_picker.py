"""The model picker on its own: discovered folders, the demo, choosing one."""

from __future__ import annotations

from app.window.model_picker import DEMO, ModelPicker
from tests.app.layout import clipped_texts


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


def test_the_demos_folder_is_the_demo_item_once_with_its_facts(qtbot, tiny_llama) -> None:
    import shutil

    from engine.models.discovery import DEMO_FOLDER
    from engine.paths import models_dir

    shutil.copytree(tiny_llama, models_dir() / DEMO_FOLDER)
    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.discovered, timeout=30_000):
        picker.refresh([str(tiny_llama.parent)])
    texts = [picker.itemText(i) for i in range(picker.count())]
    assert sum("SmolLM2" in t for t in texts) == 1
    assert picker.findData(str(models_dir() / DEMO_FOLDER)) < 0
    assert texts[0].endswith("4k context")
    assert "in q6: " in picker.itemData(0, 3)
    tiny = picker.itemText(picker.findData(str(tiny_llama)))
    assert " · " in tiny and tiny.endswith("4k context")
    assert "KB" in tiny or "MB" in tiny  # its size on disk
    tooltip = picker.itemData(picker.findData(str(tiny_llama)), 3)
    for mode in ("fp16", "q8", "q6", "q4"):
        assert f"4k in {mode}: " in tooltip
    assert "— fits" in tooltip
    assert picker.installed()[0].path == str(models_dir() / DEMO_FOLDER)
    picker.wait()


def test_models_entry_asks_for_the_library(qtbot) -> None:
    from app.window.model_picker import MANAGE

    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.manageRequested):
        picker.activated.emit(picker.findData(MANAGE))
    assert picker.currentData() == DEMO


def test_long_names_do_not_widen_the_toolbar(qtbot) -> None:
    picker = ModelPicker()
    qtbot.addWidget(picker)
    long_name = "Qwen3-Next-80B-A3B-Instruct-4bit-converted-here-from-the-original-weights"
    picker.set_current("/models/" + long_name)
    picker.show()  # a combo box sizes itself to its items when first shown
    qtbot.waitExposed(picker)
    assert picker.width() <= 360
    assert clipped_texts(picker) == []  # shortened in the middle, never cut
    assert picker.currentData() == "/models/" + long_name
    picker._fill()  # after a scan too
    assert picker.width() <= 360 and clipped_texts(picker) == []
    assert picker.view().minimumWidth() >= picker.fontMetrics().horizontalAdvance(
        picker.currentText())


def test_each_model_says_whether_it_can_be_split_across_macs(qtbot, tmp_path) -> None:
    from tests.engine.tinymodels import make_tiny_model_dir

    folders = {arch: make_tiny_model_dir(tmp_path, arch) for arch in ("llama", "qwen3_next")}
    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.discovered, timeout=60_000):
        picker.refresh([str(tmp_path)])
    tips = {arch: picker.itemData(picker.findData(str(folder)), 3)
            for arch, folder in folders.items()}
    assert "Can be split across Macs" in tips["qwen3_next"]
    assert "Runs on one Mac only" in tips["llama"]
    picker.wait()
