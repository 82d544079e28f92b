"""`python -m dejavu_sdk.cli ...`: the `dejavu` command without the console script.

Child processes start this way (`dejavu_sdk.testing.peers` runs `serve-store`), so they use the interpreter that
started them whatever is on PATH.
"""

import sys

from . import main

sys.exit(main())
