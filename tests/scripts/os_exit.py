"""Import torch, print, then leave with ``os._exit(CODE)`` (as scripts do to skip a slow teardown).

Usage: os_exit.py CODE
"""

import os
import sys

import torch

print(f"rank {os.environ['RANK']} torch {torch.__version__} leaving with {sys.argv[1]}", flush=True)
os._exit(int(sys.argv[1]))
