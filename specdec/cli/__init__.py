"""The `specd` command line."""
