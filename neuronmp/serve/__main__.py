"""``python -m neuronmp.serve``: the neuronmp-serve command (see neuronmp.server)."""
import sys

from ..server.__main__ import main

sys.exit(main())
