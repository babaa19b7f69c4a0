"""Command-line interface: the `cachecraft` typer app."""

import time

# When the command began (this package is imported first): `query` reports the whole
# command's time from here, imports and start-up included.
STARTED = time.perf_counter()
