"""Command-line interface: ``bigmem.cli.main.main(argv) -> int``."""
