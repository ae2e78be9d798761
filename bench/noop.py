"""Print one line and exit: measures the launcher alone."""

import os

print(f"rank {os.environ.get('RANK')} up", flush=True)
