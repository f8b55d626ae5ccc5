"""The ``ds4jax`` subcommands: each module has ``add_parser(subparsers)`` and ``run(args) -> int`` and is
registered by one line in `ds4jax.cli.SUBCOMMANDS`. Module tops import only the standard library, so
``ds4jax --help`` stays fast; the work is imported inside ``run``."""
