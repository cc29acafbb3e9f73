"""The main window and its parts: toolbar and menus, banner, dialogs, model picker."""
