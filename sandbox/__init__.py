"""Running untrusted code (Docker and local providers). Imports nothing else of this project."""
