"""Helpers behind pins/lock, pins/check and pins/build-env (stdlib + pip only).

These scripts run before any project venv exists, so nothing here may import
third-party packages; requirement markers are read with pip's vendored
`packaging` (see markers.py).
"""
