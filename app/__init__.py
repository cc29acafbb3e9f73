"""Longleaf's Qt front end."""
