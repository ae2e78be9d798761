"""The error type for bad user input to the command line and config files (torch-free)."""


class UsageError(ValueError):
    """Bad input on the command line or in a config file; the CLI prints it as one line, exit code 2."""
