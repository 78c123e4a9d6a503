"""Front ends: one module per command; each parses, validates, calls one library function and renders."""


def main() -> None:
    """The console script: Ctrl-C while the command's modules import exits 130 at once, without
    the traceback Python would print from inside an import."""
    from specrun.cli.interrupts import exit_at_once_on_interrupt

    exit_at_once_on_interrupt()
    from specrun.cli.app import main as run_app

    run_app()
