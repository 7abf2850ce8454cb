"""The exit statuses of `specd`'s sub-commands."""

EXIT_OK = 0
EXIT_ERROR = 1  # the command ran and failed (a model not found, a measurement refused)
EXIT_USAGE = 2  # bad flags (argparse's own status)
EXIT_INTERRUPTED = 130  # Ctrl-C
