"""Workers announce they are ready, then wait; on SIGTERM each writes a marker file and exits 143."""

import os
import signal
import sys
import time
from pathlib import Path

marker_dir = Path(sys.argv[1])


def on_term(signum, frame):
    (marker_dir / f"term_{os.environ['RANK']}").write_text("got SIGTERM")
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
(marker_dir / f"ready_{os.environ['RANK']}").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
