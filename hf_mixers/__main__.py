"""``python -m hf_mixers ...`` is the ``hf-mixers`` command (what torchrun and ``accelerate launch -m`` start)."""

import sys

from .apps.cli import main

sys.exit(main())
