"""``python -m kvreplay.paper``: ``make paper`` (:func:`kvreplay.paper.main`)."""

import sys

from . import main

sys.exit(main())
