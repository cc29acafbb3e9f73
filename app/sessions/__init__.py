"""Chat sessions: the session list and creating, switching, renaming, deleting, reopening."""
