"""Command-line interface: the `cachecraft` typer app."""
