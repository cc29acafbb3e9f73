"""Paged attention: dispatch, the block walk, query views, scratch sizing and CPU streams."""
