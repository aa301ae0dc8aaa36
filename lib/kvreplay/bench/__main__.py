"""``python -m kvreplay.bench``: the measurements on a device (:func:`kvreplay.bench.main`)."""

import sys

from . import main

sys.exit(main())
