"""The page grid: one cell per page of the storage, its free pages once."""

from __future__ import annotations

from PySide6.QtGui import QColor

from app.memory.charts import CELL, GAP, MAX_CELLS, MAX_ROWS, PagePoolView


def _grid(qtbot, columns: int) -> PagePoolView:
    grid = PagePoolView()
    qtbot.addWidget(grid)
    grid.resize(columns * (CELL + GAP) - GAP, 100)
    return grid


def test_the_storage_is_drawn_once_its_free_pages_included(qtbot) -> None:
    grid = _grid(qtbot, columns=4)
    # 5 pages in use, 1 other chat's, 2 free: 8 pages of storage, two rows of four.
    grid.set_pages(5, 8, 2, 0.5, QColor("#2f7d5b"))
    assert grid.pages_per_cell() == 1
    assert grid.sizeHint().height() == 2 * (CELL + GAP)


def test_a_square_stands_for_the_storage_share_it_says(qtbot) -> None:
    grid = _grid(qtbot, columns=MAX_CELLS // MAX_ROWS)
    grid.set_pages(MAX_CELLS // 2, MAX_CELLS, MAX_CELLS // 2, 1.0, QColor("#2f7d5b"))
    assert grid.pages_per_cell() == 1  # the grid holds every page: one each
