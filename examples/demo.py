"""The demo as a script: `python examples/demo.py [options]` is `python -m hf_paged_t5 demo [options]`."""

import sys

from hf_paged_t5.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
