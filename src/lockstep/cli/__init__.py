"""The ``lockstep`` command line: one module per subcommand."""
