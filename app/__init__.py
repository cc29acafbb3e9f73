"""Longleaf's Qt front end."""

import os

# superqt reaches Qt through qtpy: name the binding Longleaf uses, whatever else the
# environment holds.
os.environ.setdefault("QT_API", "pyside6")
